"""Exercise checks: ``from diffattn_tutorial.checks import check_...``.

Each notebook's checks live in a submodule ``nbNN`` (``nb01`` ... ``nb14``); its public ``check_*`` functions are
imported here by name, so exercises import from one place (``tests/test_checks.py`` fails when a submodule's
``__all__`` and this list disagree). Each check belongs to one task of one exercise notebook (``check.task``,
``check.function_name``); a failure is one line, :class:`CheckFailed` (the hint), and an unattempted stub is
:class:`NotAttempted`.
"""

from __future__ import annotations

from diffattn_tutorial.checks._core import CheckFailed, NotAttempted
from diffattn_tutorial.checks.nb01 import check_amplifier_output, check_cmrr_db, check_gains
from diffattn_tutorial.checks.nb02 import check_answer_noise_shares, check_attention
from diffattn_tutorial.checks.nb03 import check_diff_attn, check_split_pairs
from diffattn_tutorial.checks.nb04 import check_lambda_init, check_reparam_lambda
from diffattn_tutorial.checks.nb05 import check_rms_norm, check_subln
from diffattn_tutorial.checks.nb06 import check_causal_mask, check_expand_kv, check_forward
from diffattn_tutorial.checks.nb07 import check_logit_outlier_ratio, check_query_shares
from diffattn_tutorial.checks.nb08 import check_sdpa_split, check_sdpa_split_flops
from diffattn_tutorial.checks.nb09 import check_diff_combine, check_diff_softmax_grads, check_online_softmax_step
from diffattn_tutorial.checks.nb10 import check_diff_v2, check_forward_v2, check_pair_groups
from diffattn_tutorial.checks.nb11 import (
                                           check_axonml_fixed,
                                           check_block_causal_mask,
                                           check_diffllama_rows,
                                           check_four_calls_gqa,
)
from diffattn_tutorial.checks.nb12 import check_local_shard, check_rank_rows
from diffattn_tutorial.checks.nb13 import check_combine_splits, check_sample_next, check_static_step
from diffattn_tutorial.checks.nb14 import check_finetune, check_mirror_to_v2, check_shared_map_values

__all__ = [
    "CheckFailed", "NotAttempted",
    "check_amplifier_output", "check_gains", "check_cmrr_db",
    "check_attention", "check_answer_noise_shares",
    "check_split_pairs", "check_diff_attn",
    "check_lambda_init", "check_reparam_lambda",
    "check_rms_norm", "check_subln",
    "check_causal_mask", "check_expand_kv", "check_forward",
    "check_query_shares", "check_logit_outlier_ratio",
    "check_sdpa_split", "check_sdpa_split_flops",
    "check_online_softmax_step", "check_diff_combine", "check_diff_softmax_grads",
    "check_diff_v2", "check_pair_groups", "check_forward_v2",
    "check_axonml_fixed", "check_block_causal_mask", "check_four_calls_gqa", "check_diffllama_rows",
    "check_rank_rows", "check_local_shard",
    "check_static_step", "check_combine_splits", "check_sample_next",
    "check_mirror_to_v2", "check_shared_map_values", "check_finetune",
]
