"""Attention layers with one interface: ``forward(x, *, rope=None, causal=False, attn_mask=None)``.

* :class:`MultiheadAttention`: the baseline Transformer layer.
* :class:`MultiheadDiffAttn`: differential attention V1 (the paper; unilm's and timm's modules).
* :class:`DiffAttnV2`: DIFF V2 (2H query heads, per-token ``sigmoid`` lambda, no sub-norm).

All take ``x`` of shape ``(B, N, embed_dim)`` and return the same shape. Optional keywords:
``context`` ``(B, M, kdim)`` for cross-attention (V1 and baseline) and ``cache`` (a :class:`KVCache`, which grows
by concatenation, or a :class:`StaticKVCache`, preallocated and written in place) for step-by-step decoding, which
equals the full causal forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from einops import rearrange

from diffattn_tutorial import backends, functional
from diffattn_tutorial.backend_table import PLAIN_BACKENDS
from diffattn_tutorial.layers.rope import apply_rope, check_rope
from diffattn_tutorial.validation import check_causal

Tensor = torch.Tensor
Rope = Optional[tuple[Tensor, Tensor]]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, with an optional learnable scale (see :func:`functional.rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if affine else None

    def forward(self, x: Tensor) -> Tensor:
        return functional.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


def _plain_rms_norm(module: nn.Module) -> bool:
    """Whether calling ``module`` runs :class:`RMSNorm`'s formula and nothing else: no subclass or replacement, no
    hook of its own or global (a layer may then apply the formula itself, in place)."""
    hooks = nn.modules.module
    return type(module) is RMSNorm and not (module._forward_hooks or module._forward_pre_hooks
                                            or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


class KVCache:
    """Keys and values of the tokens decoded so far (after RoPE), ``(B, heads, T, dim)`` each.

    Pass the same cache to every step: ``layer(x_t, rope=rope_cos_sin(1, r, offset=t), causal=True, cache=c)``.
    """

    def __init__(self) -> None:
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None

    @property
    def seq_len(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` (new tokens on dim 2) and return everything cached."""
        if self.k is not None and (self.k.shape[:2] != k.shape[:2] or self.k.shape[3] != k.shape[3]):
            raise ValueError(f"this cache holds keys of shape {tuple(self.k.shape)}, the new ones are "
                             f"{tuple(k.shape)}: use one KVCache per layer and batch")
        # a tensor of its own from the first update on, contiguous like every concatenation (not a view of the
        # projection): a compiled step then meets the same kind of tensor every token and compiles once
        own = torch.contiguous_format
        self.k = k.clone(memory_format=own) if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v.clone(memory_format=own) if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = None


