"""Many command lines through the CLI's ``main`` in one process, each as the console script runs it, for
``tests/test_cli.py``. ``python -m children.cli_sweep ARGVS_JSON`` (a JSON list of argument lists); prints a JSON
list of ``[argv, exit code, stderr]``, the exit code ``"escaped"`` where an exception escaped ``main`` (its traceback,
what the user would see, is the stderr)."""

import contextlib
import io
import json
import sys
import traceback

from diffattn_tutorial.cli import main


def sweep(argvs: list) -> list:
    results = []
    for argv in argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException:  # what the console script would print as a traceback
                traceback.print_exc()
                code = "escaped"
        results.append([argv, code, err.getvalue()])
    return results


if __name__ == "__main__":
    print(json.dumps(sweep(json.loads(sys.argv[1]))))
