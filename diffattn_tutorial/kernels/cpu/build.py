"""Building and caching the fused CPU kernel: compiler discovery, a cache safe to share, a load once per process.

The kernel (``diff_attention_cpu.cpp``) is compiled on first use with the system's C++ compiler (``$CXX``, split
as a shell would, so ``CXX="ccache c++"`` works; else ``c++``, ``g++`` or ``clang++``; no PyTorch headers) and
cached in ``<cache_dir()>/kernels`` under a key of the source, compiler, flags and CPU. With ``DIFFATTN_CACHE=0``
it goes to a private folder of the user's in the system's temporary folder, so it is still built once.

The cache is safe to share: a build writes under a name of its own (process and thread), renames the library into
place and then writes a record of its size and SHA-256 beside it; a library is loaded only after its record
matches and its ELF headers fit in the file (a truncated library would fault when loaded). Threads of one process
build under one lock and processes under a file lock (``filelock``, on every platform). A compiler run
longer than :data:`TIMEOUT_S` is stopped with every process it started. :func:`load_once` loads and checks the
library once per process and remembers a failure until ``CXX``, ``PATH`` or the cache settings change.
The kernel's wrapper, :mod:`diffattn_tutorial.kernels.cpu.cpu_fused`, says what the library computes.
"""

from __future__ import annotations

import contextlib
import ctypes
import getpass
import hashlib
import os
import platform
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator, Optional

from filelock import FileLock

from diffattn_tutorial.paths import cache_dir

SOURCE = "diff_attention_cpu.cpp"
"""The kernel's source, inside the package."""

COMMON_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread")
NATIVE_FLAGS = ("-march=native",)  # tried first; a compiler that does not take it builds without it
OPENMP_FLAGS = ("-fopenmp",)  # tried first too: the kernel can then run on torch's OpenMP threads (cpu_fused.py)

TIMEOUT_S = 300.0
"""Seconds a compiler run may take (``--version``, or one build) before it is stopped, with what it started."""

_SETTINGS = ("CXX", "PATH", "DIFFATTN_CACHE", "XDG_CACHE_HOME", "HOME")
"""The environment a build depends on: a failure is remembered until one of these changes."""

_BUILD_LOCK = threading.Lock()  # one build at a time in this process (the file lock orders processes)
_LOAD_LOCK = threading.Lock()  # one first load (build, load, self-check) at a time
_LOADED: dict[str, object] = {}  # "lib": the checked kernel, "why": what kernel_status says about it
_FAILED: dict[tuple, str] = {}  # the settings of a failed first load -> why it failed


class KernelUnavailable(RuntimeError):
    """The fused CPU kernel cannot be built, loaded or trusted here; the message says why."""


def _command_name(cxx: Optional[list[str]]) -> str:
    """``c++`` for ``["/usr/bin/c++"]``: the compiler as a person names it (a report, or a notebook's stored output,
    should not carry this machine's paths)."""
    return shlex.join([os.path.basename(cxx[0]), *cxx[1:]]) if cxx else "?"


