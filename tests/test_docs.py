"""The course website (``python docs/build.py``): it builds with warnings as errors, every notebook, exercise and
public name has its page, every link inside the site resolves, and, in headless Chromium when it is installed,
pages render from ``file://`` with no network and no console error, their math typeset.

The site is built once per module, in a subprocess (Sphinx registers roles and directives process-wide), from the
notebooks' stored outputs: nothing is executed. The browser is driven through the DevTools protocol (a websocket
client from the ``docs`` extra), with the network switched off, as a learner opening the folder offline sees it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHAPTER_GLOBS = ("notebooks/[0-9][0-9]_*.ipynb", "exercises/[0-9][0-9]_*.ipynb")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--remote-debugging-port=0", "about:blank"]

missing = [m for m in ("sphinx", "myst_nb", "furo") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"the website's tools are not installed ({', '.join(missing)}): "
                                                       f"pip install -e \".[docs]\"")


def chapters() -> list[str]:
    """Every course notebook and exercise, as ``notebooks/01_x`` (its page is ``notebooks/01_x.html``)."""
    return sorted(str(p.relative_to(ROOT).with_suffix("")) for g in CHAPTER_GLOBS for p in ROOT.glob(g))


def course_site():
    """``docs/_ext/course_site.py``, the site's extension: its ``public_api`` is the one list of public names."""
    spec = importlib.util.spec_from_file_location("course_site", DOCS / "_ext" / "course_site.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("course_site", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["course_site"])
    return sys.modules["course_site"]


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
    """The ids, links (``href``/``src``) and classes of one HTML page."""

    def __init__(self, path: Path):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.classes: set[str] = set()
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        self.classes.update((attrs.get("class") or "").split())
        for key in ("href", "src"):
            if attrs.get(key):
                self.links.append(attrs[key])


def test_building_compiles_no_kernel(site, caches):
    """Importing every module for its docs compiles neither the C++ kernel nor a Triton kernel."""
    for name, folder in caches.items():
        assert not folder.exists() or not any(folder.rglob("*")), f"the build wrote into {name}: {list(folder.rglob('*'))[:5]}"


def test_every_chapter_has_a_page_with_colab_and_download(site):
    names = chapters()
    assert len([n for n in names if n.startswith("notebooks/")]) >= 14
    for name in names:
        page = site / f"{name}.html"
        assert page.is_file(), f"no page for {name}.ipynb"
        links = Page(page).links
        colab = [link for link in links if link.startswith("https://colab.research.google.com/github/")]
        assert colab and colab[0].endswith(f"/blob/main/{name}.ipynb"), f"{page.name}: no Colab badge for itself"
        download = Path(name).name + ".ipynb"
        assert download in links, f"{page.name}: no download link"
        assert (page.parent / download).read_bytes() == (ROOT / f"{name}.ipynb").read_bytes()


def test_chapters_in_order_and_home_includes_the_readme(site):
    home = (site / "docs" / "index.html").read_text(encoding="utf-8")
    readme_title = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
    assert re.search(rf"<h1>{re.escape(readme_title)}<a", home), "the home page is the README's introduction"
    order = [home.find(f'href="../{name}.html"') for name in chapters() if name.startswith("notebooks/")]
    assert -1 not in order and order == sorted(order), "the home page lists every chapter, in order"
    assert not (site / "solutions").exists(), "the solutions are not published"
    redirect = (site / "index.html").read_text(encoding="utf-8")
    assert 'url=docs/index.html' in redirect


def test_every_public_name_has_a_page(site):
    apis = course_site().public_api()
    for module in ("functional", "layers.attention", "interop", "backends", "kernels.cpu.cpu_fused",
                   "kernels.triton.flash_diff", "kernels.triton.decode", "training.model", "measure.flops", "checks"):
        assert f"diffattn_tutorial.{module}" in apis, f"diffattn_tutorial.{module} has no API page"
    for name, api in apis.items():
        page = site / "docs" / "api" / "generated" / f"{name}.html"
        assert page.is_file(), f"no API page for {name}"
        parsed = Page(page)
        for attr, _ in api.documented:
            assert f"{name}.{attr}" in parsed.ids, f"{name}.{attr} is not documented on {page.name}"
        for attr, home in api.reexported:
            assert any(link.endswith(f"#{home}") for link in parsed.links), f"{name}.{attr} does not link to {home}"
    documented = sum(len(api.documented) for api in apis.values())
    assert documented > 200, documented


def test_a_reference_to_nothing_is_not_let_through():
    """The site's resolver lets a short or private name through only when the package holds it."""
    site_ext = course_site()
    site_ext.public_api()  # imports every module, as the build does
    assert site_ext._exists("diff_attention", "diffattn_tutorial.interop", None)
    assert site_ext._exists("_diff_attn_fwd", "diffattn_tutorial.kernels.triton.flash_diff", None)  # a sibling's kernel
    for name in ("diff_attention_v3", "functional.no_such_thing", "torch.Tensor", "NoSuchLayer.forward"):
        assert not site_ext._exists(name, "diffattn_tutorial.interop", None), name


def test_internal_links_resolve(site):
    pages = {p: Page(p) for p in site.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.exists():
                broken.append(f"{path.relative_to(site)} -> {link}")
            elif parts.fragment and target.suffix == ".html" and target in pages and \
                    unquote(parts.fragment) not in pages[target].ids:
                broken.append(f"{path.relative_to(site)} -> {link} (no such anchor)")
    assert not broken, "\n".join(broken[:20])


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


# --- in a real browser -------------------------------------------------------------------------------------------

class Browser:
    """Headless Chromium driven through the DevTools protocol: one page at a time, the network switched off."""

    def __init__(self, chromium: str, profile: Path):
        import websocket

        self.proc = subprocess.Popen([chromium, f"--user-data-dir={profile}", *CHROMIUM_FLAGS],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        url, deadline = None, time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before listening")
            match = re.search(r"DevTools listening on (ws://\S+)", line)
            url = match.group(1) if match else None
        self.ws = websocket.create_connection(url, timeout=60, suppress_origin=True)
        self.next_id, self.events = 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Network.emulateNetworkConditions", session=True, offline=True, latency=0, downloadThroughput=-1,
                  uploadThroughput=-1)

    def call(self, method: str, *, session: bool = False, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event and for MathJax (when the page loads it) to finish."""
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            assert time.monotonic() < deadline, f"{url} did not load"
            self.events.append(json.loads(self.ws.recv()))
        self.evaluate("window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads since the last ``open``."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(params["exceptionDetails"].get("text", "") + " " +
                             str(params["exceptionDetails"].get("exception", {}).get("description", "")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(f"{params['entry']['text']} {params['entry'].get('url', '')}")
            elif method == "Network.loadingFailed":
                found.append(f"load failed: {params.get('errorText')}")
        return found

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 (the browser may close the socket before answering)
            pass
        self.ws.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    if chromium is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium); the browser checks of "
                    "the site need it")
    pytest.importorskip("websocket", reason="the browser checks need websocket-client: pip install -e \".[docs]\"")
    browser = Browser(chromium, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


@pytest.mark.parametrize("page, math", [("docs/index.html", False), ("notebooks/03_dual_softmax.html", True),
                                        ("docs/api/generated/diffattn_tutorial.functional.html", False)])
def test_page_renders_offline_in_chromium(site, browser, page, math):
    browser.open((site / page).as_uri())
    assert browser.errors() == [], f"{page}: {browser.errors()}"
    state = json.loads(browser.evaluate(r"""JSON.stringify({
        title: document.title,
        text: document.body.innerText.length,
        broken: Array.from(document.images).filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src),
        figures: Array.from(document.images).filter(i => i.src.includes('/_images/') && i.naturalWidth > 100).length,
        math: document.querySelectorAll('mjx-container[jax="SVG"]').length,
        unrendered: document.querySelectorAll('mjx-merror').length,
        raw_tex: /\\\(|\$\$/.test(document.body.innerText)})"""))
    assert state["title"] and state["text"] > 1000, state
    assert state["broken"] == [], f"{page}: images that did not load: {state['broken']}"
    assert not state["raw_tex"], f"{page}: TeX left untypeset (the sidebar's titles hold math on every page)"
    if math:
        assert state["figures"] >= 1 and state["math"] >= 10 and state["unrendered"] == 0, state
