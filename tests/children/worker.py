"""The loop of a worker child (``forked.Worker``): answer one JSON line per request read from stdin.

Without a CUDA GPU the Triton kernels run in Triton's interpreter, switched on here before triton is first imported
(the example modules import the library's Triton parts inside their functions)."""

import json
import os
import sys
from typing import Callable


def serve(run: Callable[[dict], dict]) -> None:
    """Print ``{"ready": true}``, then ``run(request)`` for each request line (an exception is an answer too, a
    failed one; a crash is not). ``{"abort": true}`` dies as heap corruption does (SIGABRT): the test of the
    harness itself."""
    import torch  # before triton: whether the interpreter is needed (no GPU) must be known first

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

    from diffattn_tutorial import functional  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("abort"):
            os.abort()
        try:
            answer = run(request)
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails
            answer = {"ok": False, "msg": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)
