"""Session-wide test set-up.

Without a CUDA GPU the Triton kernels run in Triton's CPU interpreter, which must be switched on with
``TRITON_INTERPRET=1`` **before triton is first imported** (Triton binds its language functions at import).
Setting it here, before any test module is collected, makes that independent of collection order.
"""

import collections
import os
import sys

import process_state
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Environment entries that change by design between set-up and tear-down.
_FIRST_USE = {"PYTEST_CURRENT_TEST",  # pytest sets it per phase
              "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}  # inductor sets it on first use, for the process


@pytest.fixture(autouse=True)
def _leaves_process_state_as_found():
    """Fail a test that leaves the process changed (torch's dynamo and inductor config, default dtype and device,
    threads, grad mode, environment variables, the backend registry, warnings filters): a later test in the same
    worker would inherit it, so the suite would pass or fail by test order. Patch with ``torch._dynamo.config.patch``,
    ``monkeypatch`` or a ``with`` block that restores."""
    before = process_state.snapshot()
    yield
    after = process_state.snapshot()
    for name in _FIRST_USE:
        after["environment"].pop(name, None)
        before["environment"].pop(name, None)
    changed = process_state.changes(before, after)
    if changed:
        pytest.fail("the test left process state changed (a later test would inherit it):\n  " + "\n  ".join(changed),
                    pytrace=False)


_slow_seen = 0  # how many of forked.SLOW_CHILDREN this process has already put on a report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Put the slow children (``forked.SLOW_CHILDREN``) a test phase started on its report, so that the session's
    summary counts them, from every worker."""
    global _slow_seen
    report = (yield).get_result()
    forked = sys.modules.get("forked")  # imported by the tests that start children
    if forked is not None and len(forked.SLOW_CHILDREN) > _slow_seen:
        report.user_properties = [*report.user_properties, ("slow_children", forked.SLOW_CHILDREN[_slow_seen:])]
        _slow_seen = len(forked.SLOW_CHILDREN)


def pytest_terminal_summary(terminalreporter):
    """How many children ran a real ``python -c`` instead of a fork, and why (each also warned)."""
    reasons = collections.Counter(reason for reports in terminalreporter.stats.values() for report in reports
                                  for name, value in getattr(report, "user_properties", ()) if name == "slow_children"
                                  for reason in value)
    if reasons:
        terminalreporter.section("children on the slow path (forked.py)")
        terminalreporter.line(f"{sum(reasons.values())} children ran a real python -c instead of a fork:")
        for reason, n in reasons.most_common():
            terminalreporter.line(f"  {n} x {reason}")