class StaticKVCache:
    """Keys and values preallocated for ``max_len`` positions, ``(B, heads, max_len, dim)`` each, written in place
    (where autograd records the step, into new buffers of the same shape: the earlier steps' backward reads the old).

    Every step has the same shapes (what ``torch.compile`` needs to compile a decode step once): the layer
    attends over the whole buffer, and the mask from :meth:`attn_mask` hides the positions not written yet.
    Before each step, :meth:`seek` says where its tokens go (a ``(N,)`` long tensor: a tensor, not a Python
    number, so that a compiled step does not specialise on the position)::

        cache.seek(torch.tensor([t]))
        layer(x_t, rope=..., attn_mask=cache.attn_mask(), cache=cache)

    The buffers are allocated by the first update (zeros, in the new keys' dtype and device). Positions must be
    written in order from 0: a query at position ``p`` sees every key at ``0..p``.
    """

    def __init__(self, max_len: int) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive whole number (positions to hold), got {max_len!r}")
        self.max_len = max_len
        self.k: Optional[Tensor] = None
        self.v: Optional[Tensor] = None
        self.positions: Optional[Tensor] = None

    def seek(self, positions: Tensor) -> None:
        """The positions the next update writes, ``(N,)`` long (one per new token, on the cache's device)."""
        if not isinstance(positions, Tensor) or positions.ndim != 1 or positions.dtype != torch.long:
            raise ValueError("positions must be a 1-D torch.long tensor, one position per new token, e.g. "
                             "torch.tensor([t])")
        self.positions = positions

    def attn_mask(self) -> Tensor:
        """Bool ``(N, max_len)``: the keys each of the current tokens may attend to (written, and not after it)."""
        if self.positions is None:
            raise ValueError("call seek(positions) first: the mask depends on where the tokens sit")
        keys = torch.arange(self.max_len, device=self.positions.device)
        return keys[None, :] <= self.positions[:, None]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` (new tokens on dim 2) at the positions of :meth:`seek`; return the whole buffers."""
        if self.positions is None or self.positions.shape[0] != k.shape[2]:
            raise ValueError(f"call seek(positions) with one position per new token ({k.shape[2]}) before the "
                             f"layer writes to this StaticKVCache")
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:2], self.max_len, k.shape[3])
            self.v = v.new_zeros(*v.shape[:2], self.max_len, v.shape[3])
        elif self.k.shape[:2] != k.shape[:2] or self.k.shape[3] != k.shape[3] or self.v.shape[3] != v.shape[3]:
            raise ValueError(f"this cache holds keys of shape {tuple(self.k.shape)}, the new ones are "
                             f"{tuple(k.shape)}: use one StaticKVCache per layer and batch")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self.k.requires_grad):
            # autograd records the step: new buffers, as the earlier steps' backward reads the old ones
            self.k, self.v = self.k.index_copy(2, self.positions, k), self.v.index_copy(2, self.positions, v)
        else:
            self.k.index_copy_(2, self.positions, k)
            self.v.index_copy_(2, self.positions, v)
        return self.k, self.v

    def reset(self) -> None:
        self.k = self.v = self.positions = None


class _Attention(nn.Module):
    """Shared plumbing: input checks, q/k/v projection, qk-norm, RoPE and the KV cache."""

    embed_dim: int
    head_dim: int
    kdim: int
    rope_interleaved: bool
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear

    def _check_x(self, x: Tensor, context: Optional[Tensor], rope: Rope, cache: Optional[KVCache],
                 causal: bool) -> None:
        check_causal(causal)  # before a cache is written
        if not isinstance(x, Tensor) or x.ndim != 3 or x.shape[-1] != self.embed_dim:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, N, embed_dim={self.embed_dim}), got {shape}")
        w = self.q_proj.weight
        if x.dtype != w.dtype:
            raise TypeError(f"x is {x.dtype} but the layer's weights are {w.dtype}: cast with x.to({w.dtype}) "
                            f"or the layer with .to({x.dtype})")
        if x.device != w.device:
            raise ValueError(f"x is on {x.device} but the layer is on {w.device}: move one with .to(...)")
        if context is not None:
            if not isinstance(context, Tensor) or context.ndim != 3 or context.shape[0] != x.shape[0] \
                    or context.shape[-1] != self.kdim:
                shape = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
                raise ValueError(f"context must be (B={x.shape[0]}, M, kdim={self.kdim}), got {shape}")
            if context.dtype != x.dtype or context.device != x.device:
                raise TypeError(f"context ({context.dtype}, {context.device}) must match x ({x.dtype}, {x.device})")
            if rope is not None or cache is not None:
                raise ValueError("rope and cache are for self-attention; pass context without rope/cache "
                                 "(cross-attention keys have no positions relative to the queries)")

    def project_qkv(self, x: Tensor, context: Optional[Tensor], rope: Rope, cache: Optional[KVCache],
                    q_heads: int, k_heads: int, v_heads: int) -> tuple[Tensor, Tensor, Tensor]:
        """Project to ``q (B, q_heads, N, hd)``, ``k (B, k_heads, M, hd)``, ``v (B, v_heads, M, dv)``: the heads
        after query/key norm, RoPE and the cache, as the layer's forward sees them (probes and checks read them)."""
        src = x if context is None else context
        q = rearrange(self.q_proj(x), "b n (h d) -> b h n d", h=q_heads)
        k = rearrange(self.k_proj(src), "b n (h d) -> b h n d", h=k_heads)
        v = rearrange(self.v_proj(src), "b n (h d) -> b h n d", h=v_heads)
        q, k = self._qk_norm(q, k)
        if rope is not None:
            cos, sin = check_rope(rope, x.shape[1], self.head_dim)
            q = apply_rope(q, cos, sin, interleaved=self.rope_interleaved)
            k = apply_rope(k, cos, sin, interleaved=self.rope_interleaved)
        if cache is not None:
            k, v = cache.update(k, v)
        return q, k, v


    def _qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k


class MultiheadAttention(_Attention):
    """Baseline multi-head softmax attention (GQA, RoPE, masks, cross-attention, KV cache).

    Args:
        embed_dim: model width C; ``head_dim = C // num_heads``.
        num_heads: attention heads H. num_kv_heads: KV heads (GQA), dividing H; default H.
        kdim: width of a cross-attention ``context`` (default C).
        bias: biases on the projections; ``qkv_bias`` / ``out_bias`` (None: as ``bias``) set the q/k/v and the
            output projection's apart (Qwen2 has q/k/v biases and none on the output).
        dropout: attention dropout (training only).
        backend: ``"auto"``, ``"naive"`` or ``"sdpa"``. rope_interleaved: GPT-J (True) or NeoX layout.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 kdim: Optional[int] = None, bias: bool = False, dropout: float = 0.0, backend: str = "auto",
                 rope_interleaved: bool = True, qkv_bias: Optional[bool] = None, out_bias: Optional[bool] = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        dd = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.dropout, self.rope_interleaved = dropout, rope_interleaved
        self.backend = backends.check_name(backend, PLAIN_BACKENDS)
        qkv_bias, out_bias = bias if qkv_bias is None else qkv_bias, bias if out_bias is None else out_bias
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=qkv_bias, **dd)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * self.head_dim, bias=qkv_bias, **dd)
        self.v_proj = nn.Linear(self.kdim, num_kv_heads * self.head_dim, bias=qkv_bias, **dd)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_bias, **dd)

    def forward(self, x: Tensor, *, rope: Rope = None, causal: bool = False, attn_mask: Optional[Tensor] = None,
                context: Optional[Tensor] = None, cache: Optional[KVCache] = None) -> Tensor:
        """``x (B, N, C) -> (B, N, C)``; ``attn_mask`` broadcastable to ``(B, H, N, M)``."""
        self._check_x(x, context, rope, cache, causal)
        q, k, v = self.project_qkv(x, context, rope, cache, self.num_heads, self.num_kv_heads, self.num_kv_heads)
        out = functional.softmax_attention(q, k, v, causal=causal, attn_mask=attn_mask,
                                           dropout_p=self.dropout if self.training else 0.0, backend=self.backend)
        return self.out_proj(rearrange(out, "b h n d -> b n (h d)"))


class MultiheadDiffAttn(_Attention):
    """Differential attention V1 (Ye et al. 2024), as unilm's ``MultiheadDiffAttn`` and timm's ``DiffAttention``.

    ``num_heads`` counts **differential** heads H (half a parameter-matched baseline's). Each has two q/k
    maps of width ``head_dim = embed_dim // num_heads // 2`` and one value of width ``2 * head_dim``.
    Output per head: ``subln(A1 v - lambda A2 v) * (1 - lambda_init)``, then ``out_proj``.

    Names mirror the reference this layer reproduces, unilm's V1 ``MultiheadDiffAttn(embed_dim, ...)`` with
    ``out_proj``, so its ``state_dict`` keys are unilm's one to one; :class:`DiffAttnV2` says ``d_model`` and
    ``o_proj`` because unilm's V2 does. :mod:`diffattn_tutorial.interop` maps both, and timm's / DiffLlama's names.

    Args:
        embed_dim: model width C. num_heads: differential heads H. depth: 0-based layer index for
            ``lambda_init``. num_kv_heads: KV groups (GQA), dividing H; default H.
        head_dim: width d of one q/k map (default ``C // H // 2``); another value makes ``q_proj``
            ``C -> 2Hd`` and ``out_proj`` ``2Hd -> C`` (as Hugging Face DiffLlama's ``head_dim``).
        kdim: width of a cross-attention ``context`` (default C).
        lambda_mode: ``"paper"`` (four vectors, ``exp(lq1.lk1) - exp(lq2.lk2) + lambda_init``) or
            ``"dual"`` (timm's two scalars, ``exp(a) - exp(b) + lambda_init``).
        lambda_init: override ``lambda_init_fn(depth)`` (e.g. the paper's fixed-0.8 ablation).
        qk_norm: RMSNorm (eps ``qk_norm_eps``) on q and k per head, as timm's option.
        subln: the per-head RMSNorm and ``(1 - lambda_init)`` factor (False: the paper's ablation).
        subln_affine: learnable scale in the sub-norm (timm: True; unilm's golden file: False).
        qkv_bias, out_bias: projection biases. dropout: on the attention maps (training only).
        backend: any ``diff_attention`` backend. rope_interleaved: GPT-J (True) or NeoX RoPE layout.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, depth: int = 0, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, kdim: Optional[int] = None, lambda_mode: str = "paper",
                 lambda_init: Optional[float] = None, qk_norm: bool = False, qk_norm_eps: float = 1e-6,
                 subln: bool = True, subln_affine: bool = True,
                 subln_eps: float = 1e-5, qkv_bias: bool = False, out_bias: bool = False, dropout: float = 0.0,
                 backend: str = "auto", rope_interleaved: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None and (num_heads <= 0 or embed_dim % (2 * num_heads)):
            raise ValueError(f"embed_dim={embed_dim} must be divisible by 2 * num_heads={2 * num_heads} "
                             f"(num_heads counts differential heads, each with two maps), or pass head_dim")
        if head_dim is not None and (num_heads <= 0 or head_dim <= 0):
            raise ValueError(f"num_heads and head_dim must be positive, got num_heads={num_heads}, head_dim={head_dim}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if lambda_mode not in ("paper", "dual"):
            raise ValueError(f"lambda_mode must be 'paper' or 'dual', got {lambda_mode!r}")
        dd = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads // 2 if head_dim is None else head_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.depth, self.lambda_mode = depth, lambda_mode
        self.lambda_init = functional.lambda_init_fn(depth) if lambda_init is None else float(lambda_init)
        self.dropout, self.rope_interleaved = dropout, rope_interleaved
        self.backend = backends.check_name(backend)
        q_width, kv_width = 2 * num_heads * self.head_dim, 2 * num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, q_width, bias=qkv_bias, **dd)
        self.k_proj = nn.Linear(self.kdim, kv_width, bias=qkv_bias, **dd)
        self.v_proj = nn.Linear(self.kdim, kv_width, bias=qkv_bias, **dd)
        self.out_proj = nn.Linear(q_width, embed_dim, bias=out_bias, **dd)
        f32 = {"device": device, "dtype": torch.float32}  # lambda parameters stay float32, as the references
        if lambda_mode == "paper":
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                setattr(self, name, nn.Parameter(torch.empty(self.head_dim, **f32).normal_(0.0, 0.1)))
        else:
            self.lambda_a = nn.Parameter(torch.zeros((), **f32))
            self.lambda_b = nn.Parameter(torch.zeros((), **f32))
        self.q_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, **dd) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=qk_norm_eps, **dd) if qk_norm else None
        self.subln = RMSNorm(2 * self.head_dim, eps=subln_eps, affine=subln_affine, **dd) if subln else None
        self.register_buffer("lambda_mix", None)  # a warm-up's factor on lambda (layers.convert), else None

    def lambda_full(self) -> Tensor:
        """The layer's scalar lambda (float32, 0-dim), with gradients to its parameters; times ``lambda_mix``
        during a converted layer's warm-up (:mod:`diffattn_tutorial.layers.convert`)."""
        if self.lambda_mode == "paper":
            lam = functional.reparam_lambda(self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2,
                                            self.lambda_init)
        else:
            lam = functional.dual_lambda(self.lambda_a, self.lambda_b, self.lambda_init)
        return lam if self.lambda_mix is None else self.lambda_mix * lam

    def _qk_norm(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def attention_heads(self, x: Tensor, *, rope: Rope = None, causal: bool = False,
                        attn_mask: Optional[Tensor] = None, context: Optional[Tensor] = None,
                        cache: Optional[KVCache] = None) -> Tensor:
        """The per-head outputs before sub-norm, ``(B, H, N, 2 * head_dim)``."""
        self._check_x(x, context, rope, cache, causal)
        H, Hkv = self.num_heads, self.num_kv_heads
        q, k, v = self.project_qkv(x, context, rope, cache, 2 * H, 2 * Hkv, Hkv)
        return functional.diff_attention(q, k, v, self.lambda_full(), causal=causal, attn_mask=attn_mask,
                                         dropout_p=self.dropout if self.training else 0.0, backend=self.backend)

    def forward(self, x: Tensor, *, rope: Rope = None, causal: bool = False, attn_mask: Optional[Tensor] = None,
                context: Optional[Tensor] = None, cache: Optional[KVCache] = None) -> Tensor:
        """``x (B, N, C) -> (B, N, C)``; ``attn_mask`` broadcastable to ``(B, H, N, M)``."""
        out = self.attention_heads(x, rope=rope, causal=causal, attn_mask=attn_mask, context=context, cache=cache)
        if self.subln is not None:
            out = self._subln_scaled(out)
        return self.out_proj(rearrange(out, "b h n d -> b n (h d)"))

    def _subln_scaled(self, out: Tensor) -> Tensor:
        """``subln(out) * (1 - lambda_init)``. For :class:`RMSNorm` in float32: in place where nothing needs
        ``out``'s gradient (inference), else with a backward in fewer passes (:func:`functional.rms_norm_scaled`);
        the same forward numbers either way (:func:`functional.rms_norm_scaled_`)."""
        norm, scale = self.subln, 1 - self.lambda_init
        weight = getattr(norm, "weight", None)
        if not _plain_rms_norm(norm) or out.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
            return norm(out) * scale
        if out.requires_grad or (weight is not None and weight.requires_grad and torch.is_grad_enabled()) \
                or not (out.is_contiguous() or out.transpose(1, 2).is_contiguous()) \
                or functional.under_torch_func():  # vmap: a batched weight, an unbatched out
            return functional.rms_norm_scaled(out, weight, norm.eps, scale)
        return functional.rms_norm_scaled_(out, weight, norm.eps, scale)


class DiffAttnV2(_Attention):
    """DIFF V2 (unilm ``Diff-Transformer-V2``): one ordinary attention call over 2H query heads.

    Output head ``i`` = head ``2i`` minus ``sigmoid(lambda_proj(x))_i`` times head ``2i+1``, per token; both
    heads of a pair share their GQA group's K and V; no sub-norm; output width ``H * head_dim``.

    Names mirror the reference this layer reproduces, unilm's ``MultiheadFlashDiffV2(d_model, ...)`` with
    ``o_proj``, so its ``state_dict`` keys are unilm V2's one to one (:func:`~diffattn_tutorial.interop.from_unilm_v2`);
    :class:`MultiheadDiffAttn` says ``embed_dim`` and ``out_proj`` because unilm's V1 does. ``embed_dim`` is also
    set, for the interface the layers share.

    Args:
        d_model: model width. num_heads: output heads H (2H query heads). num_kv_heads: KV heads, dividing H.
        head_dim: per-head width (default ``d_model // num_heads``). backend: ``"auto"``, ``"naive"``, ``"sdpa"``.
        qkv_bias: biases on q/k/v (a converted Qwen2's); ``o_proj`` and ``lambda_proj`` have none.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, backend: str = "auto", rope_interleaved: bool = True,
                 qkv_bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if num_heads <= 0 or d_model % num_heads:
                raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads} (or pass head_dim)")
            head_dim = d_model // num_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}, so both "
                             f"query heads of a pair fall in one GQA group")
        dd = {"device": device, "dtype": dtype}
        self.embed_dim = self.kdim = d_model
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_interleaved = rope_interleaved
        self.backend = backends.check_name(backend, PLAIN_BACKENDS)
        self.q_proj = nn.Linear(d_model, 2 * num_heads * head_dim, bias=qkv_bias, **dd)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=qkv_bias, **dd)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=qkv_bias, **dd)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=False, **dd)
        self.lambda_proj = nn.Linear(d_model, num_heads, bias=False, **dd)
        self.register_buffer("lambda_mix", None)  # a warm-up's factor on lambda (layers.convert), else None

    def lambda_full(self, x: Tensor) -> Tensor:
        """Per-token, per-head lambda ``sigmoid(lambda_proj(x))`` as ``(B, H, N, 1)``; times ``lambda_mix`` during
        a converted layer's warm-up (:mod:`diffattn_tutorial.layers.convert`)."""
        lam = rearrange(torch.sigmoid(self.lambda_proj(x)), "b n h -> b h n 1")
        return lam if self.lambda_mix is None else self.lambda_mix * lam

    def forward(self, x: Tensor, *, rope: Rope = None, causal: bool = False, attn_mask: Optional[Tensor] = None,
                cache: Optional[KVCache] = None) -> Tensor:
        """``x (B, N, d_model) -> (B, N, d_model)``; ``attn_mask`` broadcastable to ``(B, H, N, M)``."""
        self._check_x(x, None, rope, cache, causal)
        q, k, v = self.project_qkv(x, None, rope, cache, 2 * self.num_heads, self.num_kv_heads, self.num_kv_heads)
        out = functional.diff_attention_v2(q, k, v, self.lambda_full(x), causal=causal, attn_mask=attn_mask,
                                           backend=self.backend)
        return self.o_proj(rearrange(out, "b h n d -> b n (h d)"))
