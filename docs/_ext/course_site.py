"""The course website's own Sphinx extension: API pages, chapter banners, widgets, offline math.

Four jobs, each a small function connected in :func:`setup`:

* **API pages.** :func:`write_api_pages` writes one page per public module of ``diffattn_tutorial`` into
  ``docs/api/generated/`` before Sphinx reads its sources. Every public name (a module's ``__all__``, or else the
  classes and functions it defines and the names it assigns) is documented once, in its *home*: the module that
  defines it, or, when that module is private (``checks._core``), the public module that re-exports it. Other
  modules that re-export a name link to its home. :func:`public_api` is the one list of public names; the site's
  test checks every one of them has an anchor in the built HTML.
* **Chapter banners.** Every page built from a notebook gets the *Open in Colab* badge (from the notebook's own
  header line, or made from ``[project.urls] Repository`` when the notebook has none) and a *download this
  notebook* link to the ``.ipynb``, copied next to the page so the link works from ``file://``.
* **Widgets.** Stored widget outputs have no state a static page can run: a live widget (its text fallback starts
  with ``[live widget``) becomes a note saying it needs a running kernel, next to the static figure the notebook
  shows above it; a progress bar (tqdm's widget) is dropped.
* **Offline math.** On every page (the sidebar's chapter titles hold math), MathJax 3 is served from the site
  itself (``_static/mathjax``, copied from the ``sphinx-mathjax-offline`` package), in its SVG output, which draws
  glyphs as paths and so needs no web fonts: a page opened from ``file://`` without a network typesets its math.
  The Colab badge image is served locally too.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform
from sphinx.util import logging
from sphinx.util.nodes import make_refnode

DOCS = Path(__file__).resolve().parents[1]
ROOT = DOCS.parent
PACKAGE = "diffattn_tutorial"
API_DIR = DOCS / "api" / "generated"
NOTEBOOK_FOLDERS = ("notebooks", "exercises")
MATHJAX_FILES = ("tex-svg.js", "input/tex/extensions")  # the combined TeX-to-SVG build and what it autoloads
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
LOCAL_BADGE = "_static/colab-badge.svg"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
LIVE_WIDGET = "[live widget"  # how the course's show_interactive starts a widget's text fallback

logger = logging.getLogger(__name__)


def _missing(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return True
    return False


# Triton (about 1 GB, Linux only) is not needed to build the site: without it, its modules import against a mock
# (their kernels' docs are their docstrings; nothing compiles or runs). Importing the C++ kernel's module never
# compiles it (that happens on first use).
MOCK_IMPORTS = ["triton"] if _missing("triton") else []


# --- the public API ------------------------------------------------------------------------------------------------

@dataclass
class ModuleAPI:
    """One public module: the names it documents (its home for them) and the names it re-exports (their homes)."""

    name: str
    documented: list[tuple[str, str]] = field(default_factory=list)  # (name, autodoc directive)
    reexported: list[tuple[str, str]] = field(default_factory=list)  # (name, full name of its home)


def public_modules() -> list[str]:
    """Every importable module of the package whose dotted path has no ``_``-prefixed part, sorted."""
    from sphinx.ext.autodoc.mock import mock

    with mock(MOCK_IMPORTS):  # walk_packages imports each subpackage
        pkg = importlib.import_module(PACKAGE)
        names = [PACKAGE] + [m.name for m in pkgutil.walk_packages(pkg.__path__, PACKAGE + ".")]
    return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


def _assigned_names(module) -> list[str]:
    """Names a module's own source assigns at top level (its constants), in source order."""
    return _assigned_in(getattr(module, "__file__", None) or "")


