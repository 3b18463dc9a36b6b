"""The course website (``python docs/build.py``): it builds with warnings as errors; every notebook, exercise,
solution and public name has its page and the exercises' checks have none; every link stays inside the site; and,
in headless Chromium driven by Playwright when both are installed, pages render from ``file://`` with no network
and no console error, their math typeset, nothing scrolls sideways at 1280 px, and search shows titles and excerpts.

The site is built once per module, in a subprocess (Sphinx registers roles and directives process-wide), from the
notebooks' stored outputs: nothing is executed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHAPTER_GLOBS = ("notebooks/[0-9][0-9]_*.ipynb", "exercises/[0-9][0-9]_*.ipynb", "solutions/[0-9][0-9]_*.ipynb")
LEFT_OUT = "diffattn_tutorial.checks"  # the exercises' checks: their docstrings describe the answers
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]

missing = [m for m in ("sphinx", "myst_nb", "furo") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"the website's tools are not installed ({', '.join(missing)}): "
                                                       f"pip install -e \".[docs]\"")


def chapters() -> list[str]:
    """Every course notebook, exercise and solution, as ``notebooks/01_x`` (its page is ``notebooks/01_x.html``)."""
    return sorted(str(p.relative_to(ROOT).with_suffix("")) for g in CHAPTER_GLOBS for p in ROOT.glob(g))


def sphinx_build(src: Path, out: Path, *, conf: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"] + (["-c", str(conf)] if conf else [])
    return subprocess.run(args + [str(src), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """Empty cache folders for the build: the C++ kernel's and Triton's (a compile would write there)."""
    folder = tmp_path_factory.mktemp("caches")
    return {"DIFFATTN_CACHE": folder / "diffattn", "TRITON_CACHE_DIR": folder / "triton"}


@pytest.fixture(scope="module")
def site(tmp_path_factory, caches) -> Path:
    out = tmp_path_factory.mktemp("site") / "html"
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}, "CUDA_VISIBLE_DEVICES": ""}  # no GPU either
    run = subprocess.run([sys.executable, str(DOCS / "build.py"), str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=900, env=env)
    problems = [line for line in (run.stdout + run.stderr).splitlines() if "WARNING" in line or "ERROR" in line]
    assert run.returncode == 0, "the site did not build (warnings are errors):\n" + "\n".join(problems or
                                                                                                [run.stderr[-3000:]])
    return out


class Page(HTMLParser):
    """The ids, links (``href``/``src``), classes and meta tags of one HTML page."""

    def __init__(self, path: Path):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.classes: set[str] = set()
        self.meta: list[dict] = []
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        self.classes.update((attrs.get("class") or "").split())
        self.meta += [attrs] if tag == "meta" else []
        for key in ("href", "src"):
            if attrs.get(key):
                self.links.append(attrs[key])


def test_building_compiles_no_kernel(site, caches):
    """Importing every module for its docs compiles neither the C++ kernel nor a Triton kernel."""
    for name, folder in caches.items():
        assert not folder.exists() or not any(folder.rglob("*")), f"the build wrote into {name}: {list(folder.rglob('*'))[:5]}"


def test_the_sites_own_code_stays_small():
    """Maintained extensions do the site's work; its own extension keeps to what no package does."""
    lines = len((DOCS / "_ext" / "course_site.py").read_text().splitlines())
    assert lines < 150, f"docs/_ext/course_site.py has {lines} lines"


def test_every_chapter_has_a_page_with_colab_and_download(site):
    names = chapters()
    assert len([n for n in names if n.startswith("notebooks/")]) >= 14
    assert len([n for n in names if n.startswith("solutions/")]) >= 14
    for name in names:
        page = site / f"{name}.html"
        assert page.is_file(), f"no page for {name}.ipynb"
        links = Page(page).links
        colab = [link for link in links if link.startswith("https://colab.research.google.com/github/")]
        assert colab and colab[0].endswith(f"/blob/main/{name}.ipynb"), f"{page.name}: no Colab badge for itself"
        assert any(link.endswith("colab-badge.svg") and not urlsplit(link).scheme for link in links), \
            f"{page.name}: the badge image is not the site's own"
        download = Path(name).name + ".ipynb"
        assert download in links, f"{page.name}: no download link"
        assert (page.parent / download).read_bytes() == (ROOT / f"{name}.ipynb").read_bytes()