def compiler() -> Optional[list[str]]:
    """The command that runs the C++ compiler: ``$CXX`` split as a shell would (``"ccache c++"`` gives two
    words), its first word found on the PATH; else the first of ``c++``, ``g++``, ``clang++`` on the PATH;
    None when there is none."""
    setting = os.environ.get("CXX", "").strip()
    if setting:
        try:
            words = shlex.split(setting)
        except ValueError:  # an unbalanced quote: take it as one path
            words = [setting]
        return [shutil.which(words[0]) or words[0], *words[1:]]
    return next(([path] for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def compiler_version() -> Optional[str]:
    """The first line of the C++ compiler's ``--version`` (what a results file records), or None without one."""
    cxx = compiler()
    try:
        return _run([*cxx, "--version"]).stdout.splitlines()[0] if cxx else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def _source_text() -> str:
    return resources.files(__package__).joinpath(SOURCE).read_text()


def _cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags where Linux lists them, else its name."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cannot_write(folder: Path, error: OSError) -> str:
    return (f"the kernel cache folder {folder} cannot be written ({error}); set DIFFATTN_CACHE to a writable "
            f"folder, or use backend='sdpa_padded' (what backend='auto' does meanwhile)")


def _private_temp_dir() -> Path:
    """``DIFFATTN_CACHE=0``'s kernel folder: ``<tempfile.gettempdir()>/diffattn-<uid>``, created private (0700)
    and used only while it is a folder of this user's that no one else may write to."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    folder = Path(tempfile.gettempdir()) / f"diffattn-{uid if uid is not None else getpass.getuser()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as e:
        raise KernelUnavailable(_cannot_write(folder, e)) from e
    if uid is not None and (not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022):
        raise KernelUnavailable(f"{folder} is not a private folder of this user's (owner {info.st_uid}, mode "
                                f"{oct(info.st_mode)}), so no kernel is built or loaded there; remove it, or set "
                                f"DIFFATTN_CACHE to a folder of your own")
    return folder


def _build_dir() -> Path:

    folder = cache_dir()
    return (_private_temp_dir() if folder is None else folder) / "kernels"


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and, on POSIX, every process it started (they share its session)."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except OSError:
        pass


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing its output; past :data:`TIMEOUT_S` (or on Ctrl-C) it is stopped with what it
    started, and the error raised. Raises OSError when it cannot be started, subprocess.TimeoutExpired."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=os.name == "posix")
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except BaseException:
        _stop(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _compile(cxx: list[str], source: Path, target: Path) -> None:
    """Build ``target`` from ``source``: with the native and OpenMP flags, else without one of them, else with
    neither. Raises KernelUnavailable."""
    errors = []
    for extra in (NATIVE_FLAGS + OPENMP_FLAGS, NATIVE_FLAGS, OPENMP_FLAGS, ()):
        cmd = [*cxx, *COMMON_FLAGS, *extra, str(source), "-o", str(target)]
        try:
            run = _run(cmd)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelUnavailable(f"the C++ compiler {shlex.join(cxx)!r} could not be run ({e}); set CXX to a "
                                    f"working compiler, or use backend='sdpa_padded'") from e
        if run.returncode == 0:
            return
        errors.append(f"$ {shlex.join(cmd)}\n{run.stderr.strip()[-1500:]} (exit status {run.returncode})")
    raise KernelUnavailable("the fused CPU kernel did not compile:\n" + "\n".join(errors))


def _elf_complete(data: bytes) -> bool:
    """Whether an ELF file's header tables and the segments they name lie inside it (a truncated shared
    library passes ``dlopen``'s first checks and then faults on a missing page). Other formats: True."""
    if data[:4] != b"\x7fELF":
        return len(data) >= 4  # Mach-O, PE: the size and hash record is their check
    wide, order = data[4:5] == b"\x02", "<" if data[5:6] == b"\x01" else ">"
    head, seg = (order + "QQ", order + "IIQQQQQQ") if wide else (order + "II", order + "IIIIIIII")
    at = (0x20, 0x36) if wide else (0x1C, 0x2A)
    if len(data) < (64 if wide else 52):
        return False
    phoff, shoff = struct.unpack_from(head, data, at[0])
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, at[1])
    size = len(data)
    if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        return False
    if phnum and phentsize < struct.calcsize(seg):
        return False
    for i in range(phnum):
        fields = struct.unpack_from(seg, data, phoff + i * phentsize)
        offset, filesz = (fields[2], fields[5]) if wide else (fields[1], fields[4])
        if offset + filesz > size:
            return False
    return True


def _record(library: Path) -> Path:
    """The library's record: its SHA-256 and size, written after it is in place."""
    return library.with_suffix(".sha256")


def _describe(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}"


def _intact(library: Path) -> bool:
    """Whether ``library`` is a whole build: its record matches its bytes and (ELF) its headers fit in it."""
    try:
        record = _record(library).read_text().strip()
        data = library.read_bytes()
    except OSError:
        return False
    return record == _describe(data) and _elf_complete(data)


@contextlib.contextmanager
def _folder_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold this process's build lock and an exclusive file lock on ``folder/name.lock`` (released on exit, also
    when the process dies). Creates ``folder``."""
    with _BUILD_LOCK:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock(folder / f"{name}.lock")
            lock.acquire()
        except OSError as e:
            raise KernelUnavailable(_cannot_write(folder, e)) from e
        try:
            yield
        finally:
            lock.release()


def _build(cxx: list[str], text: str, target: Path) -> None:
    """Compile ``text`` into ``target`` through paths of this process and thread, move it into place, then
    write its record. Raises KernelUnavailable (leftovers removed)."""
    tag = f"{os.getpid()}.{threading.get_ident()}"
    source, tmp = (target.with_name(f"{target.stem}.{tag}{ext}") for ext in (".cpp", ".tmp"))
    record_tmp = target.with_name(f"{target.stem}.{tag}.sha256.tmp")
    try:
        try:
            source.write_text(text)
        except OSError as e:
            raise KernelUnavailable(_cannot_write(target.parent, e)) from e
        _compile(cxx, source, tmp)
        data = tmp.read_bytes()
        if not _elf_complete(data):
            raise KernelUnavailable(f"the compiler wrote an incomplete library ({len(data)} bytes; is the disk "
                                    f"full?); free space or set DIFFATTN_CACHE to another folder")
        try:
            os.replace(tmp, target)  # atomic: a reader sees the old file or the new one, never a part
            record_tmp.write_text(_describe(data) + "\n")
            os.replace(record_tmp, _record(target))
        except OSError as e:
            raise KernelUnavailable(_cannot_write(target.parent, e)) from e
    finally:
        for leftover in (source, tmp, record_tmp):
            with contextlib.suppress(OSError):
                leftover.unlink()


def library_path() -> Path:
    """The compiled kernel for this source, compiler and CPU, built first where the cache holds no intact copy
    (missing, unfinished, truncated or altered). Raises KernelUnavailable saying why it cannot be had."""
    cxx = compiler()
    if cxx is None:
        raise KernelUnavailable("no C++ compiler found (looked for $CXX, c++, g++, clang++): install one, or "
                                "use backend='sdpa_padded' (what backend='auto' does without it)")
    text = _source_text()
    try:
        version = _run([*cxx, "--version"]).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"the C++ compiler {shlex.join(cxx)!r} could not be run ({e}); set CXX to a "
                                f"working compiler, or use backend='sdpa_padded'") from e
    key = hashlib.sha256("\0".join([text, *cxx, version, *COMMON_FLAGS, *NATIVE_FLAGS, *OPENMP_FLAGS,
                                    platform.machine(), _cpu_fingerprint()]).encode()).hexdigest()[:16]
    folder = _build_dir()
    target = folder / f"diff_attention_cpu_{key}.so"
    if not _intact(target):
        with _folder_lock(folder, target.stem):
            if not _intact(target):  # another thread or process may have built it meanwhile
                _build(cxx, text, target)
    return target


def load_once(first_load: Callable[[], ctypes.CDLL]) -> ctypes.CDLL:
    """The library ``first_load`` builds, loads and checks, once per process (under a lock: threads that arrive
    first wait for it). A failure is remembered under the settings it happened with. Raises KernelUnavailable."""
    lib = _LOADED.get("lib")
    if lib is not None:
        return lib
    settings = tuple(os.environ.get(name) for name in _SETTINGS)
    with _LOAD_LOCK:
        if "lib" in _LOADED:
            return _LOADED["lib"]
        if settings in _FAILED:
            raise KernelUnavailable(_FAILED[settings])
        try:
            lib = first_load()
        except Exception as e:  # whatever went wrong, the kernel is not usable here: say why, fall back
            why = str(e) if isinstance(e, KernelUnavailable) else f"{type(e).__name__}: {e}"
            _FAILED[settings] = why
            raise KernelUnavailable(why) from e
        _LOADED.update(lib=lib, why=f"fused C++ kernel, compiled with {_command_name(compiler())}")
        return lib


def loaded() -> Optional[ctypes.CDLL]:
    """The library :func:`load_once` loaded in this process, or None (nothing is built or loaded here)."""
    return _LOADED.get("lib")


def loaded_note() -> str:
    """What the status says of the loaded library: the compiler, as a person names it."""
    return str(_LOADED.get("why", "fused C++ kernel"))


__all__ = ["SOURCE", "TIMEOUT_S", "KernelUnavailable", "compiler", "compiler_version", "library_path", "load_once", "loaded", "loaded_note"]
