"""The mutation record (``diffattn_tutorial/recorded/mutation.json``, the README's mutation figures) was made from
the checks, the mutation tool and the solutions as they are now: its ``sources_sha256`` equals the hash of their
sources. A check edited after the record fails here, in the fast set, without running the mutants (that is
``tests/test_mutation.py``'s job): run ``python tools/mutation.py --record``, then ``python tools/make_readme_tables.py``."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("diffattn_mutation_record", ROOT / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutation
_spec.loader.exec_module(mutation)


def test_the_record_is_of_the_current_sources():
    recorded = json.loads(mutation.RECORD.read_text())
    assert recorded.get("sources_sha256") == mutation.sources_hash(), (
        "the checks, tools/mutation.py or a solution changed after diffattn_tutorial/recorded/mutation.json was "
        "made: run `python tools/mutation.py --record` and `python tools/make_readme_tables.py`")


def test_the_hash_sees_a_check_edit_and_ignores_outputs(tmp_path):
    """Planted: a one-character edit of a check changes the hash; a solution's outputs do not."""
    for sub in ("diffattn_tutorial/checks", "solutions", "tools"):
        (tmp_path / sub).mkdir(parents=True)
    for p in (ROOT / "diffattn_tutorial" / "checks").glob("*.py"):
        shutil.copy(p, tmp_path / "diffattn_tutorial" / "checks" / p.name)
    shutil.copy(ROOT / "tools" / "mutation.py", tmp_path / "tools" / "mutation.py")
    nb = json.loads(next((ROOT / "solutions").glob("01_*.ipynb")).read_text())
    (tmp_path / "solutions" / "01_x.ipynb").write_text(json.dumps(nb))
    before = mutation.sources_hash(tmp_path)
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["something else\n"]}]
    (tmp_path / "solutions" / "01_x.ipynb").write_text(json.dumps(nb))
    assert mutation.sources_hash(tmp_path) == before
    check = tmp_path / "diffattn_tutorial" / "checks" / "nb04.py"
    check.write_text(check.read_text().replace("lambda", "lambdA", 1))
    assert mutation.sources_hash(tmp_path) != before
