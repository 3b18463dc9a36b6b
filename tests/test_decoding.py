"""Cached step-by-step decoding equals the full causal forward, for every module and GQA setting, with the dynamic
and the static cache; ``TinyLM.generate`` gives the same tokens with every cache, compiled or not, greedy or seeded
sampling, and refuses bad arguments by name."""

import pytest
import torch

from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn, StaticKVCache
from diffattn_tutorial.layers.rope import rope_cos_sin
from diffattn_tutorial.training.model import ATTENTIONS, CACHES, build_model, next_token, static_cache_size

LAYERS = {
    "baseline": lambda: MultiheadAttention(64, 8, num_kv_heads=2),
    "diff": lambda: MultiheadDiffAttn(64, 4, depth=3),
    "diff_gqa": lambda: MultiheadDiffAttn(64, 4, num_kv_heads=2, qk_norm=True),
    "diff_mqa_dual": lambda: MultiheadDiffAttn(64, 4, num_kv_heads=1, lambda_mode="dual"),
    "v2_gqa": lambda: DiffAttnV2(64, 4, num_kv_heads=2, head_dim=16),
}


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("prefill", [0, 3])
def test_cached_decoding_equals_full_forward(name, prefill):
    torch.manual_seed(0)
    layer = LAYERS[name]().double().eval()
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    rot = layer.head_dim
    full = layer(x, rope=rope_cos_sin(9, rot, dtype=torch.float64), causal=True)
    cache, outs = KVCache(), []
    if prefill:
        outs.append(layer(x[:, :prefill], rope=rope_cos_sin(prefill, rot, dtype=torch.float64), causal=True,
                          cache=cache))
    for t in range(prefill, 9):
        outs.append(layer(x[:, t:t + 1], rope=rope_cos_sin(1, rot, offset=t, dtype=torch.float64), causal=True,
                          cache=cache))
    assert cache.seq_len == 9
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


def test_cross_attention_uses_context_for_keys_and_values():
    torch.manual_seed(0)
    layer = MultiheadDiffAttn(64, 4, kdim=32)
    x, ctx = torch.randn(2, 5, 64), torch.randn(2, 7, 32)
    out = layer(x, context=ctx)
    assert out.shape == (2, 5, 64)
    ctx2 = ctx.clone()
    ctx2[:, -1] += 1.0
    assert not torch.allclose(layer(x, context=ctx2), out)
    pad = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    pad[:, ..., -1] = False  # masking the changed context token makes the change invisible
    torch.testing.assert_close(layer(x, context=ctx2, attn_mask=pad), layer(x, context=ctx, attn_mask=pad))


def test_dropout_only_in_training_and_gradients_flow_through_every_parameter():
    torch.manual_seed(0)
    layer = MultiheadDiffAttn(64, 4, dropout=0.5, qk_norm=True, qkv_bias=True, out_bias=True)
    x = torch.randn(2, 6, 64)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer(x, causal=True).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("backend", ["naive", "sdpa_wide", "sdpa_split", "sdpa_stacked", "chunked"])
def test_module_backends_agree(backend):
    torch.manual_seed(0)
    ref = MultiheadDiffAttn(64, 4, num_kv_heads=2).double()
    layer = MultiheadDiffAttn(64, 4, num_kv_heads=2, backend=backend).double()
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 64, dtype=torch.float64)
    mask = torch.rand(2, 1, 7, 7) > 0.3
    torch.testing.assert_close(layer(x, causal=True, attn_mask=mask), ref(x, causal=True, attn_mask=mask))


# --------------------------------------------------------------------------------------------------------------
# the static cache: preallocated, written in place, the positions not written yet masked
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("prefill", [0, 3])
def test_static_cache_decoding_equals_full_forward(name, prefill):
    torch.manual_seed(0)
    layer = LAYERS[name]().double().eval()
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    cos, sin = rope_cos_sin(16, layer.head_dim, dtype=torch.float64)  # tables for the cache's 16 positions
    full = layer(x, rope=(cos[:9], sin[:9]), causal=True)
    cache, outs = StaticKVCache(16), []
    chunks = ([torch.arange(prefill)] if prefill else []) + [torch.tensor([t]) for t in range(prefill, 9)]
    for pos in chunks:
        cache.seek(pos)
        outs.append(layer(x[:, pos], rope=(cos[pos], sin[pos]), attn_mask=cache.attn_mask(), cache=cache))
    assert cache.k.shape[2] == 16 and not cache.k[:, :, 9:].any()  # fixed size; nothing past the last token
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-10, atol=1e-12)


