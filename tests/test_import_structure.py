"""Layering: optimizers never reach the runtime or the transforms; transform modules import
each other without circles (shared pieces live in lower modules). Read from the source
(every `import`, function-level ones included), so a lazy import cannot hide a circle."""
from __future__ import annotations

import ast
import pathlib

import dsfn

ROOT = pathlib.Path(dsfn.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """Modules `path` imports at run time (blocks under `if TYPE_CHECKING:` never run)."""
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _modules(pkg: str) -> dict[str, set[str]]:
    return {f"dsfn.{pkg}.{p.stem}": _imports(p) for p in sorted((ROOT / pkg).glob("*.py")) if p.stem != "__init__"}


def test_optimizers_import_nothing_from_runtime_or_transforms():
    bad = {m: sorted(i for i in imps if i.startswith(("dsfn.runtime", "dsfn.transforms")))
           for m, imps in _modules("optim").items()}
    assert not {m: v for m, v in bad.items() if v}, bad


def test_transform_modules_import_each_other_without_circles():
    mods = _modules("transforms")
    graph = {m: {i for i in imps if i in mods and i != m} for m, imps in mods.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle.extend(path[path.index(n):] + [m, n] if n in path else [m, n])
                return True
            if n not in state and visit(n, path + [m]):
                return True
        state[m] = 2
        return False
    for m in sorted(graph):
        if m not in state and visit(m, []):
            break
    assert not cycle, f"import circle among transform modules: {' -> '.join(cycle)}"


def test_the_effects_mechanism_is_the_bottom_layer():
    imps = _imports(ROOT / "effects.py")
    assert not [i for i in imps if i.startswith("dsfn")], imps
