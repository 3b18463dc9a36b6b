"""Rewrite a metrics log to its first steps under a file-size limit, as a process killed mid-write would leave it.

    python -m children.truncate_metrics LOG STEP LIMIT_BYTES

Run by ``tests/test_faults_round4_convert.py`` (``forked.run_module``). Sets ``RLIMIT_FSIZE`` to ``LIMIT_BYTES`` (with
SIGXFSZ ignored, so a write past it fails with ``EFBIG``) and calls ``MetricsLog(LOG).truncate_after(STEP)``, which
rewrites the whole log; prints ``cut short`` when the write failed (a few bytes: its stdout is a file, under the
same limit).
"""

from __future__ import annotations

import resource
import signal
import sys

from diffattn_tutorial.training.runlog import MetricsLog


def main(log: str, step: str, limit: str) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        MetricsLog(log).truncate_after(int(step))
    except OSError as e:
        print(f"cut short: {e}")
        return
    print("rewritten")


if __name__ == "__main__":
    main(*sys.argv[1:])
