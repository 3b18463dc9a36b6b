"""measure.cpu_threads.recommended_threads (threads from the cores other programs leave free), its ``threads``
context manager (set and restore torch's thread count) and measure.timing.peak_extra_memory
(any function's peak extra resident memory, measured in a fresh process)."""

import functools

import pytest
import torch

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.measure import cpu_threads, timing


def test_busy_cores_is_a_share_of_the_usable_cores():
    busy = cpu_threads.busy_cores(0.05)
    assert 0.0 <= busy <= max(cpu_threads.usable_cores(), torch.get_num_threads()) + 1e-9


@pytest.mark.parametrize("busy, expected", [(0.0, "all"), (0.4, "all"), (0.6, "all - 1"), (99.0, 1)])
def test_recommended_threads_leave_the_busy_cores_alone(monkeypatch, busy, expected):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu_threads, "busy_cores", lambda sample_s=0.2: busy)
    want = {"all": 4, "all - 1": 3}.get(expected, expected)
    assert cpu_threads.recommended_threads() == want
    assert cpu_threads.recommended_threads(max_threads=2) == min(want, 2)


def test_threads_sets_and_restores_the_count_even_after_an_exception():
    outer = torch.get_num_threads()
    torch.set_num_threads(3)  # a count the block does not use, so a missing restore shows
    try:
        with pytest.raises(KeyError):
            with cpu_threads.threads(1) as n:
                assert n == 1 == torch.get_num_threads()
                raise KeyError("raised inside the block")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(outer)


def test_threads_none_leaves_the_count_alone_and_still_restores_it():
    outer = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with cpu_threads.threads(None) as n:
            assert n == 3 == torch.get_num_threads()
            torch.set_num_threads(1)  # code inside the block changes it (the training loop's --threads)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(outer)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_threads_refuses_a_count_that_is_not_a_positive_whole_number(bad):
    before = torch.get_num_threads()
    with pytest.raises(ValueError, match="whole number of threads >= 1, or None"):
        with cpu_threads.threads(bad):
            pass
    assert torch.get_num_threads() == before


def maps_beside_a_spare_buffer(q, k, v, lam, causal=False):
    """A function defined in a test module (the child cannot import it): sent as source with its helper."""
    spare = spare_buffer(q.shape[2])  # held while the maps exist: the peak grows by its size
    return diff_attention(q, k, v, lam, causal=causal, backend="naive") + spare[0, 0]


def spare_buffer(n):
    return torch.ones(n, n)


@pytest.mark.skipif(not timing.cpu_memory_supported(), reason="CPU peak memory is measured on Linux only")
def test_peak_extra_memory_of_any_function():
    b, h, n, d = 1, 2, 512, 16
    functions = {"naive": functools.partial(diff_attention, backend="naive"),
                 "padded": functools.partial(diff_attention, backend="sdpa_padded"),
                 "mine": maps_beside_a_spare_buffer}
    mem = timing.peak_extra_memory(functions, b=b, h=h, n=n, d=d, helpers=[spare_buffer])
    out_bytes = b * h * n * 2 * d * 4
    maps = 2 * b * h * n * n * 4  # both maps of every head, float32
    assert mem["naive"] >= maps
    assert mem["mine"] >= mem["naive"] + 0.9 * n * n * 4  # the spare (n, n) float32 buffer on top
    assert out_bytes <= mem["padded"] < 0.1 * mem["naive"]  # output included, no N x N map
    big = dict(b=1, h=2, n=2048, d=64)  # an output of 2 MiB, well above the page-level noise of two children
    with_out, no_out = (timing.peak_extra_memory({"padded": functions["padded"]}, **big, include_output=flag)["padded"]
                        for flag in (True, False))
    assert no_out <= with_out - 2**20