def test_home_page_lists_the_chapters_and_only_says_what_the_site_has(site):
    home = (site / "docs" / "index.html").read_text(encoding="utf-8")
    order = [home.find(f'href="../{name}.html"') for name in chapters() if name.startswith("notebooks/")]
    assert -1 not in order and order == sorted(order), "the home page lists every chapter, in order"
    # the README's introduction points at its own later sections ("measured below", "'Start' lists ..."): the
    # home page has its own, and links the README, which is a page of the site
    for phrase in ("measured below", "Start\u201d lists", "Start\" lists", "(\"Start\""):
        assert phrase not in home, f"the home page says {phrase!r}, about a section it does not have"
    assert 'href="../README.html"' in home and (site / "README.html").is_file()


def test_folder_index_is_a_plain_page_with_a_link_home(site):
    """The folder's index.html links the home page and does not redirect (an instant meta refresh kept a headless
    screenshot of it waiting forever)."""
    page = Page(site / "index.html")
    assert "docs/index.html" in page.links
    assert not [m for m in page.meta if m.get("http-equiv", "").lower() == "refresh"]


def public_modules() -> dict[str, Path]:
    """Every module of the package without a ``_``-prefixed part, the checks' left out, by name: its source."""
    modules = {}
    for path in sorted((ROOT / "diffattn_tutorial").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        name = ".".join(parts)
        if not any(p.startswith("_") for p in parts) and not name.startswith(LEFT_OUT):
            modules[name] = path
    return modules


def defined_names(path: Path) -> list[str]:
    """The public classes and functions a module's source defines at its top level (read, not imported), except
    torch operators (``custom_op``: an operator object, not a function; its module's docstring describes it)."""
    return [node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
            and not any("custom_op" in ast.unparse(d) for d in node.decorator_list)]


def test_every_public_class_and_function_has_its_anchor(site):
    """Each public module's page documents every public class and function the module defines."""
    modules = public_modules()
    for needed in ("functional", "layers.attention", "interop", "backends", "kernels.cpu.cpu_fused",
                   "kernels.triton.flash_diff", "kernels.triton.decode", "training.model", "measure.flops"):
        assert f"diffattn_tutorial.{needed}" in modules
    documented = 0
    for name, path in modules.items():
        page = site / "docs" / "api" / "generated" / f"{name}.html"
        assert page.is_file(), f"no API page for {name}"
        ids = Page(page).ids
        for attr in defined_names(path):
            assert f"{name}.{attr}" in ids, f"{name}.{attr} is not documented on {page.name}"
            documented += 1
    assert documented > 200, documented


def test_the_exercise_checks_are_left_out(site):
    pages = list(site.rglob("*.html"))
    assert not [p.name for p in pages if LEFT_OUT in p.name], "an API page for the checks"
    for path in pages:
        assert f'id="{LEFT_OUT}' not in path.read_text(encoding="utf-8"), f"{path.name} documents the checks"


def test_internal_links_resolve_and_none_leaves_the_site(site):
    """Every relative link resolves (with its anchor); the only links to the repository are the Colab badges:
    the exercises' "Solved:" links and the notebooks' README links open pages of the site."""
    pages = {p: Page(p) for p in site.rglob("*.html")}
    broken, outside = [], []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if "github.com/diffattn-tutorial" in link and "colab.research.google.com" not in link:
                outside.append(f"{path.relative_to(site)} -> {link}")
            if parts.scheme or link.startswith("//"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.exists():
                broken.append(f"{path.relative_to(site)} -> {link}")
            elif parts.fragment and target.suffix == ".html" and target in pages and \
                    unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(site)} -> {link} (no such anchor)")
    assert not broken, "\n".join(broken[:20])
    assert not outside, "links out of the site to the repository:\n" + "\n".join(outside[:20])
    exercise = Page(site / "exercises" / "03_dual_softmax.html").links
    assert "../solutions/03_dual_softmax.html" in exercise, "the exercise's Solved: link opens the solution's page"


def test_widgets_shown_statically(site):
    amplifier = (site / "notebooks" / "01_differential_amplifier.html").read_text(encoding="utf-8")
    assert "static-widget" in amplifier and "needs a running kernel" in amplifier
    assert "widget-view+json" not in amplifier
    experiments = (site / "notebooks" / "07_experiments.html").read_text(encoding="utf-8")
    assert "0/500" not in experiments, "a stored progress bar is not shown as text"


def test_no_page_loads_anything_from_the_network(site):
    for path in site.rglob("*.html"):
        text = path.read_text(encoding="utf-8")
        loads = re.findall(r'<(?:script|img|link)\b[^>]*?(?:src|href)="((?:https?:)?//[^"]+)"', text)
        assert not loads, f"{path.relative_to(site)} loads {loads[:3]}"


def test_page_titles_hold_no_raw_tex(site):
    """The browser tab's title and the search results' titles (the search index's) show math as text."""
    titles = re.findall(r"<title>(.*?)</title>", (site / "exercises" / "05_subnorm.html").read_text(encoding="utf-8"))
    assert titles and "\\" not in titles[0] and "λ" in titles[0], titles
    index = (site / "searchindex.js").read_text(encoding="utf-8")
    assert "\\\\lambda" not in index.split('"titles":')[1].split("]")[0]


# --- the site's extension on a planted project -------------------------------------------------------------------

PLANTED = {
    "planted/__init__.py": "",
    "planted/alpha.py": '''
        class Documented:
            """A documented class."""

        LIMIT = 3
        """Seed of the data: three rows."""
        ''',
    "planted/beta.py": '''
        from planted.alpha import Documented

        def uses() -> None:
            """Builds a :class:`Documented` (a short name, defined in alpha)."""
        ''',
    "index.rst": "Planted\n=======\n\n.. automodule:: planted.alpha\n   :members:\n\n"
                 ".. automodule:: planted.beta\n   :members:\n",
}


def test_short_names_link_constants_stay_prose_and_a_reference_to_nothing_fails(tmp_path):
    for rel, text in PLANTED.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    (tmp_path / "conf.py").write_text(f"import sys\nsys.path[:0] = [{str(DOCS / '_ext')!r}, {str(tmp_path)!r}]\n"
                                      "extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon', 'course_site']\n"
                                      "nitpicky = True\n")
    run = sphinx_build(tmp_path, tmp_path / "out")
    assert run.returncode == 0, run.stderr[-2000:]
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert 'href="#planted.alpha.Documented"' in page, "the short name links the class documented in alpha"
    assert "Seed of the data: three rows." in page and not re.search(r">Type\b", page), "napoleon read it as a type"
    (tmp_path / "planted" / "gamma.py").write_text('def bad():\n    """Calls :func:`no_such_thing`."""\n')
    (tmp_path / "index.rst").write_text(PLANTED["index.rst"] + "\n.. automodule:: planted.gamma\n   :members:\n")
    run = sphinx_build(tmp_path, tmp_path / "out2")
    assert run.returncode != 0 and "no_such_thing" in run.stderr, run.stderr[-2000:]


# --- in a real browser -------------------------------------------------------------------------------------------

def chromium() -> str | None:
    candidates = ["/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")]
    return next((c for c in candidates if c and Path(c).is_file()), None)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the browser checks of the site need Playwright: pip install playwright")
    if chromium() is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium); the browser checks of "
                    "the site need it")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def tab(browser):
    """A page 1280 px wide with the network off, and the errors it reports (console, exceptions, failed loads)."""
    context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
    page, errors = context.new_page(), []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "assert") else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"load failed: {r.url} {r.failure}"))
    yield page, errors
    context.close()


