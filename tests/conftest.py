"""Session-wide test set-up.

Without a CUDA GPU the Triton kernels run in Triton's CPU interpreter, which must be switched on with
``TRITON_INTERPRET=1`` **before triton is first imported** (Triton binds its language functions at import).
Setting it here, before any test module is collected, makes that independent of collection order.
"""

import os

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
