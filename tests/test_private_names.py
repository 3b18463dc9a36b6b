"""No underscore name of a ``diffattn_tutorial`` module is used outside its module within the package: a name that
another module needs is an interface, and gets a public name, so that the underscore keeps meaning "safe to rename".

The scan reads every module's source (nothing is imported) and finds three kinds of use: ``from x import _y``,
``x._y`` where ``x`` names an imported package module, and ``obj._y`` (``obj`` not ``self``/``cls``) where ``_y`` is
a member that only classes of other package modules define. Dunder names are not private. A private module
(``checks/_core.py``) may be imported by the modules of its own package.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffattn_tutorial"

KERNELS_OUT_OF_SCOPE = "kernels/ is edited by the kernel work this round; rename there"
ALLOWED = {
    # (user module, owner module, name): why it stays for now
    ("checks.nb05", "layers.attention", "_subln_scaled"):
        "exercise 05's check refuses it by name: a learner could call the layer's own scaled sub-norm as the answer",
    ("kernels.triton.aot_keys", "kernels.triton.decode", "_launch_options"):
        KERNELS_OUT_OF_SCOPE + " (read as source text for the cache key, so a rename changes every key)",
    ("kernels.triton.decode", "kernels.triton.flash_kernels", "_dot"): KERNELS_OUT_OF_SCOPE,
    ("kernels.triton.decode", "kernels.triton.flash_kernels", "_online_softmax_step"): KERNELS_OUT_OF_SCOPE,
    ("kernels.triton.flash_diff", "kernels.triton.flash_kernels", "_key_tile_bounds"): KERNELS_OUT_OF_SCOPE,
    **{("kernels.triton.flash_diff", "kernels.triton.flash_kernels", name):
       "a Triton kernel's name is its identity in the recorded compile facts, autotune tables and GPU sessions"
       for name in ("_diff_attn_fwd", "_diff_attn_bwd_preprocess", "_diff_attn_bwd_dkdv")},
    ("kernels.triton.flash_diff", "kernels.triton.dq_kernels", "_diff_attn_bwd_dq"):
        "a Triton kernel's name is its identity in the recorded compile facts, autotune tables and GPU sessions",
    ("kernels.triton.flash_diff", "kernels.triton.atomic_kernels", "_diff_attn_bwd_dkdq"):
        "a Triton kernel's name is its identity in the recorded compile facts, autotune tables and GPU sessions",
    **{("kernels.triton.atomic_kernels", "kernels.triton.flash_kernels", name):
       "a jit helper's name is part of every kernel's cache key (aot_keys.kernel_source_hash): renaming it "
       "recompiles every recorded kernel" for name in ("_dot", "_load_mask_tile", "_probs_t", "_query_tile",
                                                       "_query_tile_bounds", "_score_grad", "_tile_descriptors")},
    **{("kernels.triton.dq_kernels", "kernels.triton.flash_kernels", name):
       "a jit helper's name is part of every kernel's cache key (aot_keys.kernel_source_hash): renaming it "
       "recompiles every recorded kernel" for name in ("_dot", "_key_tile_bounds", "_key_tile_offsets",
                                                       "_load_mask_tile", "_score_grad", "_scores",
                                                       "_tile_descriptors")},
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path) -> str:
    """``kernels/triton/decode.py`` -> ``kernels.triton.decode``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_of(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The module an import reads from, relative to the package (None: outside it)."""
    if node.level == 0:
        top, _, rest = (node.module or "").partition(".")
        return rest if top == "diffattn_tutorial" else None
    base = module.split(".") if module else []
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def class_members(tree: ast.Module) -> set[str]:
    """Private names a class of this module defines: methods, class attributes and ``self._x = ...``."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(item.name)
            elif isinstance(item, ast.Assign):
                names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)
        names.update(n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")
    return {n for n in names if private(n)}


def uses(module: str, tree: ast.Module, is_package: bool, modules: set[str], members: dict[str, set[str]]):
    """Yield ``(owner, name)`` for each private name of another package module that ``module`` uses."""
    aliases = {}  # local name -> package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (src := source_of(node, module, is_package)) is not None:
            for a in node.names:
                full = f"{src}.{a.name}".strip(".")
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif private(a.name) and src != module:
                    yield src, a.name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("diffattn_tutorial."):
                    aliases[a.asname] = a.name.partition(".")[2]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)):
            continue
        owner = aliases.get(node.value.id)
        if owner is not None and owner != module:
            yield owner, node.attr
        elif owner is None and node.value.id not in ("self", "cls") and node.attr in members \
                and module not in members[node.attr]:
            yield from ((o, node.attr) for o in sorted(members[node.attr]))


def private_uses() -> dict[tuple[str, str, str], int]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in files.items()}
    members: dict[str, set[str]] = {}
    for m, tree in trees.items():
        for name in class_members(tree):
            members.setdefault(name, set()).add(m)
    found: dict[tuple[str, str, str], int] = {}
    for m, tree in trees.items():
        for owner, name in uses(m, tree, files[m].name == "__init__.py", set(files), members):
            found[(m, owner, name)] = found.get((m, owner, name), 0) + 1
    return found


def test_no_private_name_is_used_outside_its_module():
    found = private_uses()
    new = sorted(key for key in found if key not in ALLOWED)
    assert not new, ("private names used outside their module (give the interface a public name, or add it to "
                     "ALLOWED with the reason it stays):\n  " + "\n  ".join(f"{u} uses {o}.{n}" for u, o, n in new))


def test_the_allowlist_has_no_stale_entries():
    found = private_uses()
    stale = sorted(key for key in ALLOWED if key not in found)
    assert not stale, f"ALLOWED names uses that are gone; remove them: {stale}"


def test_the_scan_finds_each_kind_of_use(tmp_path):
    """The three kinds of use, in a made-up pair of modules (a scan that finds nothing would pass the test above)."""
    owner = ast.parse("def _helper(): pass\nclass Layer:\n    def _project(self): pass\n")
    user = ast.parse("from diffattn_tutorial.owner import _helper\nfrom diffattn_tutorial import owner\n"
                     "owner._helper()\nlayer = Layer()\nlayer._project()\nself._project()\nowner.__name__\n")
    members = {n: {"owner"} for n in class_members(owner)}
    assert sorted(uses("user", user, False, {"owner", "user"}, members)) == [
        ("owner", "_helper"), ("owner", "_helper"), ("owner", "_project")]
