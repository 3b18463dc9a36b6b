"""The compile targets (:data:`ARCHS`) and what decides the compiled code, as hashes: one kernel's own source (:func:`kernel_source_hash`), one compile
(:func:`fact_key`: the cache key of a recorded row), and the whole record's sources and tables (:func:`source_hash`,
:func:`decode_source_hash`), for :mod:`~diffattn_tutorial.kernels.triton.aot`."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re


@dataclasses.dataclass(frozen=True)
class Arch:
    """A compile target and what one block (program) may use on its GPUs."""

    capability: int
    shared: int  # bytes of shared memory per block (the opt-in maximum)
    gpus: str
    dtypes: tuple[str, ...] = ("bfloat16", "float16")  # the 16-bit dtypes the library runs there
    regs_per_thread: int = 255
    regs_per_block: int = 65536

    @property
    def train_head_dim(self) -> int:
        """The largest padded head dim the library trains on this target (its backward's launches)."""
        from diffattn_tutorial.kernels.triton.configs import train_head_dim_limit

        return train_head_dim_limit(self.capability)


ARCHS = {
    "sm_90a": Arch(90, 232448, "H100, H200"),  # 227 KiB
    "sm_89": Arch(89, 101376, "L4, RTX 40xx"),  # 99 KiB
    "sm_86": Arch(86, 101376, "RTX 30xx, A10"),  # 99 KiB
    "sm_80": Arch(80, 166912, "A100"),  # 163 KiB
    "sm_75": Arch(75, 65536, "T4, RTX 20xx", dtypes=("float16",)),  # 64 KiB; no bfloat16 arithmetic
}
"""The GPUs learners have, by compile target: shared memory a block may use (the CUDA programming guide's table of
compute capabilities), 255 registers per thread and 64 K per block on each. Colab's free GPU is a T4."""
DECODE_HEAD_DIMS, DECODE_GROUPS = (64, 128), (1, 4)  # the decode cases (decode_cases): MHA and GQA 4:1


def kernel_and_form(name: str, consts: dict) -> tuple:
    """A recorded launch's kernel (in ``flash_diff.KERNELS`` or ``decode.KERNELS``) and the variant its constexprs
    select (the training kernels' forms; ``partial`` or ``combine``)."""
    from diffattn_tutorial.kernels.triton import configs, decode, flash_diff

    if name in decode.KERNELS:
        return decode.KERNELS[name], name.removeprefix("_decode_")
    return flash_diff.KERNELS[name], configs.form(name, consts) + ("/careful" if consts.get("CAREFUL") else "")


def kernel_source_hash(fn) -> str:
    """A hash of one ``@triton.jit`` kernel's own code: its source and that of every jit function it calls,
    transitively (names resolved in the module that defines each)."""
    h, seen, stack = hashlib.sha256(), set(), [fn]
    while stack:
        f = stack.pop()
        src = inspect.getsource(f.fn)
        h.update(f.fn.__name__.encode() + src.encode())
        for ident in sorted(set(re.findall(r"\b(\w+)\s*\(", src))):
            obj = f.fn.__globals__.get(ident)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and ident not in seen:
                seen.add(ident)
                stack.append(obj)
    return h.hexdigest()[:16]


def fact_key(launch, config, arch: str) -> str:
    """What decides one compile's facts: the kernel's own source (:func:`kernel_source_hash`), the flags' values,
    its constexprs and argument specialisation, the configuration, the target and Triton's version. A re-recording
    reuses every recorded row whose key is unchanged, so a change to one kernel recompiles only that kernel."""
    import triton

    from diffattn_tutorial.kernels.triton import flags

    fn, _ = kernel_and_form(launch.name, launch.consts)
    spec = sorted((k, str(v)) for k, v in launch.consts.items())
    args = [(type(a).__name__, str(getattr(a, "dtype", "")), a if isinstance(a, int) and a in (0, 1) else
             (a % 16 == 0 if isinstance(a, int) else None)) for a in launch.args.values()]
    text = repr((kernel_source_hash(fn), sorted((k, getattr(flags, k)) for k in flags.__all__), launch.name, spec,
                 args, str(config), config.num_warps, config.num_stages, arch, triton.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _hash_jit(*modules):
    """A sha256 fed with the source of every ``@triton.jit`` function of ``modules`` (the same in either mode)."""
    h = hashlib.sha256()
    for module in modules:
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
                h.update(name.encode() + inspect.getsource(obj.fn).encode())
    return h


def _config_text(config) -> str:
    """A configuration's fields, written the same under every Triton version (``str(config)`` is not: 3.9 adds
    ``ir_override``), so that a facts file compiled with another Triton names the same source hash."""
    return repr((sorted(config.kwargs.items()), config.num_warps, config.num_ctas, config.num_stages,
                 getattr(config, "maxnreg", None)))


def source_hash() -> str:
    """A hash of what decides the compiled code: the kernels' source and the configuration tables."""
    from diffattn_tutorial.kernels.triton import atomic_kernels, configs, dq_kernels, flags, flash_kernels

    h = _hash_jit(flash_kernels, dq_kernels, atomic_kernels)
    h.update(repr(sorted((k, getattr(flags, k)) for k in flags.__all__)).encode())  # the variant flags' values
    h.update(repr(sorted(configs.MEASURED_SPILLS)).encode())
    h.update(repr(sorted(configs.UNMASKED_ONLY)).encode())
    h.update(repr(sorted(configs.NON_CAUSAL_ONLY)).encode())
    for table in configs.config_tables().values():
        h.update(repr(sorted((k, [(d, [_config_text(c) for c in cs]) for d, cs in v.items()]) for k, v in table.items()))
                 .encode())
    h.update(repr(sorted((k, dataclasses.astuple(p)) for k, p in configs.PLANS.items())).encode())
    h.update(repr((sorted(configs.AMPERE_PLANS.items()),
                   {a: (t.dtypes, t.train_head_dim) for a, t in ARCHS.items()})).encode())
    return h.hexdigest()[:16]


def decode_source_hash() -> str:
    """A hash of what decides the decode kernels' code: theirs and flash_kernels' source, launch constants, targets."""
    from diffattn_tutorial.kernels.triton import decode, flags, flash_kernels

    h = _hash_jit(decode, flash_kernels)
    h.update(repr(sorted((k, getattr(flags, k)) for k in flags.__all__)).encode())
    h.update(repr((decode.WIDE_TILE, decode.BLOCK_KEYS, decode.BLOCK_KEYS_TURING, decode.MAX_SPLITS, DECODE_HEAD_DIMS,
                   DECODE_GROUPS, *(inspect.getsource(f) for f in (decode._launch_options, decode.default_block_keys,
                                                                   decode.capture_step)),
                   {a: t.dtypes for a, t in ARCHS.items()})).encode())
    return h.hexdigest()[:16]



__all__ = ["Arch", "ARCHS", "DECODE_HEAD_DIMS", "DECODE_GROUPS", "kernel_and_form", "kernel_source_hash", "fact_key",
           "source_hash", "decode_source_hash"]
