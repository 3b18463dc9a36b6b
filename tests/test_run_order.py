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


def test_the_training_notebook_then_notebooks_then_slow_modules_then_the_rest():
    conftest = _root_conftest()
    items = [_item("tests/test_NAME_a.py"), _item("tests/test_NAME_b.py"), _item("tests/test_NAME_b.py", slow=True),
             _item("notebooks/10_diff_v2.ipynb"), _item("notebooks/NN_c.ipynb"),
             _item("tests/test_experiments.py", slow=True), _item("solutions/NN_x.ipynb"),
             _item("notebooks/07_experiments.ipynb"), _item("notebooks/NN_a.ipynb")]
    conftest.pytest_collection_modifyitems(SimpleNamespace(), items)
    assert [i.nodeid for i in items] == [
        "notebooks/07_experiments.ipynb",  # trains the three study models
        "notebooks/NN_c.ipynb", "notebooks/NN_a.ipynb",  # the course notebooks, in their collected order
        "notebooks/10_diff_v2.ipynb",  # reads notebook 07's runs from the cache
        "tests/test_NAME_b.py", "tests/test_NAME_b.py",  # a module with a slow test: all of its items, in order
        "tests/test_experiments.py",  # the same three runs, cached by then
        "tests/test_NAME_a.py", "solutions/NN_x.ipynb"]
    assert items[4].slow is False and items[5].slow is True


def test_the_notebook_and_the_test_train_the_same_runs_through_one_cache():
    """What makes the order pay: notebook 07 trains exactly the runs test_experiments checks, through the cache."""
    import test_experiments

    from diffattn_tutorial.training.model import ATTENTIONS

    assert any(m.name == "slow" for m in test_experiments.test_seed0_reproduces_the_recorded_row.pytestmark)
    (mark,) = [m for m in test_experiments.test_seed0_reproduces_the_recorded_row.pytestmark if m.name == "parametrize"]
    assert set(mark.args[1]) == set(ATTENTIONS)
    notebook = (ROOT / "notebooks" / "07_experiments.ipynb").read_text()
    assert "retrieval_study(kind, seed=SEED, cache=True) for kind in ATTENTIONS}" in notebook
