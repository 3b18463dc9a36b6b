"""The guard that keeps the suite order-independent catches what it is meant to catch (planted changes)."""

import os
import warnings

import process_state
import torch


def test_dynamo_config_patched_the_supported_way_is_restored_and_a_lost_entry_is_named():
    """The fault that made a fresh clone's suite fail by test order: pytest's undo of a setattr on dynamo's config
    hid ``recompile_limit`` for the rest of the process (on some torch builds). ``config.patch`` restores it; an
    entry that disappears is named by the guard."""
    before = process_state.snapshot()
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch._dynamo.config.recompile_limit == 1
        assert any("recompile_limit" in line for line in process_state.changes(before, process_state.snapshot()))
    assert process_state.changes(before, process_state.snapshot()) == []
    lost = dict(before, **{"torch._dynamo.config": dict(before["torch._dynamo.config"])})
    del lost["torch._dynamo.config"]["recompile_limit"]
    assert process_state.changes(before, lost) == ["torch._dynamo.config['recompile_limit']: 8 -> <unset>"]


def test_planted_changes_are_each_named():
    before = process_state.snapshot()
    old_threads, old_dtype = torch.get_num_threads(), torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(old_threads + 1)
        os.environ["DIFFATTN_PLANTED"] = "1"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lines = process_state.changes(before, process_state.snapshot())
    finally:
        torch.set_default_dtype(old_dtype)
        torch.set_num_threads(old_threads)
        os.environ.pop("DIFFATTN_PLANTED")
    text = "\n".join(lines)
    for name in ("default dtype", "torch threads", "DIFFATTN_PLANTED", "warnings filters"):
        assert name in text, (name, text)
    assert process_state.changes(before, process_state.snapshot()) == []


def test_a_filter_added_without_an_import_is_named_and_an_import_time_one_is_not():
    before = process_state.snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert any("warnings filters" in line for line in process_state.changes(before, process_state.snapshot()))
        imported = dict(process_state.snapshot(), modules=before["modules"] | {"a_library_imported_now"})
        assert process_state.changes(before, imported) == []


def test_a_set_with_the_same_members_in_another_order_is_no_change():
    """A config set rebuilt by torch (dynamo's ``_save_config_ignore`` on a worker's first inductor compile) may list
    the same members in another order: not a change. Another member still is one."""
    members = ["repro_level", "constant_functions", "repro_after", "skipfiles_inline_module_allowlist"]
    before = process_state.snapshot()
    with torch._dynamo.config.patch(_save_config_ignore=set(reversed(members))):
        during = process_state.snapshot()
    assert not process_state.changes(before, process_state.snapshot())
    assert process_state._stable_repr(set(members)) == process_state._stable_repr(set(reversed(members)))
    with torch._dynamo.config.patch(_save_config_ignore={*members, "another"}):
        changed = process_state.changes(before, process_state.snapshot())
    assert [line.split(":")[0] for line in changed] == ["torch._dynamo.config['_save_config_ignore']"]
    assert not process_state.changes(before, during)
