"""Every chapter of the course reads with a figure: each notebook in ``notebooks/`` keeps at least one image among
its stored outputs (issue 49: notebook 13 had only tables). Reads the committed notebooks, never executes one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def image_outputs(nb: dict) -> int:
    """How many stored outputs of the notebook ``nb`` (its JSON) hold an image."""
    return sum(1 for cell in nb["cells"] if cell["cell_type"] == "code" for out in cell.get("outputs", [])
               if any(kind in out.get("data", {}) for kind in IMAGE_TYPES))


def test_the_series_is_found():
    assert len(NOTEBOOKS) >= 15, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_chapter_has_a_figure(path):
    nb = json.loads(path.read_text())
    assert image_outputs(nb) >= 1, (f"{path.name} stores no image output: add a small figure of what the chapter "
                                    f"measures, then re-execute it with tools/run_notebooks.py")


def test_a_notebook_without_a_figure_is_caught():
    text_only = {"cells": [{"cell_type": "markdown", "source": "# x"},
                           {"cell_type": "code", "outputs": [{"output_type": "stream", "text": "1 2 3"},
                                                             {"output_type": "execute_result",
                                                              "data": {"text/plain": "<Figure>"}}]}]}
    assert image_outputs(text_only) == 0
    with_png = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data",
                                                           "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}}]}]}
    assert image_outputs(with_png) == 1
