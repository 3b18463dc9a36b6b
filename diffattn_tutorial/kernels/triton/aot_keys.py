"""What decides the compiled code, as hashes: one kernel's own source (:func:`kernel_source_hash`), one compile
(:func:`fact_key`: the cache key of a recorded row), and the whole record's sources and tables (:func:`source_hash`,
:func:`decode_source_hash`), for :mod:`~diffattn_tutorial.kernels.triton.aot`."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re


def kernel_source_hash(fn) -> str:
    """A hash of one ``@triton.jit`` kernel's own code: its source and that of every jit function it calls,
    transitively (names resolved in the module that defines each)."""
    h, seen, todo = hashlib.sha256(), set(), [fn]
    while todo:
        f = todo.pop()
        src = inspect.getsource(f.fn)
        h.update(f.fn.__name__.encode() + src.encode())
        for ident in sorted(set(re.findall(r"\b(\w+)\s*\(", src))):
            obj = f.fn.__globals__.get(ident)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and ident not in seen:
                seen.add(ident)
                todo.append(obj)
    return h.hexdigest()[:16]


def fact_key(launch, config, arch: str) -> str:
    """What decides one compile's facts: the kernel's own source (:func:`kernel_source_hash`), the flags' values,
    its constexprs and argument specialisation, the configuration, the target and Triton's version. A re-recording
    reuses every recorded row whose key is unchanged, so a change to one kernel recompiles only that kernel."""
    import triton

    from diffattn_tutorial.kernels.triton import flags

    fn, _ = _aot().kernel_and_form(launch.name, launch.consts)
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


def source_hash() -> str:
    """A hash of what decides the compiled code: the kernels' source and the configuration tables."""
    from diffattn_tutorial.kernels.triton import configs, flags, flash_kernels

    h = _hash_jit(flash_kernels)
    h.update(repr(sorted((k, getattr(flags, k)) for k in flags.__all__)).encode())  # the variant flags' values
    h.update(repr(sorted(configs.MEASURED_SPILLS)).encode())
    for table in configs.config_tables().values():
        h.update(repr(sorted((k, [(d, [str(c) for c in cs]) for d, cs in v.items()]) for k, v in table.items()))
                 .encode())
    h.update(repr(sorted((k, dataclasses.astuple(p)) for k, p in configs.PLANS.items())).encode())
    h.update(repr((sorted(configs.AMPERE_PLANS.items()),
                   {a: (t.dtypes, t.train_head_dim) for a, t in _aot().ARCHS.items()})).encode())
    return h.hexdigest()[:16]


def decode_source_hash() -> str:
    """A hash of what decides the decode kernels' code: theirs and flash_kernels' source, launch constants, targets."""
    from diffattn_tutorial.kernels.triton import decode, flags, flash_kernels

    h = _hash_jit(decode, flash_kernels)
    h.update(repr(sorted((k, getattr(flags, k)) for k in flags.__all__)).encode())
    h.update(repr((decode.WIDE_TILE, decode.BLOCK_KEYS, decode.BLOCK_KEYS_TURING, decode.MAX_SPLITS, _aot().DECODE_HEAD_DIMS,
                   _aot().DECODE_GROUPS, *(inspect.getsource(f) for f in (decode._launch_options, decode.default_block_keys,
                                                                   decode.capture_step)),
                   {a: t.dtypes for a, t in _aot().ARCHS.items()})).encode())
    return h.hexdigest()[:16]


def _aot():
    from diffattn_tutorial.kernels.triton import aot

    return aot


__all__ = ["kernel_source_hash", "fact_key", "source_hash", "decode_source_hash"]