def open_page(page, url: str) -> None:
    """Load ``url`` and wait for MathJax (when the page loads it) to finish typesetting."""
    page.goto(url)
    page.evaluate("window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")


@pytest.mark.parametrize("page, math", [("docs/index.html", False), ("notebooks/03_dual_softmax.html", True),
                                        ("docs/api/generated/diffattn_tutorial.functional.html", False)])
def test_page_renders_offline_in_chromium(site, tab, page, math):
    browser_page, errors = tab
    open_page(browser_page, (site / page).as_uri())
    assert errors == [], f"{page}: {errors}"
    state = browser_page.evaluate(r"""() => ({
        title: document.title,
        text: document.body.innerText.length,
        broken: Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
        figures: Array.from(document.images).filter(i => i.src.includes('/_images/') && i.naturalWidth > 100).length,
        math: document.querySelectorAll('mjx-container[jax="SVG"]').length,
        unrendered: document.querySelectorAll('mjx-merror').length,
        raw_tex: /\\\(|\$\$/.test(document.body.innerText)})""")
    assert state["title"] and state["text"] > 1000, state
    assert state["broken"] == [], f"{page}: images that did not load: {state['broken']}"
    assert not state["raw_tex"], f"{page}: TeX left untypeset (the sidebar's titles hold math on every page)"
    if math:
        assert state["figures"] >= 1 and state["math"] >= 10 and state["unrendered"] == 0, state


