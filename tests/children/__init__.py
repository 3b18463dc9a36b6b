"""Child processes' code of the tests, run with ``python -m children.NAME`` (see ``forked.run_module``)."""
