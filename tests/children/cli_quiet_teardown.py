"""What a notebook runner's teardown leaves after a Ctrl-C: an event-loop task whose exception nobody read and an
exit handler that raises. ``quiet`` first calls the ``check`` command's silencer (tests/test_cli.py)."""

import asyncio
import atexit
import gc
import sys

from diffattn_tutorial import cli


async def _fails():
    raise AssertionError("the kernel died")


def _exit_handler():
    raise AssertionError("no kernel manager")


if sys.argv[1:] == ["quiet"]:
    cli._quiet_runner_teardown()
loop = asyncio.new_event_loop()
task = loop.create_task(_fails())
loop.run_until_complete(asyncio.sleep(0.01))
del task
gc.collect()  # the task's unread exception is reported here
atexit.register(_exit_handler)
print("done")