SIDEWAYS = """() => Array.from(document.querySelectorAll("article *"))
    .filter((el) => el.scrollWidth > el.clientWidth + 1 && ["auto", "scroll"].includes(getComputedStyle(el).overflowX))
    .map((el) => `${el.tagName}.${el.className}: ${el.innerText.slice(0, 80)}`)"""


@pytest.mark.parametrize("page", ["notebooks/14_converting_trained_models.html", "notebooks/09_triton_kernel.html",
                                  "README.html"])
def test_nothing_scrolls_sideways_at_1280_px(site, tab, page):
    """Wide printed lines, tables and equations wrap or fit: a reader at 1280 px sees every column."""
    browser_page, _ = tab
    open_page(browser_page, (site / page).as_uri())
    assert browser_page.evaluate(SIDEWAYS) == [], f"{page}: elements that scroll sideways at 1280 px"
    assert browser_page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_search_from_file_shows_titles_and_excerpts(site, tab):
    browser_page, errors = tab
    open_page(browser_page, (site / "search.html").as_uri() + "?q=lambda")
    browser_page.wait_for_selector("#search-results li p.context", timeout=60_000)
    titles = browser_page.eval_on_selector_all("#search-results li > a", "links => links.map(a => a.innerText)")
    excerpts = browser_page.eval_on_selector_all("#search-results li p.context", "ps => ps.map(p => p.innerText)")
    assert len(titles) >= 5 and not [t for t in titles if "\\" in t], titles
    assert any("lambda" in e.lower() for e in excerpts), excerpts[:5]
    assert errors == [], errors


def test_folder_index_screenshots_headless(site, tmp_path):
    """The reported failure itself: ``chromium --headless --screenshot`` of the folder's index.html finishes."""
    if chromium() is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    shot = tmp_path / "index.png"
    run = subprocess.run([chromium(), *CHROMIUM_ARGS, f"--user-data-dir={tmp_path / 'profile'}",
                          f"--screenshot={shot}", "--window-size=1280,900", (site / "index.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.is_file() and shot.stat().st_size > 1000, run.stderr[-2000:]
