"""The package's modules import each other in one direction: no cycles among the imports
that run at import time (imports inside functions and under TYPE_CHECKING are deferred and
do not count)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

from conftest import ROOT

PKG = ROOT / "integrations" / "pytorch" / "bagualu"


def _eager_imports(path: Path) -> Set[str]:
    """Sibling modules that ``path`` imports when it is imported."""
    out: Set[str] = set()

    def visit(nodes: List[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)

    visit(ast.parse(path.read_text()).body)
    return out


def graph() -> Dict[str, Set[str]]:
    mods = {p.stem: p for p in PKG.glob("*.py")}
    return {name: {m for m in _eager_imports(p) if m in mods and m != name}
            for name, p in mods.items() if name != "__init__"}


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
    assert len(g) > 10, g
    assert find_cycle(g) == [], "import cycle: " + " -> ".join(find_cycle(g))


def test_the_check_sees_a_cycle(tmp_path) -> None:
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("from .a import x\nif TYPE_CHECKING:\n    from .c import y\n")
    g = {"a": _eager_imports(tmp_path / "a.py"), "b": _eager_imports(tmp_path / "b.py")}
    assert g == {"a": {"b"}, "b": {"a"}}
    assert find_cycle(g) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []
