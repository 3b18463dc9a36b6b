"""A tiny decoder-only language model whose attention is switchable: ``"baseline"``, ``"diff"`` or ``"diff_v2"``.

Pre-norm blocks (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual), RoPE on q and k, a final
RMSNorm and an untied LM head. The attention layers are the library's own modules:

* ``"baseline"``: :class:`~diffattn_tutorial.layers.attention.MultiheadAttention` with ``n_heads`` heads of width
  ``head_dim = d_model // n_heads``.
* ``"diff"``: :class:`~diffattn_tutorial.layers.attention.MultiheadDiffAttn` with ``n_heads // 2`` differential heads
  (the paper's parameter matching: each has two q/k maps of width ``head_dim`` and a value of width
  ``2 * head_dim``, so the q/k/v/out projections have exactly the baseline's shapes); ``depth`` = layer index.
* ``"diff_v2"``: :class:`~diffattn_tutorial.layers.attention.DiffAttnV2` with ``n_heads`` output heads (``2 * n_heads``
  query heads) of width ``head_dim``, as unilm's ``Diff-Transformer-V2`` configures it next to a baseline
  with ``n_heads`` heads: its query projection is twice the baseline's, plus a small ``lambda_proj``.

>>> m = TinyLM(LMConfig(vocab_size=32, attention="diff"))
>>> m(torch.randint(0, 32, (2, 10))).shape
torch.Size([2, 10, 32])

:meth:`TinyLM.generate` decodes with a dynamic KV cache (grown by concatenation), a static one (preallocated,
written in place: fixed shapes, so ``compile=True`` compiles the decode step once per buffer size), or none
(recompute), greedy or sampled (:func:`next_token`); every cache gives the same tokens.

>>> prompt = torch.randint(0, 32, (1, 4))
>>> torch.equal(m.generate(prompt, 5, cache="static"), m.generate(prompt, 5, cache=None))
True
"""

from __future__ import annotations

import functools
import math
import numbers
import types
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffattn_tutorial.functional import (
    diff_attention_maps,
    diff_attention_v2,
    expand_kv_groups,
    softmax_attention,
)
from diffattn_tutorial.layers.attention import (
    DiffAttnV2,
    KVCache,
    MultiheadAttention,
    MultiheadDiffAttn,
    RMSNorm,
    StaticKVCache,
)
from diffattn_tutorial.layers.rope import check_llama3_scaling, rope_cos_sin
from diffattn_tutorial.measure import flops

Tensor = torch.Tensor

ATTENTIONS: tuple[str, ...] = ("baseline", "diff", "diff_v2")
"""The attention kinds :class:`TinyLM` can be built with."""

CACHES: tuple[Optional[str], ...] = ("static", "dynamic", None)
"""The ``cache`` choices of :meth:`TinyLM.generate`: preallocated and written in place, grown by concatenation,
or none (recompute the whole sequence every step)."""

STATIC_CACHE_MIN = 64
"""The smallest buffer ``generate(cache="static")`` preallocates (see :func:`static_cache_size`)."""

Cache = Union[KVCache, StaticKVCache]


@dataclass(frozen=True)
class LMConfig:
    """Shape of a :class:`TinyLM`.

    Args:
        vocab_size: number of token ids.
        attention: one of :data:`ATTENTIONS`.
        d_model: residual width. n_layers: blocks.
        n_heads: the **baseline's** head count H (head width ``d_model // H``); ``"diff"`` uses ``H // 2``
            differential heads, ``"diff_v2"`` ``H`` output heads over ``2H`` query heads.
        n_kv_heads: KV heads of the baseline (GQA); ``"diff"`` uses half as many KV groups. Default: no GQA.
        ffn_hidden: SwiGLU hidden width (default ``2 * d_model``).
        max_len: longest sequence (RoPE tables are built for it).
        rope_base: RoPE base.
        norm_eps: the epsilon of every RMSNorm (Llama checkpoints say ``rms_norm_eps``, often ``1e-6``).
        qkv_bias: biases on the q/k/v projections (Qwen2's), none on the output.
        rope_scaling: Llama 3.1's RoPE frequency scaling, its four keys
            (:data:`~diffattn_tutorial.layers.rope.LLAMA3_KEYS`) as a dict or ``(key, value)`` pairs (kept as sorted
            pairs, so the config stays hashable); None: plain RoPE.
    """

    vocab_size: int
    attention: str = "baseline"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    ffn_hidden: Optional[int] = None
    max_len: int = 512
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    rope_scaling: Optional[tuple[tuple[str, float], ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"LMConfig.qkv_bias must be True or False, got {self.qkv_bias!r}")
        if self.rope_scaling is not None:
            scaling = check_llama3_scaling(dict(self.rope_scaling))
            object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_len"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_heads", "ffn_hidden"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LMConfig.{name} must be a positive whole number, got {value!r}")
        for name in ("norm_eps", "rope_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"LMConfig.{name} must be a number > 0, got {value!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        kv = self.kv_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        if self.attention == "diff" and (self.n_heads % 2 or kv % 2):
            raise ValueError(f"'diff' halves the head count (the paper's parameter matching): n_heads={self.n_heads} "
                             f"and n_kv_heads={kv} must both be even")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"the head width d_model // n_heads = {self.d_model // self.n_heads} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        """Width of one q/k head (the same for all three attention kinds)."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


def make_attention(cfg: LMConfig, depth: int) -> nn.Module:
    """The attention layer of block ``depth`` (0-based), parameter-matched as described in the module doc."""
    if cfg.attention == "baseline":
        return MultiheadAttention(cfg.d_model, cfg.n_heads, num_kv_heads=cfg.kv_heads, qkv_bias=cfg.qkv_bias)
    if cfg.attention == "diff":
        return MultiheadDiffAttn(cfg.d_model, cfg.n_heads // 2, depth=depth, num_kv_heads=cfg.kv_heads // 2,
                                 qkv_bias=cfg.qkv_bias)
    return DiffAttnV2(cfg.d_model, cfg.n_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                      qkv_bias=cfg.qkv_bias)


class SwiGLU(nn.Module):
    """``W_down(silu(W_gate x) * W_up x)``: ``(..., d_model) -> (..., d_model)``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LMConfig, depth: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = make_attention(cfg, depth)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden or 2 * cfg.d_model)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Optional[Cache] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        """Causal over ``x``'s tokens (after the cached ones), or ``attn_mask`` instead (a static cache's). One new
        token after a cache sees every cached key, so it needs no causal mask (``causal=False``, the same result)."""
        causal = attn_mask is None and x.shape[1] > 1
        x = x + self.attn(self.attn_norm(x), rope=rope, causal=causal, attn_mask=attn_mask, cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class AttentionProbe(NamedTuple):
    """What one layer's attention does, for plots and metrics (causal; ``B`` examples, ``N`` tokens).

    ``maps``: ``(B, H, N, N)`` the weights that multiply V: softmax maps for the baseline, ``A1 - lambda A2`` for
    DIFF (rows sum to ``1 - lambda``; entries may be negative). ``logits``: ``(B, Hq, N, N)`` the pre-softmax
    scores ``q k^T / sqrt(d)`` of every query head (DIFF: both maps of every head), ``-inf`` above the diagonal.
    ``hidden``: ``(B, N, d_model)`` the residual stream after the block (Table 5's "hidden states").
    """

    maps: Tensor
    logits: Tensor
    hidden: Optional[Tensor] = None


class TinyLM(nn.Module):
    """A small decoder-only LM; ``forward(idx (B, N)) -> logits (B, N, vocab)``. See the module doc."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, depth) for depth in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        scaling = None if cfg.rope_scaling is None else dict(cfg.rope_scaling)
        cos, sin = rope_cos_sin(cfg.max_len, cfg.head_dim, base=cfg.rope_base, scaling=scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope(self, offset: int, n: int) -> tuple[Tensor, Tensor]:
        if offset + n > self.cfg.max_len:
            raise ValueError(f"sequence of {offset + n} tokens exceeds max_len={self.cfg.max_len}; "
                             f"build the model with a larger LMConfig(max_len=...)")
        return self.rope_cos[offset:offset + n], self.rope_sin[offset:offset + n]

    def _check_idx(self, idx: Tensor) -> None:
        """``idx`` refused by name unless a ``(B, N)`` long tensor of ids in ``0..vocab_size - 1`` (the values are
        not read while ``torch.compile`` traces: a graph has no data to check). Every refusal is a ``ValueError``."""
        if not isinstance(idx, Tensor):
            raise ValueError(f"idx must be a (B, N) torch.long tensor of token ids, got {type(idx).__name__}; "
                             f"e.g. torch.tensor([[1, 2, 3]])")
        if idx.ndim != 2:
            raise ValueError(f"idx must be a (B, N) tensor of token ids, got shape {tuple(idx.shape)}; "
                             f"a single sequence is idx[None] (batch of 1)")
        if idx.dtype != torch.long:
            raise ValueError(f"token ids must be integers (torch.long), got {idx.dtype}; pass idx.long() if they "
                             f"are whole numbers")
        if idx.numel() and not torch.compiler.is_compiling():
            low, high = idx.min().item(), idx.max().item()
            if low < 0 or high >= self.cfg.vocab_size:
                raise ValueError(f"token ids must be in 0..{self.cfg.vocab_size - 1} (vocab_size="
                                 f"{self.cfg.vocab_size}), got {low if low < 0 else high}; encode with this model's "
                                 f"tokenizer, or build it with a larger LMConfig(vocab_size=...)")

    def forward(self, idx: Tensor, *, caches: Optional[Sequence[Cache]] = None,
                positions: Optional[Tensor] = None) -> Tensor:
        """``idx (B, N)`` token ids -> logits ``(B, N, vocab)``.

        With ``caches`` (one per layer) the tokens continue the cached sequence and their keys/values are stored.
        :class:`KVCache` (grows by concatenation): the positions start at the cache length. :class:`StaticKVCache`
        (preallocated, written in place): pass ``positions``, the ``(N,)`` long tensor of the tokens' positions.
        """
        self._check_idx(idx)
        return self._forward(idx, caches, positions)

    def _forward(self, idx: Tensor, caches: Optional[Sequence[Cache]], positions: Optional[Tensor]) -> Tensor:
        """:meth:`forward` after the check of ``idx`` (what the decode steps run: their tokens are the model's own)."""
        if caches is None:
            return self._logits(idx, self._rope(0, idx.shape[1]), [None] * len(self.blocks))
        if len(caches) != len(self.blocks):
            raise ValueError(f"pass one KVCache per layer ({len(self.blocks)}), got {len(caches)}")
        if not isinstance(caches[0], StaticKVCache):
            if positions is not None:
                raise ValueError("positions= is for StaticKVCache caches; a KVCache continues at its own length")
            return self._logits(idx, self._rope(caches[0].seq_len, idx.shape[1]), caches)
        if positions is None:
            raise ValueError("a StaticKVCache needs positions=: the (N,) long tensor of the tokens' positions, "
                             "e.g. torch.arange(N) for a prompt, torch.tensor([t]) for the token at t")
        for cache in caches:
            cache.seek(positions)
        rope = (self.rope_cos[positions], self.rope_sin[positions])
        return self._logits(idx, rope, caches, caches[0].attn_mask())

    def _logits(self, idx: Tensor, rope: tuple[Tensor, Tensor], caches: Sequence[Optional[Cache]],
                attn_mask: Optional[Tensor] = None) -> Tensor:
        x = self.embed(idx)
        for block, cache in zip(self.blocks, caches):
            x = block(x, rope, cache, attn_mask)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, *, cache: Optional[str] = "dynamic",
                 compile: Union[bool, str, Callable] = False, temperature: float = 0.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> Tensor:
        """Decode ``max_new_tokens`` tokens after ``idx (B, N)``: returns ``(B, N + max_new_tokens)``.

        Args:
            cache: how the keys and values of past tokens are kept (see :data:`CACHES`). ``"dynamic"``: a
                :class:`KVCache` per layer, grown by ``torch.cat`` each step (a new allocation and new shapes per
                token). ``"static"``: a :class:`StaticKVCache` per layer, preallocated for ``N + max_new_tokens``
                positions rounded up to a power of two (:func:`static_cache_size`) and written in place, so
                every step has the same shapes. ``None``: no cache, every step recomputes the whole sequence.
                All three give the same tokens (in 16-bit, up to an exact tie of the top two logits, which
                rounding may break either way).
            compile: compile the decode step with ``torch.compile`` and reuse it for every token (True: the
                default ``"inductor"`` backend; otherwise the backend to use, a name such as ``"aot_eager"`` or a
                backend function). With the static cache the step is one graph of fixed shapes
                (``fullgraph=True, dynamic=False``); with the dynamic cache or none its shapes grow every token,
                so it is compiled with ``dynamic=True`` (symbolic lengths; traced when a length equals another of
                its sizes, torch gives both one symbol and compiles once more at the next length). The prompt
                runs eagerly (it runs once). Each model keeps its compiled steps for its lifetime, one per cache
                kind, backend, device and dtype (static: also per buffer size and batch size), each compiled once
                on its first call and reused by every later call with the same key: any number of models and
                lengths work in one process (``torch._dynamo.config.recompile_limit`` counts per compiled step).
            temperature: 0 (default) picks the most likely token (greedy); above 0 samples from
                ``softmax(logits / temperature)`` (see :func:`next_token`).
            top_k: sample among the ``top_k`` most likely tokens only (None: all).
            generator: the ``torch.Generator`` to sample with (None: torch's global one).
        """
        self._check_idx(idx)
        _check_cache(cache)
        temperature, top_k = _check_sampling(temperature, top_k, generator)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        _check_compile(compile)
        total = idx.shape[1] + max_new_tokens
        if idx.shape[1] == 0 or total > self.cfg.max_len:
            raise ValueError(f"the prompt ({idx.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) must be "
                             f"1..max_len={self.cfg.max_len} tokens; generate fewer, or build the model with a "
                             f"larger LMConfig(max_len=...)")
        if max_new_tokens == 0:
            return idx
        pick = functools.partial(next_token, temperature=temperature, top_k=top_k, generator=generator)
        size = static_cache_size(total, self.cfg.max_len)
        eager = functools.partial(_STEPS[cache], self)
        step = eager if compile is False else functools.partial(_compiled_step(self, cache, compile, idx, size), self)
        if cache is None:
            idx = idx.clone()  # made here like every later step's input (an inference tensor under inference_mode):
            for _ in range(max_new_tokens):  # a compiled step then meets one kind of tensor and compiles once
                idx = torch.cat([idx, pick(step(idx))], dim=1)
            return idx
        caches, positions = self._prefill_caches(cache, idx.shape[1], size, idx.device)
        logits = eager(idx, caches, positions)  # the prompt, once
        out = [idx]
        for t in range(max_new_tokens):
            out.append(pick(logits))
            if t + 1 < max_new_tokens:
                positions = None if positions is None else positions[-1:] + 1
                logits = step(out[-1], caches, positions)
        return torch.cat(out, dim=1)

    def _prefill_caches(self, cache: str, n: int, size: int,
                        device: torch.device) -> tuple[list[Cache], Optional[Tensor]]:
        """Empty caches of kind ``cache`` (static: of ``size`` positions), and the positions of an ``n``-token
        prompt."""
        if cache == "dynamic":
            return [KVCache() for _ in self.blocks], None
        return [StaticKVCache(size) for _ in self.blocks], torch.arange(n, device=device)

    @torch.no_grad()
    def probe(self, idx: Tensor) -> list[AttentionProbe]:
        """Each layer's attention maps and logits on ``idx (B, N)`` (one :class:`AttentionProbe` per layer).

        The maps come from the library's own functions on the layer's q and k (``diff_attention_maps`` for
        DIFF; ``softmax_attention`` / ``diff_attention_v2`` with an identity V, whose output *is* the map),
        so no attention formula is repeated here.
        """
        self._check_idx(idx)
        rope = self._rope(0, idx.shape[1])
        x, probes = self.embed(idx), []
        for block in self.blocks:
            maps, logits, _ = _probe_layer(block.attn, block.attn_norm(x), rope)
            x = block(x, rope)
            probes.append(AttentionProbe(maps, logits, x))
        return probes

    def num_parameters(self, attention_only: bool = False) -> int:
        """Parameter count (of the whole model, or of its attention layers only)."""
        mods = [b.attn for b in self.blocks] if attention_only else [self]
        return sum(p.numel() for m in mods for p in m.parameters())


def static_cache_size(total: int, max_len: int) -> int:
    """Positions ``generate(cache="static")`` preallocates for ``total`` tokens: the smallest power of two that
    holds them, at least :data:`STATIC_CACHE_MIN`, at most ``max_len``. Few sizes (64, 128, 256, ... then
    ``max_len``) mean few compiled steps; the positions not written yet are masked, so the size never changes
    the tokens."""
    return min(max_len, max(STATIC_CACHE_MIN, 1 << (total - 1).bit_length()))


# The decode steps: the logits of the token after ``idx``, ``(B, vocab)``, what ``generate(compile=True)``
# compiles. Functions of the model (not methods), so a compiled step holds no reference to it.

def _step_recompute(model: TinyLM, idx: Tensor, caches: None = None, positions: None = None) -> Tensor:
    return model._forward(idx, None, None)[:, -1]


def _step_dynamic(model: TinyLM, idx: Tensor, caches: Sequence[KVCache], positions: None = None) -> Tensor:
    return model._forward(idx, caches, None)[:, -1]


def _step_static(model: TinyLM, idx: Tensor, caches: Sequence[StaticKVCache], positions: Tensor) -> Tensor:
    return model._forward(idx, caches, positions)[:, -1]


_STEPS = {None: _step_recompute, "dynamic": _step_dynamic, "static": _step_static}

_COMPILED_STEPS: "weakref.WeakKeyDictionary[TinyLM, dict]" = weakref.WeakKeyDictionary()
"""Each model's compiled decode steps, by key (see :func:`_compiled_step`); dropped with the model."""


def _check_compile(compile: Union[bool, str, Callable]) -> None:
    if compile is not True and compile is not False and not isinstance(compile, str) and not callable(compile):
        raise TypeError(f"compile must be True, False or a torch.compile backend (a name such as 'inductor' or "
                        f"'aot_eager', or a backend function), got {compile!r}")
    if isinstance(compile, str):
        check_compile_backend(compile, what="compile")


def check_compile_backend(name: str, what: str) -> None:
    """Refuse a name that is not a ``torch.compile`` backend, listing every one there is (``what``: the option's
    name in the message)."""
    import torch._dynamo

    known = sorted(torch._dynamo.list_backends(exclude_tags=()))  # with the debugging ones, such as aot_eager
    if name not in known:
        raise ValueError(f"{what} {name!r} is not a torch.compile backend; choose one of {', '.join(known)} "
                         f"('eager' traces only)")


def _compiled_step(model: TinyLM, cache: Optional[str], compile: Union[bool, str, Callable], idx: Tensor,
                   size: int) -> Callable:
    """The compiled decode step of ``model`` for this call, ``step(model, idx, caches, positions)``: made on the
    first call with its key, compiled on its first use, then reused (see ``compile`` in :meth:`TinyLM.generate`).

    torch.compile keeps compiled code, and counts recompilations against ``recompile_limit``, per code object:
    one step function shared by every model and shape would recompile for each and fail past the limit (under
    ``fullgraph=True``). Each key gets a copy of the step with a code object of its own, so each compiles once."""
    backend = "inductor" if compile is True else compile
    key = (cache, backend, idx.device, model.head.weight.dtype)
    if cache == "static":
        key += (size, idx.shape[0])
    steps = _COMPILED_STEPS.setdefault(model, {})
    if key not in steps:
        fn = _STEPS[cache]
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        if cache == "static":  # fixed shapes: one graph
            steps[key] = torch.compile(own, backend=backend, fullgraph=True, dynamic=False)
        else:  # lengths grow each token: symbolic shapes
            steps[key] = torch.compile(own, backend=backend, dynamic=True)
    return steps[key]


def _check_cache(cache: Optional[str]) -> None:
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")


def _check_sampling(temperature: float, top_k: Optional[int],
                    generator: Optional[torch.Generator]) -> tuple[float, Optional[int]]:
    """``(temperature, top_k)`` as Python numbers (numpy's scalars are taken too), or an error naming the fix."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not 0 <= float(temperature) < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
        raise ValueError(f"top_k must be a whole number >= 1 (the tokens to sample among) or None, got {top_k!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)) or None, "
                        f"got {type(generator).__name__}")
    return float(temperature), None if top_k is None else int(top_k)


def next_token(logits: Tensor, *, temperature: float = 0.0, top_k: Optional[int] = None,
               generator: Optional[torch.Generator] = None) -> Tensor:
    """The next token from ``logits (B, vocab)``: ``(B, 1)`` token ids.

    ``temperature == 0``: the most likely token (greedy). Otherwise one draw (``torch.multinomial`` with
    ``generator``) from ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely tokens when
    given (ties at the ``top_k``-th value are kept); ``top_k`` at or above the vocabulary keeps every token.
    """
    temperature, top_k = _check_sampling(temperature, top_k, generator)
    if not isinstance(logits, Tensor) or logits.ndim != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        got = f"shape {tuple(logits.shape)} {logits.dtype}" if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a float tensor (B, vocab) with vocab >= 1, got {got}; for a model's "
                         f"output (B, N, vocab) pass logits[:, -1]")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    scaled = logits.float() / temperature if logits.dtype != torch.float64 else logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    try:
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)
    except RuntimeError as e:  # torch checks the probabilities as it samples: only a failure pays for naming the row
        rows = ~((torch.isfinite(scaled) | (scaled == float("-inf"))).all(-1) & (scaled > float("-inf")).any(-1))
        if not rows.any():
            raise
        raise ValueError(f"logits row {int(rows.nonzero()[0, 0])} holds NaN or +inf, or only -inf: no distribution "
                         f"to sample from (a model whose weights or inputs went non-finite?)") from e


def _probe_layer(attn: nn.Module, h: Tensor, rope: tuple[Tensor, Tensor]) -> AttentionProbe:
    """Maps and logits of one attention layer on its (normalised) input ``h (B, N, C)``."""
    B, N, _ = h.shape
    if isinstance(attn, MultiheadDiffAttn):
        q, k, v = attn.project_qkv(h, None, rope, None, 2 * attn.num_heads, 2 * attn.num_kv_heads, attn.num_kv_heads)
        _, _, maps = diff_attention_maps(q, k, attn.lambda_full(), causal=True)
        k_rep, _ = expand_kv_groups(k, v, attn.num_heads)  # key head of query head 2i + j: map j of group i // rep
    else:
        q_heads = attn.num_heads * (2 if isinstance(attn, DiffAttnV2) else 1)
        q, k, v = attn.project_qkv(h, None, rope, None, q_heads, attn.num_kv_heads, attn.num_kv_heads)
        eye = torch.eye(N, dtype=h.dtype, device=h.device).expand(B, attn.num_kv_heads, N, N)
        if isinstance(attn, DiffAttnV2):
            maps = diff_attention_v2(q, k, eye, attn.lambda_full(h), causal=True, backend="naive")
        else:
            maps = softmax_attention(q, k, eye, causal=True, backend="naive")
        k_rep = k.repeat_interleave(q_heads // attn.num_kv_heads, dim=1)
    logits = (q @ k_rep.transpose(-1, -2)) * q.shape[-1] ** -0.5
    future = torch.ones(N, N, dtype=torch.bool, device=h.device).triu(1)
    return AttentionProbe(maps=maps, logits=logits.masked_fill(future, float("-inf")))


def build_model(attention: str, vocab_size: int, **config) -> TinyLM:
    """``TinyLM(LMConfig(vocab_size, attention, **config))``."""
    return TinyLM(LMConfig(vocab_size=vocab_size, attention=attention, **config))


def parameter_counts(vocab_size: int, **config) -> dict[str, dict[str, int]]:
    """Parameters of the model for each attention kind: ``{kind: {"total": ..., "attention": ...}}``."""
    out = {}
    for kind in ATTENTIONS:
        m = build_model(kind, vocab_size, **config)
        out[kind] = {"total": m.num_parameters(), "attention": m.num_parameters(attention_only=True)}
    return out


def attention_costs(attention: str, *, d_model: int, n_heads: int, n_kv_heads: Optional[int] = None,
                    context: int = 4096, bytes_per_value: int = 2) -> dict[str, int]:
    """Per-layer costs of one attention kind at a model size, counted from the real modules (built on the
    ``meta`` device, so no memory is allocated).

    ``n_heads``/``n_kv_heads`` are the **baseline's** (as in :class:`LMConfig`). Returns

    * ``params``: parameters of the attention layer;
    * ``proj_flops``: multiply-adds x 2 of the q/k/v/out (and lambda) projections, per token;
    * ``attn_flops``: FLOPs of the attention itself for one query token over ``context`` keys, as standard
      flash kernels compute it (:mod:`diffattn_tutorial.measure.flops` counts them);
    * ``kv_bytes``: bytes of KV cache per token (keys + values), at ``bytes_per_value`` per number.
    """
    cfg = LMConfig(vocab_size=2, attention=attention, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads)
    with torch.device("meta"):
        layer = make_attention(cfg, depth=0)
    params = sum(p.numel() for p in layer.parameters())
    proj = 2 * sum(m.in_features * m.out_features for m in layer.modules() if isinstance(m, nn.Linear))
    count = (flops.diff_v1_attention_flops if isinstance(layer, MultiheadDiffAttn) else
             flops.diff_v2_attention_flops if isinstance(layer, DiffAttnV2) else flops.baseline_attention_flops)
    attn = int(count(1, layer.num_heads, 1, layer.head_dim, nk=context))  # one query token over the context
    kv = (layer.k_proj.out_features + layer.v_proj.out_features) * bytes_per_value
    return {"params": params, "proj_flops": proj, "attn_flops": attn, "kv_bytes": kv}


__all__ = ["ATTENTIONS", "CACHES", "STATIC_CACHE_MIN", "static_cache_size", "LMConfig", "TinyLM", "next_token",
           "AttentionProbe", "SwiGLU", "Block", "make_attention", "build_model", "parameter_counts", "attention_costs"]
