"""Checks for ``exercises/12_distributed_training.ipynb``: how data parallelism splits the batch and the weights.

1. which rows of a step's global batch each rank reads at each accumulation micro-step (checked by what makes one
   process and many train alike: every row read once, by one rank, ``per_rank`` rows at a time);
2. the rows of a parameter FSDP2 keeps on one rank.

References: ``distributed.micro_batch_rows`` (one valid split; any split with the same properties passes) and
``distributed.fsdp_local_shard``.
"""

from __future__ import annotations

from typing import Callable

import torch

from diffattn_tutorial.checks._core import call, exercise_check, fail, passed, randn
from diffattn_tutorial.training.distributed import fsdp_local_shard

__all__ = ["check_rank_rows", "check_local_shard"]

Tensor = torch.Tensor


# --- TASK 1: rows per rank and micro-step ------------------------------------------------------------------------

# (per_rank, world_size, accum)
_ROW_CASES = [(2, 2, 2), (3, 4, 1), (1, 3, 4), (4, 1, 3), (2, 3, 3)]


def _as_rows(got: object, what: str) -> list[int]:
    """A learner's rows (range, list, tuple or 1-D integer tensor) as a list of ints."""
    if isinstance(got, Tensor):
        if got.ndim != 1 or got.is_floating_point():
            fail(f"{what} should return the row indices as a range, a list or a 1-D integer tensor, "
                 f"got a {got.dtype} tensor of shape {tuple(got.shape)}")
        return [int(i) for i in got.tolist()]
    if isinstance(got, (range, list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in got):
        return list(got)
    fail(f"{what} should return the row indices as a range, a list or a 1-D integer tensor, got "
         f"{type(got).__name__}")


@exercise_check(task=1, name="rank_rows")
def check_rank_rows(fn: Callable) -> None:
    """``fn(micro_step, rank, per_rank, world_size)`` -> the rows of the global batch (``per_rank x world_size x
    accum`` rows) that ``rank`` reads at ``micro_step``: ``per_rank`` of them, every row read once per step."""
    what = "rank_rows"
    for per_rank, world, accum in _ROW_CASES:
        size = per_rank * world * accum
        owner: dict[int, tuple[int, int]] = {}
        for m in range(accum):
            for r in range(world):
                rows = _as_rows(call(fn, m, r, per_rank, world, what=what), what)
                where = f"{what}({m}, {r}, per_rank={per_rank}, world_size={world})"
                if len(rows) != per_rank:
                    fail(f"{where} returned {len(rows)} rows; each rank reads per_rank = {per_rank} rows per "
                         f"micro-step (check the end of your range: off by one?)")
                outside = [i for i in rows if not 0 <= i < size]
                if outside:
                    fail(f"{where} returned row {outside[0]}, outside the global batch of per_rank x world_size x "
                         f"accum = {size} rows (rows 0..{size - 1}); micro-step m starts at m x per_rank x "
                         f"world_size")
                if len(set(rows)) != len(rows):
                    fail(f"{where} returned a row twice; a rank reads per_rank different rows")
                for i in rows:
                    if i in owner:
                        _fail_overlap(i, owner[i], (m, r), per_rank, world)
                    owner[i] = (m, r)
    passed("every row of the global batch is read once per step, by one rank at one micro-step: one process and "
           "many see the same batch.")


def _fail_overlap(row: int, first: tuple[int, int], second: tuple[int, int], per_rank: int, world: int) -> None:
    """Name the likely mistake behind two (micro-step, rank) pairs that read the same row."""
    (m1, r1), (m2, r2) = first, second
    both = f"micro-step {m1} rank {r1} and micro-step {m2} rank {r2} both read row {row} (per_rank={per_rank}, " \
           f"world_size={world})"
    if m1 == m2:
        fail(f"{both}: different ranks read the same rows. Offset each rank's slice by rank x per_rank inside its "
             f"micro-step's block")
    if r1 == r2:
        fail(f"{both}: every micro-step reads the same rows. Each micro-step has its own block of per_rank x "
             f"world_size rows")
    fail(f"{both}: the micro-step blocks overlap. A micro-step covers per_rank x world_size rows (all ranks), so "
         f"micro-step m starts at m x per_rank x world_size")


# --- TASK 2: FSDP2's shard of a parameter ------------------------------------------------------------------------

# (rows, cols or None for a vector, world_size)
_SHARD_CASES = [(10, 3, 4), (8, 2, 2), (7, None, 2), (2, 5, 4), (5, 1, 1), (9, 4, 3)]


def _floor_rows(p: Tensor, rank: int, world: int) -> Tensor:
    rows = p.shape[0] // world
    return p[rank * rows:(rank + 1) * rows]


@exercise_check(task=2, name="local_shard", refuses=lambda: {fsdp_local_shard: "the library's fsdp_local_shard"})
def check_local_shard(fn: Callable) -> None:
    """``fn(param, rank, world_size)`` -> the rows of ``param`` (shape ``(n, ...)``) that FSDP2 keeps on ``rank``:
    its shard along dim 0 as FSDP2 cuts it (possibly an empty ``(0, ...)`` tensor)."""
    what = "local_shard"
    for i, (n, cols, world) in enumerate(_SHARD_CASES):
        param = randn(n, seed=1200 + i) if cols is None else randn(n, cols, seed=1200 + i)
        for rank in range(world):
            expected = fsdp_local_shard(param, rank, world)
            got = call(fn, param.clone(), rank, world, what=what)
            where = f"{what}(param of shape {tuple(param.shape)}, rank={rank}, world_size={world})"
            if not isinstance(got, Tensor):
                fail(f"{where} should return a torch.Tensor, got {type(got).__name__}")
            if got.shape == expected.shape and torch.equal(got, expected):
                continue
            wrong = {
                "the remainder rows are spread over the first ranks (torch.tensor_split). FSDP2 splits like "
                "torch.chunk: every rank gets ceil(n / world_size) rows, the last ranks fewer, maybe none":
                    torch.tensor_split(param, world, dim=0)[rank],
                "n // world_size rows per rank leaves the last n % world_size rows on no rank. Round up: "
                "ceil(n / world_size) rows per rank": _floor_rows(param, rank, world),
                "rows are dealt out one at a time (param[rank::world_size]). FSDP2 keeps one contiguous block of "
                "rows per rank": param[rank::world],
                "the shard is cut along the last dimension. FSDP2 shards dim 0, the rows":
                    torch.chunk(param, world, dim=-1)[rank] if param.ndim > 1 and rank < param.shape[-1] else None,
            }
            for hint, candidate in wrong.items():
                if candidate is not None and candidate.shape == got.shape and torch.equal(got, candidate):
                    fail(f"{where} is not right. Likely mistake: {hint}")
            if got.shape != expected.shape:
                extra = " (a rank past the last chunk holds no rows: an empty (0, ...) slice)" \
                    if expected.shape[0] == 0 else ""
                fail(f"{where} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}{extra}")
            fail(f"{where} has the right shape but not the right rows: rank r holds rows r x c to (r + 1) x c, "
                 f"c = ceil(n / world_size)")
    passed("your shards are FSDP2's: ceil(n / world_size) rows per rank, in order, the last ranks fewer.")
