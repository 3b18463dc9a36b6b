"""Plausible wrong answers to exercise 14 that a newcomer wrote, each named by its check: the query rows repeated
one by one instead of by head (task 1), k and v assigned by ``.data`` or as the baseline's Parameters, which then
share memory with the baseline (task 1), and the warm-up's mix taken by integer division (task 3)."""

import pytest
import torch

from diffattn_tutorial.checks import CheckFailed
from diffattn_tutorial.checks.nb14 import check_finetune, check_mirror_to_v2
from diffattn_tutorial.layers.attention import DiffAttnV2
from diffattn_tutorial.layers.convert import set_warmup
from diffattn_tutorial.training.study import retrieval_loss


@torch.no_grad()
def rows_repeated(layer):
    """Task 1 with ``repeat_interleave`` on the rows of q_proj: each row twice, not each head's block of d rows."""
    new = DiffAttnV2(layer.embed_dim, layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim)
    new.q_proj.weight.copy_(layer.q_proj.weight.repeat_interleave(2, dim=0))
    new.k_proj.weight.copy_(layer.k_proj.weight)
    new.v_proj.weight.copy_(layer.v_proj.weight)
    new.lambda_proj.weight.zero_()
    new.o_proj.weight.copy_(2 * layer.out_proj.weight)
    return new


def test_mirror_names_rows_repeated_one_by_one():
    with pytest.raises(CheckFailed, match="every row of q_proj is repeated.*block of d rows"):
        check_mirror_to_v2(rows_repeated)


def shares_k_and_v(layer):
    """Task 1 right in every value, but k_proj's weight assigned by ``.data`` and v_proj's as the Parameter itself."""
    H, d = layer.num_heads, layer.head_dim
    new = DiffAttnV2(layer.embed_dim, H, num_kv_heads=layer.num_kv_heads, head_dim=d, dtype=layer.q_proj.weight.dtype)
    with torch.no_grad():
        q = layer.q_proj.weight.unflatten(0, (H, d))
        new.q_proj.weight.copy_(torch.stack([q, q], dim=1).flatten(0, 2))
        new.lambda_proj.weight.zero_()
        new.o_proj.weight.copy_(2 * layer.out_proj.weight)
    new.k_proj.weight.data = layer.k_proj.weight.data
    new.v_proj.weight = layer.v_proj.weight
    return new


def test_mirror_names_weights_shared_with_the_baseline():
    with pytest.raises(CheckFailed, match=r"k_proj.weight \(the baseline's k_proj.weight\), v_proj.weight .* share "
                                          r"memory with the baseline layer.*instead of assigning .data"):
        check_mirror_to_v2(shares_k_and_v)


def floor_mix(model, batches, *, lr, warmup_steps):
    """Task 3 with ``t // warmup_steps``: the mix stays 0, then jumps to 1."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=lr), []
    for t, batch in enumerate(batches):
        set_warmup(model, min(1, t // warmup_steps))
        loss = retrieval_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_finetune_names_integer_division():
    with pytest.raises(CheckFailed, match="integer division"):
        check_finetune(floor_mix)
