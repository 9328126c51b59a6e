"""The import graph: no circles, the library never imports the plugins, the shipped packages never
import the lab (tools/), the plugins use the library's public API only, no private names across modules.

Imports are read with `ast` (module level and inside functions alike), so an
in-function import that hides a circle from Python's loader still counts.
An edge goes to the module an import names: ``from recloss import sweep``
is an edge to ``recloss.sweep``; ``from recloss.sweep import cast_grads`` too.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.tier1

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("recloss", "recloss_plugins", "tools")
SHIPPED = ("recloss", "recloss_plugins")      # the wheel's packages; tools/ is the repository's lab


def _modules():
    """{dotted name: path} of every module of our packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path):
    """[(imported module, imported names or None, line)] of our packages' modules that ``name`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:
                    found.append((sub, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return found


GRAPH = {name: sorted({m for m, _, _ in _imports(name, path) if m in MODULES and m != name})
         for name, path in MODULES.items()}


def _reachable(start: str) -> set:
    seen, stack = set(), list(GRAPH[start])
    while stack:
        m = stack.pop()
        if m not in seen:
            seen.add(m)
            stack.extend(GRAPH[m])
    return seen


def test_the_walk_sees_the_modules_and_their_imports():
    # A walk that found nothing would pass every check below.
    assert {"recloss.api", "recloss.sweep", "recloss.bce.cut", "recloss_plugins.flax.nnx"} <= set(MODULES)
    assert "recloss.sweep" in GRAPH["recloss.bce.cut"]
    assert "recloss.bce.bernoulli" in _reachable("recloss.api")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_one_that_imports_it(name):
    back = sorted(m for m in GRAPH[name] if name in _reachable(m) or m == name)
    assert not back, f"{name} imports {back}, which import {name} back (directly or through others)"


def test_the_library_never_imports_the_plugins():
    bad = [(name, m, line) for name, path in MODULES.items() if name.split(".")[0] == "recloss"
           for m, _, line in _imports(name, path) if m.split(".")[0] == "recloss_plugins"]
    assert not bad, bad


def test_the_shipped_packages_never_import_the_lab():
    bad = [(name, m, line) for name, path in MODULES.items() if name.split(".")[0] in SHIPPED
           for m, _, line in _imports(name, path) if m.split(".")[0] == "tools"]
    assert not bad, bad


def _library_public():
    """(names, modules) the plugins may import from the library: the names of `recloss.__all__`, and
    the modules the API reference documents whole (``.. automodule::`` in docs/api.md)."""
    import recloss
    modules = set(re.findall(r"^\.\. automodule:: (recloss(?:\.\w+)*)\s*$", (ROOT / "docs" / "api.md").read_text(),
                             re.M))
    return set(recloss.__all__), modules


def test_the_plugins_import_only_the_librarys_public_api():
    names, modules = _library_public()
    assert "bce_loss" in names and "recloss.aot" in modules      # the reading found the API
    bad = []
    for name, path in MODULES.items():
        if name.split(".")[0] != "recloss_plugins":
            continue
        for mod, attr, line in _imports(name, path):
            if mod.split(".")[0] != "recloss":
                continue
            public = (mod == "recloss" and (attr is None or attr in names)) or mod in modules
            if not public:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}{'.' + attr if attr else ''}")
    assert not bad, ("plugins may import recloss, the names of recloss.__all__ and the modules docs/api.md "
                     "documents (automodule); add what they truly need there:\n" + "\n".join(bad))


def test_no_private_module_or_name_is_used_across_packages():
    """Plugins use the library's public surface only; a plugin package never reaches into another's
    private modules or names (within one package, its own private helpers are fine)."""
    def package(mod: str) -> str:
        parts = mod.split(".")
        return ".".join(parts[:2]) if parts[0] == "recloss_plugins" else parts[0]

    bad = []
    for name, path in MODULES.items():
        for mod, attr, line in _imports(name, path):
            if package(mod) == package(name):
                continue
            private_mod = any(p.startswith("_") and p != "__init__" for p in mod.split("."))
            if private_mod or (attr or "").startswith("_"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}{'.' + attr if attr else ''}")
    assert not bad, bad


def test_package_init_files_hold_no_logic():
    """An __init__.py holds a docstring, imports and __all__ (plus `__version__`): no functions, classes or calls."""
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            ok = isinstance(node, (ast.Import, ast.ImportFrom)) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) or (
                isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id in ("__all__", "__version__")
                                                     for t in node.targets))
            assert ok, f"{path.relative_to(ROOT)}:{node.lineno} holds logic ({type(node).__name__})"
