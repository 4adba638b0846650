"""The package's modules import each other in one direction: no cycles among any imports,
those under TYPE_CHECKING and inside functions included; every module says what it holds in
its first line; the examples use only the public API (``bagualu.<name>`` of ``__all__``)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

from conftest import ROOT

PKG = ROOT / "integrations" / "pytorch" / "bagualu"
EXAMPLES = ROOT / "integrations" / "pytorch" / "examples"


def module_name(path: Path, root: Path = PKG) -> str:
    """'capture.tracker' for capture/tracker.py, 'capture' for capture/__init__.py."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


ROOT_MODULE = "bagualu"  # the package's __init__ in the graph


def imports(path: Path, mods: Set[str], root: Path = PKG) -> Set[str]:
    """The package's modules ``path`` imports anywhere in it: relative imports (``from . import
    x`` names module x when x is one), absolute ones (``import bagualu``, ``from bagualu.x import
    y``) and those inside functions; the package's __init__ is ROOT_MODULE."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = root.name  # the package's own name, as absolute imports spell it
    out: Set[str] = set()

    def add(target: str, names: List[str]) -> None:
        for n in names:
            sub = f"{target}.{n}" if target else n
            if sub in mods:
                out.add(sub)
                continue
            out.add(target if target in mods else ROOT_MODULE)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == top or a.name.startswith(top + "."):
                    target = a.name[len(top) + 1:]
                    out.add(target if target in mods else ROOT_MODULE)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            module = node.module or ""
            if module == top or module.startswith(top + "."):
                add(module[len(top) + 1:], [a.name for a in node.names])
            continue
        base = package.split(".") if package else []
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        target = ".".join(base + ([node.module] if node.module else []))
        add(target, [a.name for a in node.names])
    return out


def graph(root: Path = PKG) -> Dict[str, Set[str]]:
    files = {module_name(p, root) or ROOT_MODULE: p for p in root.rglob("*.py")}
    mods = set(files) - {ROOT_MODULE}
    return {m: {n for n in imports(p, mods, root) if n != m} for m, p in files.items()}


def find_cycle(g: Dict[str, Set[str]]) -> List[str]:
    """One cycle of ``g`` (its modules in order, the first repeated at the end), or []."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def dfs(m: str) -> List[str]:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = dfs(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(g):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return []


def test_no_import_cycles() -> None:
    g = graph()
    assert len(g) > 20, g
    assert "capture.tracker" in g and "record" in g["capture.tracker"]
    assert {"api", "loops.pipelining"} <= g[ROOT_MODULE]  # the facade is in the graph
    assert find_cycle(g) == [], "import cycle: " + " -> ".join(find_cycle(g))
    importers = sorted(m for m, deps in g.items() if ROOT_MODULE in deps)
    assert importers == [], f"{importers} import the package's facade (import its api instead)"


def test_the_check_sees_a_cycle(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("from .sub import b\n")
    (tmp_path / "sub" / "__init__.py").write_text('"""sub"""\n')
    (tmp_path / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n")
    g = graph(tmp_path)
    assert g["a"] == {"sub.b"} and g["sub.b"] == {"a"}
    assert find_cycle(g) == ["a", "sub.b", "a"]
    (tmp_path / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    assert find_cycle(graph(tmp_path)) == ["a", "sub.b", "a"]
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    assert find_cycle(graph(tmp_path)) == []
    # Absolute imports of the package and its root, inside functions too (the circle between
    # loops/ and __init__ that relative imports alone could not show).
    top = tmp_path.name
    (tmp_path / "__init__.py").write_text("from . import a\n")
    (tmp_path / "sub" / "b.py").write_text(f"def f():\n    import {top}\n")
    (tmp_path / "a.py").write_text("from .sub import b\n")
    g = graph(tmp_path)
    assert g["sub.b"] == {ROOT_MODULE}
    assert find_cycle(g) == ["a", "sub.b", ROOT_MODULE, "a"]
    (tmp_path / "sub" / "b.py").write_text(f"from {top}.a import x\n")
    assert find_cycle(graph(tmp_path)) == ["a", "sub.b", "a"]


def test_every_module_says_what_it_holds() -> None:
    for p in sorted(PKG.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, f"{p.relative_to(PKG)}: no docstring"


def test_examples_use_only_the_public_api() -> None:
    import bagualu
    public = set(bagualu.__all__)
    for p in sorted(EXAMPLES.glob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.startswith("bagualu"):
                assert node.module == "bagualu" and all(a.name in public for a in node.names), \
                    f"{p.name}:{node.lineno}: from {node.module} import ..."
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name == "bagualu" or not a.name.startswith("bagualu"), \
                        f"{p.name}:{node.lineno}: import {a.name}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "bagualu":
                assert node.attr in public, f"{p.name}:{node.lineno}: bagualu.{node.attr}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) and \
                    isinstance(node.value.func, ast.Attribute) and \
                    node.value.func.attr == "current":
                raise AssertionError(f"{p.name}:{node.lineno}: bagualu.current().{node.attr}")


def test_no_class_holds_too_much() -> None:
    """One concern per class (issue 40): no class of the package over about 300 lines or 25
    methods; a class that grows past it splits off a concern (as Runtime's describe.py and
    AutoLayers' stash_notes.py did)."""
    big = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                          for b in node.body)
            if lines > 320 or methods > 25:
                big.append(f"{path.relative_to(PKG)}:{node.name} ({lines} lines, {methods} "
                           "methods)")
    assert not big, big
