"""The suite's run order (root ``conftest.py``): the longest work starts first, so that two workers finish together."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_for_order", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Item(SimpleNamespace):
    def get_closest_marker(self, name):
        return object() if name == "slow" and self.slow else None

    def add_marker(self, mark):
        self.marks.append(mark)


def _item(path, slow=False):
    return Item(fspath=str(ROOT / path), slow=slow, nodeid=path, marks=[])


def test_training_pair_then_notebooks_then_slow_modules_then_the_rest():
    conftest = _root_conftest()
    items = [_item("tests/test_NAME_a.py"), _item("tests/test_NAME_b.py"), _item("tests/test_NAME_b.py", slow=True),
             _item("notebooks/NN_c.ipynb"), _item("tests/test_experiments.py"), _item("solutions/NN_x.ipynb"),
             _item("notebooks/07_experiments.ipynb"), _item("notebooks/NN_a.ipynb")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [i.nodeid for i in items] == [
        "tests/test_experiments.py", "notebooks/07_experiments.ipynb",  # train side by side
        "notebooks/NN_c.ipynb", "notebooks/NN_a.ipynb",  # the course notebooks, in their collected order
        "tests/test_NAME_b.py", "tests/test_NAME_b.py",  # a module with a slow test: all of its items, in order
        "tests/test_NAME_a.py", "solutions/NN_x.ipynb"]
    assert items[4].slow is False and items[5].slow is True


def test_the_training_pair_trains_in_opposite_orders():
    import test_experiments

    from diffattn_tutorial.training.model import ATTENTIONS

    (mark,) = [m for m in test_experiments.test_seed0_reproduces_the_recorded_row.pytestmark if m.name == "parametrize"]
    assert list(mark.args[1]) == list(ATTENTIONS)[::-1]
    notebook = (ROOT / "notebooks" / "07_experiments.ipynb").read_text()
    assert "retrieval_study(kind, seed=SEED, cache=True) for kind in ATTENTIONS}" in notebook
