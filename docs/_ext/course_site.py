"""What the course website adds to Sphinx that no package does, each job a small function connected in setup.

* **Chapter banners.** Beside a notebook's *Open in Colab* badge, a *download this notebook* link to the ``.ipynb``,
  copied next to the page (it works from ``file://``); the badge image is the site's own, so it shows offline.
* **Widgets.** A stored live widget (its text fallback starts with ``[live widget``) becomes a note saying it needs
  a running kernel; a progress bar (tqdm's widget) is dropped.
* **Search from file://.** Result titles in plain text (a title's math as letters, not raw TeX); excerpts without a
  server (Sphinx fetches each result's page, which a browser refuses on ``file://``: each page's text ships as a
  script that ``_static/offline-search.js`` loads instead).
* Two settings Sphinx's pieces have no option for: a short name resolves as Sphinx resolves ``.name``, and the
  library's constant docstrings stay prose (napoleon reads ``X: Y`` there as a type).
"""

from __future__ import annotations

import functools
import html
import json
import re
import shutil
import unicodedata
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_FOLDERS = ("notebooks", "exercises", "solutions")
COLAB = "https://colab.research.google.com/github/"
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "/docs/_static/colab-badge.svg"  # from the source folder (the repository root)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
LIVE_WIDGET = "[live widget"  # how the course's show_interactive starts a widget's text fallback


def notebook_path(app: Sphinx, docname: str) -> str | None:
    """``notebooks/NN_topic.ipynb`` for a page built from a course notebook, else None."""
    notebook = docname.split("/")[0] in NOTEBOOK_FOLDERS and app.env.doc2path(docname).suffix == ".ipynb"
    return f"{docname}.ipynb" if notebook else None


class ChapterBanner(SphinxTransform):
    """Beside a notebook's Colab badge: the download link; the badge image from the site itself."""

    default_priority = 500

    def apply(self) -> None:
        rel = notebook_path(self.app, self.env.docname)
        if rel is None:
            return
        badge = next((ref for ref in self.document.findall(nodes.reference) if ref.get("refuri", "").startswith(COLAB)),
                     None)
        if badge is None:  # tools/notebook_header.py writes one into every notebook (tests/test_docs.py checks)
            return
        badge.parent += [nodes.Text(" · "), nodes.reference("", "download this notebook (.ipynb)",
                                                            refuri=Path(rel).name, classes=["download-notebook"])]
        for image in self.document.findall(nodes.image):
            if image.get("uri") == COLAB_BADGE:
                image["uri"] = LOCAL_BADGE  # Sphinx copies it into _images/


class StaticWidgets(SphinxTransform):
    """Stored widget outputs: a live widget becomes a note (it needs a kernel); a progress bar is dropped."""

    default_priority = 500

    def apply(self) -> None:
        for bundle in list(self.document.findall(nodes.container)):
            mimes = {child.get("mime_type"): child for child in bundle.children}
            if bundle.get("nb_element") != "mime_bundle" or WIDGET_VIEW not in mimes:
                continue
            text = mimes.get("text/plain", nodes.Text("")).astext().strip()
            if not text.startswith(LIVE_WIDGET):
                bundle.parent.remove(bundle)
                continue
            said = text[1:2].upper() + text[2:].rstrip("]")  # "[live widget: ...]" -> "Live widget: ..."
            said += " Open this notebook in Colab or JupyterLab to move the sliders."
            bundle.replace_self(nodes.admonition("", nodes.title("", "Interactive widget: needs a running kernel"),
                                                 nodes.paragraph("", said), classes=["note", "static-widget"]))


def tex_as_text(tex: str) -> str:
    r"""TeX as readable text for a title: ``\lambda_{\text{init}}`` -> ``λ_init`` (Greek letters by name)."""
    def letter(match: re.Match) -> str:
        case = "CAPITAL" if match.group(1)[0].isupper() else "SMALL"
        try:
            return unicodedata.lookup(f"GREEK {case} LETTER {match.group(1).upper().replace('LAMBDA', 'LAMDA')}")
        except KeyError:
            return ""  # \text, \mathrm, \left: the command goes, its argument stays
    return re.sub(r"[{}]", "", re.sub(r"\\([A-Za-z]+)\s*", letter, tex))


def plain_titles(app: Sphinx, doctree) -> None:
    """The page's long title (the browser tab's and the search results') with its math as text, not raw TeX."""
    title = app.env.longtitles.get(app.env.docname)
    for math in list(title.findall(nodes.math)) if title is not None else []:
        math.replace_self(nodes.Text(tex_as_text(math.astext())))


def beside_page(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Next to each page: its notebook (the download link's target) and its text as a script (search excerpts)."""
    if pagename == "search":
        app.add_js_file("offline-search.js")
    if doctree is None:
        return
    path = Path(app.outdir, "_page_text", f"{pagename}.js")  # offline-search.js reads it there
    for folder in (path.parent, Path(app.outdir, pagename).parent):  # the page itself is written after this event
        folder.mkdir(parents=True, exist_ok=True)
    if (rel := notebook_path(app, pagename)) is not None:
        shutil.copy2(ROOT / rel, Path(app.outdir, rel))
    words = (tex_as_text(t) if isinstance(t.parent, (nodes.math, nodes.math_block)) else t
             for t in doctree.findall(nodes.Text))  # the page's text, its math as letters
    text = json.dumps(f'<div role="main">{html.escape(" ".join(words))}</div>')  # what Search.htmlToText reads
    path.write_text(f"window.coursePageText[document.currentScript.src] = {text};\n", encoding="utf-8")


def short_names(app: Sphinx, env, node, contnode):
    """A Python reference Sphinx did not find, looked up as Sphinx looks up ``.name``: the one documented object
    whose full name ends with it (``MultiheadDiffAttn`` in interop's docstrings, defined in layers)."""
    if node.get("refdomain") != "py" or node.get("refspecific"):
        return None
    node["refspecific"] = True  # two matches: Sphinx's own "more than one target" warning fails the build
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], node["reftarget"],
                                             node, contnode)


PROSE: dict[str, list[str]] = {}  # constants' and attributes' docstrings, kept from napoleon


def keep_prose(app: Sphinx, what: str, name: str, obj, options, lines: list[str], restore: bool = False) -> None:
    """Napoleon reads a constant's docstring ``Seed of the data: ...`` as ``type: description`` (Google style for
    attributes); the library's are prose: kept before napoleon runs, restored after it (``restore``)."""
    if restore and name in PROSE:
        lines[:] = PROSE.pop(name)
    elif not restore and what in ("data", "attribute", "property"):
        PROSE[name] = list(lines)


def setup(app: Sphinx) -> dict:
    app.set_html_assets_policy("always")  # MathJax on every page: chapter titles in the sidebar hold math
    app.add_transform(ChapterBanner)
    app.add_transform(StaticWidgets)
    app.connect("doctree-read", plain_titles, priority=900)  # after Sphinx's title collector
    app.connect("autodoc-process-docstring", keep_prose, priority=400)  # napoleon's runs at 500
    app.connect("autodoc-process-docstring", functools.partial(keep_prose, restore=True), priority=600)
    app.connect("missing-reference", short_names)
    app.connect("html-page-context", beside_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
