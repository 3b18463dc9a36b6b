"""What the course website adds to Sphinx that no package does; each job is a small function connected in setup.

* **Chapter banners.** Every page built from a notebook gets the *Open in Colab* badge (the notebook's own, or one
  made from ``[project.urls] Repository`` by ``tools/notebook_header.py``) and a *download this notebook* link to
  the ``.ipynb``, copied next to the page so the link works from ``file://``. The badge image is served locally.
* **Widgets.** A stored live widget (its text fallback starts with ``[live widget``) becomes a note saying it needs
  a running kernel; a progress bar (tqdm's widget) is dropped.
* **Search from file://.** Result titles are plain text (a chapter title's math as its letters, not raw TeX), and
  excerpts work without a server: Sphinx fetches each result's page for its excerpt, which a browser refuses on
  ``file://``, so each page's text also ships as a script that ``_static/offline-search.js`` loads instead.
"""

from __future__ import annotations

import html
import importlib.util
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
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "_static/colab-badge.svg"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
LIVE_WIDGET = "[live widget"  # how the course's show_interactive starts a widget's text fallback
PAGE_TEXT = "_page_text"  # the folder of the pages' texts for search excerpts


def notebook_path(app: Sphinx, docname: str) -> str | None:
    """``notebooks/NN_topic.ipynb`` for a page built from a course notebook, else None."""
    if docname.split("/")[0] in NOTEBOOK_FOLDERS and app.env.doc2path(docname).suffix == ".ipynb":
        return f"{docname}.ipynb"
    return None


def colab_url(rel: str) -> str:
    """The Colab address of notebook ``rel``, by ``tools/notebook_header.py`` (the one home of that rule)."""
    spec = importlib.util.spec_from_file_location("notebook_header", ROOT / "tools" / "notebook_header.py")
    header = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(header)
    return header.colab_link(header.repository_url(), rel)


class ChapterBanner(SphinxTransform):
    """Under a notebook's title: its Colab badge (its own, or one made here) and the download link."""

    default_priority = 500

    def apply(self) -> None:
        rel = notebook_path(self.app, self.env.docname)
        if rel is None:
            return
        download = nodes.reference("", "download this notebook (.ipynb)", refuri=Path(rel).name,
                                   classes=["download-notebook"])
        badge = next((ref for ref in self.document.findall(nodes.reference)
                      if ref.get("refuri", "").startswith("https://colab.research.google.com/github/")), None)
        if badge is not None:
            badge.parent += [nodes.Text(" · "), download]
            return
        image = nodes.image(uri=COLAB_BADGE, alt="Open In Colab", candidates={"?": COLAB_BADGE})
        para = nodes.paragraph("", "", nodes.reference("", "", image, refuri=colab_url(rel)), nodes.Text(" · "),
                               download)
        section = next(iter(self.document.findall(nodes.section)), None)
        (section or self.document).insert(1 if section is not None else 0, para)


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
            said = text.strip("[]")
            said = said[:1].upper() + said[1:] + " Open this notebook in Colab or JupyterLab to move the sliders."
            bundle.replace_self(nodes.admonition("", nodes.title("", "Interactive widget: needs a running kernel"),
                                                 nodes.paragraph("", said), classes=["note", "static-widget"]))


def short_names(app: Sphinx, env, node, contnode):
    """A Python reference Sphinx did not find, looked up again as Sphinx looks up ``.name``: the one documented
    object whose full name ends with it (``MultiheadDiffAttn`` in interop's docstrings, defined in layers)."""
    if node.get("refdomain") != "py" or node.get("refspecific"):
        return None
    node["refspecific"] = True  # two matches: Sphinx's own "more than one target" warning fails the build
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                             node["reftarget"], node, contnode)


PROSE: dict[str, list[str]] = {}  # a constant's or attribute's docstring, kept from napoleon


def keep_prose(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    """Napoleon reads a constant's docstring ``Seed of the data: ...`` as ``type: description`` (Google style for
    attributes); the library writes those docstrings as prose, so they are kept as written (restored after it)."""
    if what in ("data", "attribute", "property"):
        PROSE[name] = list(lines)


def restore_prose(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    if name in PROSE:
        lines[:] = PROSE.pop(name)


def localise_badge(app: Sphinx, doctree, docname: str) -> None:
    """The Colab badge image from the site's own ``_static`` (it then shows offline too)."""
    for image in doctree.findall(nodes.image):
        if image.get("uri") == COLAB_BADGE:
            image["uri"] = "../" * docname.count("/") + LOCAL_BADGE
            image["candidates"] = {"?": image["uri"]}


def tex_as_text(tex: str) -> str:
    r"""TeX as readable text for a title: ``\lambda_{\text{init}}`` -> ``λ_init`` (Greek letters by name)."""
    def letter(match: re.Match) -> str:
        name = match.group(1)
        case = "CAPITAL" if name[0].isupper() else "SMALL"
        try:
            return unicodedata.lookup(f"GREEK {case} LETTER {name.upper()}")
        except KeyError:
            return ""  # \text, \mathrm, \left: the command goes, its argument stays
    return re.sub(r"[{}]", "", re.sub(r"\\([A-Za-z]+)\s*", letter, tex))


def plain_titles(app: Sphinx, doctree) -> None:
    """The page's long title (the browser tab's and the search results') with its math as text, not raw TeX."""
    title = app.env.longtitles.get(app.env.docname)
    for math in list(title.findall(nodes.math)) if title is not None else []:
        math.replace_self(nodes.Text(tex_as_text(math.astext())))


def page_text(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Each page's text as a script (for search excerpts from file://); the search page loads the loader."""
    if pagename == "search":
        app.add_js_file("offline-search.js")
    if doctree is None:
        return
    path = Path(app.outdir, PAGE_TEXT, pagename + ".js")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(f'<div role="main">{html.escape(doctree.astext())}</div>')  # what Search.htmlToText reads
    path.write_text(f"window.coursePageText[document.currentScript.src] = {text};\n", encoding="utf-8")


def copy_notebooks(app: Sphinx, exc) -> None:
    """After a good build, each notebook next to its page (its download link)."""
    if exc is not None or app.builder.format != "html":
        return
    for docname in app.env.found_docs:
        rel = notebook_path(app, docname)
        if rel is not None:
            (Path(app.outdir) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, Path(app.outdir) / rel)


def setup(app: Sphinx) -> dict:
    app.set_html_assets_policy("always")  # MathJax on every page: chapter titles in the sidebar hold math
    app.add_transform(ChapterBanner)
    app.add_transform(StaticWidgets)
    app.connect("doctree-read", plain_titles, priority=900)  # after Sphinx's title collector
    app.connect("autodoc-process-docstring", keep_prose, priority=400)  # napoleon's runs at 500
    app.connect("autodoc-process-docstring", restore_prose, priority=600)
    app.connect("missing-reference", short_names)
    app.connect("doctree-resolved", localise_badge)
    app.connect("html-page-context", page_text)
    app.connect("build-finished", copy_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
