"""The multi-needle task: seeded, well-formed, and its labels point at the answers."""

import pytest
import torch

from diffattn_tutorial.training.needle import BOS, IGNORE, QUERY, NeedleTask


def sample(task=None, b=8, n=6, r=2, seed=0):
    task = task or NeedleTask()
    return task, task.sample(b, n, r, generator=torch.Generator().manual_seed(seed))


def test_seeded_and_seed_dependent():
    _, a = sample(seed=1)
    _, b = sample(seed=1)
    _, c = sample(seed=2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("n,r", [(1, 1), (2, 2), (4, 2), (6, 2), (3, 3)])
def test_structure(n, r):
    task, b = sample(NeedleTask(context_len=40), b=16, n=n, r=r)
    B, L = b.tokens.shape
    C = task.context_len
    assert L == task.seq_len(r) == 1 + C + 3 * r
    assert (b.tokens[:, 0] == BOS).all()
    assert b.context_mask.sum() == C and not b.context_mask[0] and not b.context_mask[C + 1:].any()
    # needles: exactly n needle tokens with distinct keys, marked by needle_mask; no needles outside the haystack
    is_needle = (b.tokens >= task.needle_ids.start) & (b.tokens < task.needle_ids.stop)
    assert torch.equal(is_needle, b.needle_mask) and (is_needle.sum(1) == n).all()
    assert not (is_needle & ~b.context_mask).any()
    needle_keys = (b.tokens - task.needle_ids.start).div(task.n_values, rounding_mode="floor")
    for row in range(B):
        assert needle_keys[row][is_needle[row]].unique().numel() == n
    # the haystack holds no bare keys; bare values appear as noise
    ctx = b.tokens[:, 1:C + 1]
    assert not ((ctx >= task.key_ids.start) & (ctx < task.key_ids.stop)).any()
    # queries: "? key value"; the answer mask marks the needle "key=value"
    for i in range(r):
        p = b.query_pos[:, i]
        assert (b.tokens.gather(1, (p - 1)[:, None]) == QUERY).all()
        qkey = b.tokens.gather(1, p[:, None])[:, 0] - task.key_ids.start
        qval = b.answers[:, i] - task.value_ids.start
        assert torch.equal(b.tokens.gather(1, (p + 1)[:, None])[:, 0], b.answers[:, i])
        span = b.answer_mask[:, i]
        assert (span.sum(1) == 1).all() and not (span & ~b.needle_mask).any()
        pos = span.float().argmax(1)
        assert torch.equal(b.tokens.gather(1, pos[:, None])[:, 0], task.needle_ids.start + qkey * task.n_values + qval)
        assert torch.allclose(b.depth[:, i], (pos - 1).float() / (C - 1))
    # queried needles are distinct; targets (the next token) only at the queried keys
    assert (b.answer_mask.sum(1) <= 1).all()
    mask = b.targets != IGNORE
    assert mask.sum() == B * r and torch.equal(b.targets.gather(1, b.query_pos), b.answers)
    assert ((b.depth >= 0) & (b.depth <= 1)).all()


def test_value_noise_fraction():
    task, b = sample(NeedleTask(context_len=200, value_noise=0.25), b=64, n=1, r=1)
    ctx = b.tokens[:, 1:201]
    bare = ((ctx >= task.value_ids.start) & (ctx < task.value_ids.stop)).float().mean().item()
    assert abs(bare - 0.25) < 0.02
    task, b = sample(NeedleTask(value_noise=0.0), n=2, r=1)
    ctx = b.tokens[:, 1:task.context_len + 1]
    assert not ((ctx >= task.value_ids.start) & (ctx < task.value_ids.stop)).any()


def test_needles_can_fill_the_context_and_land_anywhere():
    task = NeedleTask(context_len=6, n_keys=6)
    _, b = sample(task, b=4, n=6, r=2)
    assert b.needle_mask[:, 1:7].all()
    _, b = sample(NeedleTask(context_len=10), b=2000, n=1, r=1)
    first = b.answer_mask[:, 0].float().argmax(1) - 1
    assert set(first.tolist()) == set(range(10))  # every position occurs
    assert b.depth.min() == 0 and b.depth.max() == 1


def test_bad_arguments_raise_with_a_reason():
    task = NeedleTask(context_len=8, n_keys=4)
    with pytest.raises(ValueError, match="n_queries"):
        task.sample(2, 2, 3)
    with pytest.raises(ValueError, match="distinct keys"):
        task.sample(2, 5, 1)
    with pytest.raises(ValueError, match="do not fit"):
        NeedleTask(context_len=3).sample(2, 4, 1)


def test_describe_and_vocab():
    task, b = sample(NeedleTask(context_len=10), b=1, n=2, r=1)
    text = task.describe(b.tokens[0])
    assert text.startswith("^ ") and text.count("?") == 1 and len(text.split()) == b.tokens.shape[1]
    assert "=" in text
    assert task.vocab_size == 2 + task.n_keys + task.n_values + task.n_keys * task.n_values + task.n_filler
    assert int(b.tokens.max()) < task.vocab_size


def test_the_text_task_has_its_own_loss():
    """The corpus's loss is next-character cross-entropy at every position: a model that puts all its mass on the
    target scores 0, and a uniform one scores log(V)."""
    from diffattn_tutorial.training.corpus import ALPHABET, TextTask, next_character_loss

    tokens, targets = TextTask(seq_len=16).sample_row(torch.Generator().manual_seed(0))
    tokens, targets = tokens[None], targets[None]
    V = len(ALPHABET)
    sure = next_character_loss(lambda t: torch.nn.functional.one_hot(targets, V).float() * 1e4, tokens, targets)
    uniform = next_character_loss(lambda t: torch.zeros(*t.shape, V), tokens, targets)
    assert sure.item() == pytest.approx(0.0, abs=1e-6) and uniform.item() == pytest.approx(torch.log(torch.tensor(V)).item())