def test_static_cache_mask_and_refusals():
    cache = StaticKVCache(5)
    cache.seek(torch.tensor([2]))
    assert cache.attn_mask().tolist() == [[True, True, True, False, False]]
    cache.seek(torch.arange(2))  # a prompt: causal among its tokens
    assert cache.attn_mask().tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    k = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="one position per new token"):
        cache.update(k[:, :, :1], k[:, :, :1])
    cache.update(k, k)
    with pytest.raises(ValueError, match="one StaticKVCache per layer"):
        cache.seek(torch.tensor([2]))
        cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="torch.long"):
        cache.seek(torch.tensor([2.0]))
    with pytest.raises(ValueError, match="max_len"):
        StaticKVCache(0)
    with pytest.raises(ValueError, match="seek"):
        StaticKVCache(4).attn_mask()



@pytest.mark.parametrize("layer", [MultiheadDiffAttn, DiffAttnV2])
def test_gradients_through_static_cache_steps_equal_the_dynamic_caches(layer):
    """Written in place, a second step recorded by autograd overwrote what the first step's backward reads
    (PyTorch's "modified by an inplace operation" at backward time); where autograd records, the cache now writes
    new buffers, and three steps' gradients equal those through a KVCache."""
    torch.manual_seed(0)
    m, x = layer(32, 2), torch.randn(1, 3, 32)

    def grads(cache):
        m.zero_grad()
        out = []
        for t in range(3):
            if isinstance(cache, StaticKVCache):
                cache.seek(torch.tensor([t]))
                out.append(m(x[:, t:t + 1], attn_mask=cache.attn_mask(), cache=cache))
            else:
                out.append(m(x[:, t:t + 1], causal=True, cache=cache))
        torch.cat(out, 1).square().sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    static, dynamic = grads(StaticKVCache(4)), grads(KVCache())
    for n in dynamic:
        torch.testing.assert_close(static[n], dynamic[n], rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


# --------------------------------------------------------------------------------------------------------------
# TinyLM.generate: sampling, compiling the decode step, refusals
# --------------------------------------------------------------------------------------------------------------

VOCAB = 40


def lm(kind, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return build_model(kind, VOCAB, **{"max_len": 40, **kw}).to(dtype).eval()


def prompt(b=2, n=4):
    return torch.randint(0, VOCAB, (b, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ATTENTIONS)
def test_seeded_sampling_gives_the_same_tokens_with_every_cache(kind):
    m, p = lm(kind, n_kv_heads=2), prompt()
    draw = {c: m.generate(p, 12, cache=c, temperature=0.9, top_k=8, generator=torch.Generator().manual_seed(3))
            for c in CACHES}
    for cache, tokens in draw.items():
        assert torch.equal(tokens, draw["dynamic"]), cache
    other = m.generate(p, 12, temperature=0.9, top_k=8, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(other, draw["dynamic"])  # the generator decides: another seed, other tokens
    assert not torch.equal(draw["dynamic"], m.generate(p, 12))  # it sampled, not the greedy tokens


def test_next_token_greedy_top_k_and_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g, dtype=torch.float64)
    greedy = logits.argmax(-1, keepdim=True)
    assert torch.equal(next_token(logits), greedy)
    assert torch.equal(next_token(logits, temperature=5.0, top_k=1, generator=g), greedy)  # one candidate left
    top3 = logits.topk(3, dim=-1).indices
    draws = torch.cat([next_token(logits, temperature=2.0, top_k=3, generator=g) for _ in range(200)], dim=1)
    for row in range(3):
        assert set(draws[row].tolist()) == set(top3[row].tolist())  # only the top 3, and each of them
    many = torch.cat([next_token(logits, temperature=1.0, top_k=VOCAB + 5, generator=g) for _ in range(300)], 1)
    assert len(set(many[0].tolist())) > 3  # top_k beyond the vocabulary keeps every token
    a = next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(7)))


def test_float32_decode_steps_run_naive_and_the_prompt_the_fused_kernel(monkeypatch):
    """In float32 inference ``backend="auto"`` sends DIFF's one-query decode steps to ``naive`` (the fastest for one
    row: benchmarks/bench_cpu_queries.py) and the prompt's many rows to the fused CPU kernel (where it builds), with
    either cache, and the tokens agree with recomputation."""
    from diffattn_tutorial import formulations
    from diffattn_tutorial.kernels.cpu import cpu_fused

    if not cpu_fused.kernel_status()[0]:
        pytest.skip(f"the fused CPU kernel is unavailable here: {cpu_fused.kernel_status()[1]}")
    fused, naive = [], []
    real_fused, real_naive = cpu_fused.fused_diff_attention, formulations.naive
    monkeypatch.setattr(cpu_fused, "fused_diff_attention", lambda q, *a, **kw: fused.append(q.shape) or real_fused(q, *a, **kw))
    monkeypatch.setattr(formulations, "naive", lambda q, *a, **kw: naive.append(q.shape) or real_naive(q, *a, **kw))
    m, p = lm("diff", torch.float32, n_kv_heads=2), prompt()
    for cache in ("static", "dynamic"):
        fused.clear()
        naive.clear()
        assert torch.equal(m.generate(p, 6, cache=cache), m.generate(p, 6, cache=None))
        assert len([s for s in naive if s[2] == 1]) == 5 * len(m.blocks), cache  # every decode step of every layer
        assert not [s for s in fused if s[2] == 1] and [s for s in fused if s[2] == p.shape[1]], cache


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(name):
    """A ``torch.compile`` backend that compiles with ``name`` and records each compilation: the set of
    ``(frame, compile)`` ids it was called for (a restarted analysis calls it again under the same id)."""
    compiles = set()

    def backend(gm, example_inputs):
        cid = torch._guards.CompileContext.current_compile_id()
        compiles.add((cid.frame_id, cid.frame_compile_id))
        return torch._dynamo.lookup_backend(name)(gm, example_inputs)

    return backend, compiles


@torch._dynamo.config.patch(recompile_limit=1)  # monkeypatch's undo hid the entry for the rest of the process
def test_compiled_static_step_compiles_once_per_model_and_buffer_and_gives_the_same_tokens(fresh_dynamo):
    """One compilation for every step and every later call with the same buffer (a power of two) and batch size;
    each model and buffer size has its own compiled step, so torch._dynamo's recompile limit (lowered to 1 here,
    8 by default) is never reached: a learner comparing kinds and lengths in one kernel hit it (a hard failure
    under ``fullgraph=True``). aot_eager traces as inductor does (the cache's in-place writes functionalised)."""
    backend, compiles = counting_backend("aot_eager")
    small = dict(max_len=160, d_model=32, n_layers=1, n_kv_heads=2)
    m, p = lm("diff", **small), prompt()
    assert torch.equal(m.generate(p, 10, cache="static", compile=backend), m.generate(p, 10, cache=None))
    assert len(compiles) == 1  # one compilation for all 9 steps: no recompilation per token
    m.generate(p, 20, cache="static", compile=backend)  # 24 positions: the same 64-position buffer
    sampled = m.generate(p, 10, cache="static", compile=backend, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, m.generate(p, 10, temperature=0.8, generator=torch.Generator().manual_seed(0)))
    assert len(compiles) == 1
    backend, compiles = counting_backend("eager")  # the quickest to compile, for the rest
    long = prompt(1, 70)  # 72 positions, batch 1: the 128-position buffer
    assert torch.equal(m.generate(long, 2, cache="static", compile=backend), m.generate(long, 2, cache=None))
    for other in (m, lm("baseline", **small)):  # the first buffer and batch: this model's, another model's
        assert torch.equal(other.generate(p, 3, cache="static", compile=backend), other.generate(p, 3, cache=None))
    assert len(compiles) == 3


def test_static_cache_sizes_are_powers_of_two_up_to_max_len():
    """Few buffer sizes, so few compiled steps: the smallest power of two holding the tokens, at least 64."""
    assert [static_cache_size(n, max_len=300) for n in (1, 64, 65, 128, 129, 256, 257, 300)] == \
        [64, 64, 128, 128, 256, 256, 300, 300]
    assert static_cache_size(10, max_len=40) == 40


@pytest.mark.slow  # compiles 3 decode steps with inductor (C++ code generation) and 6 with aot_eager
@pytest.mark.parametrize("kind", ATTENTIONS)
def test_compiled_steps_give_the_same_tokens_for_every_kind_and_cache(kind, fresh_dynamo):
    # one small layer: less code to generate. Its sizes differ from the prompt's 4 tokens: a dynamic-shape graph
    # traced when a length equals another size shares one symbol for both, and compiles again at the next length.
    # Inductor (C++ code generation: most of this test's time) for the serving step (the static cache) of every
    # kind; aot_eager for the dynamic-shape steps (dynamo's trace and AOT autograd's functionalised graph with
    # symbolic lengths, the custom operators' fakes included; no code generation)
    m, p = lm(kind, n_kv_heads=2, d_model=32, n_layers=1), prompt()
    want = m.generate(p, 5, cache=None)
    for cache in CACHES:
        backend, compiles = counting_backend("inductor" if cache == "static" else "aot_eager")
        with torch.inference_mode():  # as a server runs it: the prompt is not an inference tensor, the steps are
            assert torch.equal(m.generate(p, 5, cache=cache, compile=backend), want), cache
            assert torch.equal(m.generate(p, 8, cache=cache, compile=backend)[:, :9], want), cache
        assert len(compiles) == 1, (cache, compiles)  # once, for both calls and every token


def test_generate_refusals_name_the_fix():
    m, p = lm("baseline"), prompt()
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number >= 0"):
        m.generate(p, -1)
    with pytest.raises(ValueError, match="top_k must be a whole number >= 1"):
        m.generate(p, 3, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        m.generate(p, 3, temperature=-0.5)
    with pytest.raises(ValueError, match="max_len=40"):
        m.generate(p, 37)
    assert m.generate(p, 36).shape == (2, 40)  # exactly max_len is fine
    with pytest.raises(ValueError, match="cache must be one of"):
        m.generate(p, 3, cache="paged")
    with pytest.raises(TypeError, match="compile must be True, False or a torch.compile backend"):
        m.generate(p, 3, compile=3)
    with pytest.raises(ValueError, match="compile 'aot_eagre' is not a torch.compile backend; choose one of .*aot_eager"):
        m.generate(p, 3, compile="aot_eagre")
    with pytest.raises(TypeError, match="torch.Generator"):
        m.generate(p, 3, temperature=1.0, generator=0)
    with pytest.raises(ValueError, match="positions="):
        m(p, caches=[StaticKVCache(8) for _ in m.blocks])
    with pytest.raises(ValueError, match="positions= is for StaticKVCache"):
        m(p, caches=[KVCache() for _ in m.blocks], positions=torch.arange(4))
    assert torch.equal(m.generate(p, 0), p)


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([[1, 40]]), r"token ids must be in 0\.\.39 \(vocab_size=40\), got 40"),
    (torch.tensor([[-1, 3]]), r"token ids must be in 0\.\.39 \(vocab_size=40\), got -1"),
    (torch.tensor([[1.0, 2.0]]), r"token ids must be integers \(torch\.long\), got torch\.float32.*idx\.long\(\)"),
    (torch.tensor([1, 2]), r"idx must be a \(B, N\) tensor of token ids, got shape \(2,\)"),
    ([[1, 2]], r"idx must be a \(B, N\) torch\.long tensor of token ids, got list"),
])
def test_bad_token_ids_are_refused_by_name(bad, message):
    """An id past the vocabulary was torch's "index out of range in self"; float ids were called a shape problem."""
    m = lm("diff", n_kv_heads=2)
    for call in (lambda: m.generate(bad, 2), lambda: m.generate(bad, 2, cache="static"), lambda: m(bad)):
        with pytest.raises(ValueError, match=message):
            call()