@functools.lru_cache(maxsize=None)
def _assigned_in(path: str) -> list[str]:
    if not path.endswith(".py"):
        return []
    names = []
    for node in ast.parse(Path(path).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def _is_custom_op(obj) -> bool:
    """A ``torch.library.custom_op`` operator: a callable wrapping the function it was made from."""
    return type(obj).__name__ == "CustomOpDef" and hasattr(obj, "_init_fn")


def _directive(obj) -> str:
    """The autodoc directive that documents ``obj``."""
    if inspect.isclass(obj):
        return "autoclass"
    if inspect.isroutine(obj) or _is_custom_op(obj):
        return "autofunction"
    return "autodata"


def _is_alias(obj) -> bool:
    """A name for something defined elsewhere (``Tensor = torch.Tensor``, a module, a ``TypeVar``)."""
    if inspect.ismodule(obj) or type(obj).__module__ == "typing":
        return True
    return (inspect.isclass(obj) or inspect.isroutine(obj)) and not getattr(obj, "__module__", "").startswith(PACKAGE)


def _public_names(module) -> list[str]:
    """``__all__``, or else the public classes and functions the module defines and the public names it assigns."""
    if hasattr(module, "__all__"):
        return [n for n in module.__all__ if n != "__version__"]
    defined = [n for n, obj in vars(module).items()
               if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__]
    assigned = [n for n in _assigned_names(module) if not _is_alias(getattr(module, n, None))]
    names = dict.fromkeys(n for n in defined + assigned if not n.startswith("_") and hasattr(module, n))
    return list(names)


def _defined_here(module, name: str) -> bool:
    """Whether ``module`` is the home of ``module.name``: it defines the class or function, or assigns the name."""
    obj = getattr(module, name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        home = obj.__module__
        return home == module.__name__ or any(p.startswith("_") for p in home.split("."))
    return name in _assigned_names(module)


def public_api() -> dict[str, ModuleAPI]:
    """Every public module and its public names, each name documented in exactly one home."""
    from sphinx.ext.autodoc.mock import mock

    with mock(MOCK_IMPORTS):
        modules = {name: importlib.import_module(name) for name in public_modules()}
    apis = {name: ModuleAPI(name) for name in modules}
    # (id(object), name) -> the full name that documents it; the name too, because equal small ints and strings
    # are one object in Python, and two constants are not one re-exported name because their values are equal
    homes: dict[tuple[int, str], str] = {}
    reexports = []
    for name, module in modules.items():
        for attr in _public_names(module):
            obj = getattr(module, attr)
            if _defined_here(module, attr):
                apis[name].documented.append((attr, _directive(obj)))
                homes.setdefault((id(obj), attr), f"{name}.{attr}")
            else:
                reexports.append((name, attr, obj))
    for name, attr, obj in reexports:  # re-exports: link to the home, or document here when nothing else does
        if (id(obj), attr) in homes:
            apis[name].reexported.append((attr, homes[(id(obj), attr)]))
        else:
            apis[name].documented.append((attr, _directive(obj)))
            homes[(id(obj), attr)] = f"{name}.{attr}"
    return apis


def _page(api: ModuleAPI) -> str:
    """The reST of one module's page."""
    lines = [api.name, "=" * len(api.name), "", f".. automodule:: {api.name}", ""]
    if api.documented:
        lines += ["On this page: " + ", ".join(f":py:obj:`{attr} <{api.name}.{attr}>`" for attr, _ in api.documented)
                  + ".", ""]
    if api.reexported:
        lines += ["Also importable from here: " + ", ".join(f":py:obj:`{attr} <{home}>`" for attr, home in api.reexported)
                  + ".", ""]
    for attr, directive in api.documented:
        lines += [f".. {directive}:: {api.name}.{attr}"]
        lines += ["   :members:"] if directive == "autoclass" else []
        lines += ["   :no-value:"] if directive == "autodata" else []
        lines += [""]
    return "\n".join(lines)


def write_api_pages(app: Sphinx) -> None:
    """Write ``docs/api/generated/<module>.rst`` for every public module (rewriting only pages that changed)."""
    API_DIR.mkdir(parents=True, exist_ok=True)
    pages = {f"{name}.rst": _page(api) for name, api in public_api().items()}
    for old in API_DIR.glob("*.rst"):
        if old.name not in pages:
            old.unlink()
    for fname, text in pages.items():
        path = API_DIR / fname
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


NAPOLEON = None  # sphinx.ext.napoleon's settings, made on first use


def _google_to_rest(app, what, name, obj, options, lines: list[str]) -> list[str]:
    """Google-style sections (``Args:``, ``Returns:``, ``Attributes:``) as reST fields, by Sphinx's napoleon.

    Called here rather than loading ``sphinx.ext.napoleon`` as an extension, so that constants' doc comments
    (``#: Seed of the evaluation data: ...``) keep their text: napoleon would read ``X: Y`` there as type X."""
    global NAPOLEON
    from sphinx.ext.napoleon import Config
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    NAPOLEON = NAPOLEON or Config(napoleon_use_rtype=False, napoleon_use_ivar=True)
    return GoogleDocstring(lines, NAPOLEON, app, what, name, obj, options).lines()


def _literal_blocks(lines: list[str]) -> list[str]:
    """An indented block after a blank line that follows a plain paragraph is preformatted text (a command, an
    aligned table), as the library's docstrings write it: mark it as a reST literal block (``::``)."""
    out: list[str] = []
    para_start = None  # index in ``out`` of the current top-level plain paragraph's first line
    for i, line in enumerate(lines):
        indented = line[:1].isspace() and line.strip()
        after_blank = i > 0 and not lines[i - 1].strip()
        if indented and after_blank and para_start is not None:
            last = len(out) - 2  # the paragraph's last line (a blank line follows it)
            if not out[last].rstrip().endswith("::"):
                out[last] = out[last].rstrip()[:-1] + "::" if out[last].rstrip().endswith(":") else out[last] + " ::"
            para_start = None
        if line.strip() and not line[:1].isspace():
            plain = not re.match(r"(\.\. |:|[*+-] |\d+[.)] |\w[\w ]*::)", line)
            para_start = (len(out) if para_start is None else para_start) if plain else None
        elif not line.strip():
            pass
        else:
            para_start = None if not after_blank else para_start
        out.append(line)
    return out


def own_docstring(app, what, name, obj, options, lines) -> None:
    """Each object's own docs, in reST: a ``custom_op`` operator's are those of the function it wraps (not
    ``CustomOpDef``'s); a constant without a doc comment has none (not its type's, ``dict``'s or ``str``'s);
    Google-style sections become fields; indented preformatted blocks become literal blocks."""
    if what == "data" and lines and "\n".join(lines).strip() == (inspect.getdoc(type(obj)) or "").strip():
        lines[:] = []
    if _is_custom_op(obj):
        lines[:] = (inspect.getdoc(obj._init_fn) or "").splitlines() + [
            "", f"A PyTorch operator (``torch.ops.{obj._qualname.replace('::', '.')}``)."]
    if what not in ("data", "attribute", "property"):
        lines[:] = _google_to_rest(app, what, name, obj, options, _literal_blocks(list(lines)))


def custom_op_signature(app, what, name, obj, options, signature, return_annotation):
    """A ``custom_op`` operator's signature is that of the function it wraps."""
    if _is_custom_op(obj):
        sig = inspect.signature(obj._init_fn)
        ret = "" if sig.return_annotation is inspect.Signature.empty else str(sig.return_annotation)
        return str(sig.replace(return_annotation=inspect.Signature.empty)), ret or None
    return None


# --- chapter pages -------------------------------------------------------------------------------------------------

def notebook_path(app: Sphinx, docname: str) -> str | None:
    """``notebooks/NN_topic.ipynb`` for a page built from a course notebook, else None."""
    folder = docname.split("/")[0]
    if folder in NOTEBOOK_FOLDERS and app.env.doc2path(docname).suffix == ".ipynb":
        return f"{docname}.ipynb"
    return None


def _notebook_header():
    """``tools/notebook_header.py``, the one home of the repository URL and the Colab link rule."""
    spec = importlib.util.spec_from_file_location("notebook_header", ROOT / "tools" / "notebook_header.py")
    header = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(header)
    return header


def colab_url(rel: str) -> str:
    """The Colab address of notebook ``rel``."""
    header = _notebook_header()
    return header.colab_link(header.repository_url(), rel)


class ChapterBanner(SphinxTransform):
    """Under a notebook's title: the Colab badge (the notebook's own, or one made here) and the download link."""

    default_priority = 500

    def apply(self) -> None:
        rel = notebook_path(self.app, self.env.docname)
        if rel is None:
            return
        badge = next((ref for ref in self.document.findall(nodes.reference)
                      if ref.get("refuri", "").startswith("https://colab.research.google.com/github/")), None)
        download = nodes.reference("", "download this notebook (.ipynb)", refuri=Path(rel).name,
                                   classes=["download-notebook"])
        if badge is not None:
            badge.parent += [nodes.Text(" · "), download]
            return
        image = nodes.image(uri=COLAB_BADGE, alt="Open In Colab", candidates={"?": COLAB_BADGE})
        para = nodes.paragraph("", "", nodes.reference("", "", image, refuri=colab_url(rel)),
                               nodes.Text(" · "), download)
        section = next(iter(self.document.findall(nodes.section)), None)
        target = section if section is not None else self.document
        target.insert(1 if section is not None else 0, para)


class OutsideLinks(SphinxTransform):
    """A notebook's link to a file the site does not render (a solution, the README) goes to the repository."""

    default_priority = 400

    def apply(self) -> None:
        for xref in list(self.document.findall(addnodes.pending_xref)):
            if xref.get("reftype") != "myst" or xref.get("refdomain") != "doc":
                continue
            target = xref["reftarget"]
            if target in self.env.found_docs:
                continue
            path = next((f"{target}{ext}" for ext in (".ipynb", ".md") if (ROOT / f"{target}{ext}").is_file()), None)
            if path is None:
                continue  # a link to nothing: MyST's own warning fails the build
            header = _notebook_header()
            url = f"{header.repository_url()}/blob/{header.BRANCH}/{path}"
            xref.replace_self(nodes.reference("", "", *xref.children, refuri=url, internal=False))


class StaticWidgets(SphinxTransform):
    """Stored widget outputs: a live widget becomes a note (it needs a kernel); a progress bar is dropped."""

    default_priority = 500

    def apply(self) -> None:
        for bundle in list(self.document.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            mimes = {child.get("mime_type"): child for child in bundle.children}
            if WIDGET_VIEW not in mimes:
                continue
            text = mimes.get("text/plain", nodes.Text("")).astext().strip()
            if not text.startswith(LIVE_WIDGET):
                bundle.parent.remove(bundle)
                continue
            said = text.strip("[]")
            said = said[:1].upper() + said[1:] + " Open this notebook in Colab or JupyterLab to move the sliders."
            note = nodes.admonition("", nodes.title("", "Interactive widget: needs a running kernel"),
                                    nodes.paragraph("", said), classes=["note", "static-widget"])
            bundle.replace_self(note)


def _exists(target: str, module: str | None, cls: str | None) -> bool:
    """Whether ``target`` names an object of the package, looked up as Python would from ``module``/``cls``."""
    candidates = [target] + [f"{module}.{cls}.{target}"] * bool(module and cls) + [f"{module}.{target}"] * bool(module)
    for full in candidates:
        parts = full.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj.__name__.startswith(PACKAGE) if inspect.ismodule(obj) else full.startswith(PACKAGE)
    # a private helper named from a sibling module (a kernel of flash_kernels named in flash_diff)
    return "." not in target and target in _package_attributes()


@functools.lru_cache(maxsize=None)
def _package_attributes() -> frozenset[str]:
    """Every name any module of the package holds, private ones included."""
    return frozenset(name for mod_name, mod in list(sys.modules.items()) if mod_name.startswith(PACKAGE) and mod
                     for name in vars(mod))


def _by_last_name(domain) -> dict[str, list[str]]:
    """The documented Python objects' full names, by their last component (built once per build)."""
    index = getattr(domain, "_course_site_index", None)
    if index is None or index[0] != len(domain.objects):
        names: dict[str, list[str]] = {}
        for name, obj in domain.objects.items():
            if not obj.aliased:
                names.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        index = (len(domain.objects), names)
        domain._course_site_index = index
    return index[1]


def resolve_short_names(app: Sphinx, env, node, contnode):
    """A Python cross-reference Sphinx did not find: link it when its name ends exactly one documented object's
    full name (``MultiheadDiffAttn`` from ``interop``); leave it as code, unlinked, when it names an object of the
    package that has no page (a private kernel, a module constant). A name that exists nowhere stays unresolved,
    and the build fails on it."""
    if node.get("refdomain") != "py":
        return None
    target = re.sub(r"\s+", "", node["reftarget"]).lstrip("~.")  # a role broken over two lines
    head = target.split(".")[0]
    if hasattr(builtins, head) or (head != PACKAGE and head in sys.modules):
        return None  # a builtin or another package's name (torch.Tensor): Sphinx and nitpick_ignore decide
    domain = env.get_domain("py")
    matches = [name for name in _by_last_name(domain).get(target.rsplit(".", 1)[-1], [])
               if name == target or name.endswith("." + target)]
    if len(matches) == 1:
        obj = domain.objects[matches[0]]
        return make_refnode(app.builder, node["refdoc"], obj.docname, obj.node_id, contnode, matches[0])
    if _exists(target, node.get("py:module"), node.get("py:class")):
        return contnode
    return None


def localise_badge(app: Sphinx, doctree, docname: str) -> None:
    """The Colab badge image from the site's own ``_static`` (it then shows offline too)."""
    depth = "../" * docname.count("/")
    for image in doctree.findall(nodes.image):
        if image.get("uri") == COLAB_BADGE:
            image["uri"] = depth + LOCAL_BADGE
            image["candidates"] = {"?": image["uri"]}


# --- files copied into the site ------------------------------------------------------------------------------------

def mathjax_dir() -> Path:
    """The MathJax 3 files that ``sphinx-mathjax-offline`` ships."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the website serves MathJax itself: install it with pip install -e \".[docs]\" "
                           "(the sphinx-mathjax-offline package)")
    return Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"


def copy_files(app: Sphinx, exc) -> None:
    """After a good build: MathJax into ``_static/mathjax``, each notebook next to its page."""
    if exc is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    for rel in MATHJAX_FILES:
        src, dst = mathjax_dir() / rel, out / "_static" / "mathjax" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree(src, dst, dirs_exist_ok=True) if src.is_dir() else shutil.copy2(src, dst))
    for docname in app.env.found_docs:
        rel = notebook_path(app, docname)
        if rel is not None:
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, out / rel)


def setup(app: Sphinx) -> dict:
    app.set_html_assets_policy("always")  # MathJax on every page: chapter titles in the sidebar hold math
    app.connect("builder-inited", write_api_pages)
    app.connect("autodoc-process-docstring", own_docstring)
    app.connect("autodoc-process-signature", custom_op_signature)
    app.connect("doctree-resolved", localise_badge)
    app.connect("build-finished", copy_files)
    app.add_transform(ChapterBanner)
    app.add_transform(StaticWidgets)
    app.add_transform(OutsideLinks)
    app.connect("missing-reference", resolve_short_names)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":  # python docs/_ext/course_site.py: list the public API
    for api in public_api().values():
        print(api.name, [a for a, _ in api.documented], [a for a, _ in api.reexported], file=sys.stdout)
