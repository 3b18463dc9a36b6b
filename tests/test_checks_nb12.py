"""The checks of exercise 12 pass right answers (valid splits; the library's own is refused) and name each plausible
wrong one: mutants of the batch split and of FSDP2's shard."""

import pytest
import torch

from diffattn_tutorial import checks
from diffattn_tutorial.checks import CheckFailed, NotAttempted
from diffattn_tutorial.checks.nb12 import check_local_shard, check_rank_rows
from diffattn_tutorial.training.distributed import fsdp_local_shard, micro_batch_rows

# --- TASK 1 -----------------------------------------------------------------------------------------------------


def test_rank_rows_accepts_every_valid_split(capsys):
    check_rank_rows(micro_batch_rows)
    check_rank_rows(lambda m, r, b, w: list(range(m * b * w + r, (m + 1) * b * w, w)))  # ranks interleaved
    check_rank_rows(lambda m, r, b, w: torch.arange(b) + (m * w + r) * b)  # a tensor of rows
    assert capsys.readouterr().out.count("PASSED") == 3


@pytest.mark.parametrize("fn, match", [
    (lambda m, r, b, w: range(m * b, m * b + b), "different ranks read the same rows"),
    (lambda m, r, b, w: range(r * b, r * b + b), "every micro-step reads the same rows"),
    (lambda m, r, b, w: range((m + r) * b, (m + r) * b + b), "micro-step blocks overlap"),
    (lambda m, r, b, w: range((m * w + r) * b, (m * w + r) * b + b + 1), "off by one"),
    (lambda m, r, b, w: range((m * w + r) * b + 1, (m * w + r) * b + b + 1), "outside the global batch"),
    (lambda m, r, b, w: [(m * w + r) * b] * b, "a row twice"),
    (lambda m, r, b, w: torch.arange(b, dtype=torch.float32) + (m * w + r) * b, "1-D integer tensor"),
    (lambda m, r, b, w: (m * w + r) * b, "got int"),
])
def test_rank_rows_mistakes_are_named(fn, match):
    with pytest.raises(CheckFailed, match=match):
        check_rank_rows(fn)


# --- TASK 2 -----------------------------------------------------------------------------------------------------


def solved_shard(param, rank, world_size):
    rows = -(-param.shape[0] // world_size)
    return param[rank * rows:(rank + 1) * rows]


def test_local_shard_passes_a_slice_and_refuses_the_library(capsys):
    check_local_shard(solved_shard)
    check_local_shard(lambda p, r, w: (torch.chunk(p, w)[r:r + 1] or [p[:0]])[0])  # torch.chunk is a building block
    assert capsys.readouterr().out.count("PASSED") == 2
    with pytest.raises(CheckFailed, match="calls the library's fsdp_local_shard"):
        check_local_shard(fsdp_local_shard)


@pytest.mark.parametrize("fn, match", [
    (lambda p, r, w: torch.tensor_split(p, w, dim=0)[r], "tensor_split"),
    (lambda p, r, w: p[r * (p.shape[0] // w):(r + 1) * (p.shape[0] // w)], "Round up"),
    (lambda p, r, w: p[r::w], "contiguous block"),
    (lambda p, r, w: torch.chunk(p, w, dim=-1)[r] if p.ndim > 1 else torch.chunk(p, w)[r], "last dimension"),
    (lambda p, r, w: torch.chunk(p, w, dim=0)[min(r, len(torch.chunk(p, w, dim=0)) - 1)], "empty"),
    (lambda p, r, w: solved_shard(p, w - 1 - r, w), "not the right rows|expected"),
    (lambda p, r, w: solved_shard(p, r, w).tolist(), "should return a torch.Tensor"),
])
def test_local_shard_mistakes_are_named(fn, match):
    with pytest.raises(CheckFailed, match=match):
        check_local_shard(fn)


def test_unattempted_stubs_are_not_attempted():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(NotAttempted, match="TASK 1 not attempted yet"):
        check_rank_rows(stub)
    with pytest.raises(NotAttempted, match="TASK 2 not attempted yet"):
        check_local_shard(stub)


def test_checks_are_exported_with_their_tasks():
    assert {"check_rank_rows", "check_local_shard"} <= set(checks.__all__)
    assert (check_rank_rows.task, check_rank_rows.function_name) == (1, "rank_rows")
    assert (check_local_shard.task, check_local_shard.function_name) == (2, "local_shard")
