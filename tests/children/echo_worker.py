"""A worker that answers each request with itself (``{"ok": true, "echo": request}``), for the tests of
``forked.Worker`` in ``tests/test_child_code.py``; ``{"abort": true}`` crashes it (``children.worker.serve``)."""

from children.worker import serve

if __name__ == "__main__":
    serve(lambda request: {"ok": True, "echo": request})
