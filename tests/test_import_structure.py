"""The floors and their rules, read from the source.

Every `import` counts: function-level ones and those under `if TYPE_CHECKING:` too, so a
lazy or type-only import cannot hide a circle. The rules (docs/architecture.md):

- no import circles anywhere in dsfn (module level; a package's `__init__` aside);
- engines (machinery) import no transform (policy);
- a transform module imports no other transform module but the mechanism's own
  (`core`, `compose`, `facts`): transforms meet through primitives and stack facts;
- no transform imports an integration, and no integration a transform (model rules are
  reached through `dsfn.adapters`);
- optimizers import neither the runtime, the transforms nor the state floor;
- the state floor imports no transform;
- the effects mechanism is the bottom layer (imports nothing of dsfn), and the identity
  cache imports nothing of dsfn but `dsfn.errors`;
- the shipped rank runner (`dsfn.testing.ranks`) does not import the mutation tooling;
- a leading underscore means "this module only": no dsfn-private name is imported across
  modules.

Each rule is checked on the whole package; `test_the_checks_see_what_they_forbid` shows
each check fails on a graph that breaks it (the negative controls).
"""
from __future__ import annotations

import ast
import pathlib

import dsfn

ROOT = pathlib.Path(dsfn.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: pathlib.Path, name: str | None = None) -> list[tuple[str, str]]:
    """(module, name) pairs `path` (module `name`) imports: `from m import n` gives (m, n) —
    or (m.n, "") when m.n is a module —, `import m` gives (m, "")."""
    name = name or _module_name(path)
    pkg = name if path.stem == "__init__" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full, "") if full in MODULES else (base, a.name))
        elif isinstance(node, ast.Import):
            out.extend((a.name, "") for a in node.names)
    return out


def graph() -> dict[str, set[str]]:
    """module -> the dsfn modules it imports (package `__init__`s aside: they re-export)."""
    out = {}
    for m, p in MODULES.items():
        if p.stem == "__init__":
            continue
        out[m] = {i for i, _ in _imports(p) if i in MODULES and i != m and MODULES[i].stem != "__init__"}
    return out


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def crossings(g: dict[str, set[str]], src: str, dst: str) -> list[tuple[str, str]]:
    """Imports from modules under `src` into modules under `dst` (dotted prefixes)."""
    under = lambda m, p: m == p or m.startswith(p + ".")
    return sorted((m, i) for m, imps in g.items() if under(m, src) for i in imps if under(i, dst))


def private_imports(modules: dict[str, pathlib.Path] = MODULES) -> list[str]:
    """`from dsfn.x import _name` of a dsfn-private name, across modules."""
    out = []
    for m, p in modules.items():
        for mod, name in _imports(p, m):
            if mod.startswith("dsfn") and name.startswith("_") and not name.startswith("__"):
                out.append(f"{m}: from {mod} import {name}")
    return out


def test_no_import_circles():
    assert circles(graph()) == []


MECHANISM = {"dsfn.transforms.core", "dsfn.transforms.compose", "dsfn.transforms.facts"}


def test_engines_import_no_transform():
    assert crossings(graph(), "dsfn.engines", "dsfn.transforms") == []


def test_transforms_import_only_the_mechanism_of_each_other():
    bad = [(m, i) for m, i in crossings(graph(), "dsfn.transforms", "dsfn.transforms")
           if i not in MECHANISM and m not in MECHANISM]
    assert bad == []


def test_transforms_and_integrations_do_not_import_each_other():
    g = graph()
    assert crossings(g, "dsfn.transforms", "dsfn.integrations") + crossings(g, "dsfn.integrations",
                                                                             "dsfn.transforms") == []


def test_optimizers_import_nothing_from_runtime_transforms_or_state():
    g = graph()
    bad = [x for dst in ("dsfn.runtime", "dsfn.transforms", "dsfn.state") for x in crossings(g, "dsfn.optim", dst)]
    assert not bad, bad


def test_the_state_floor_imports_no_transform():
    assert crossings(graph(), "dsfn.state", "dsfn.transforms") == []


def test_the_effects_mechanism_is_the_bottom_layer():
    assert [i for i, _ in _imports(ROOT / "effects.py") if i.startswith("dsfn")] == []


def test_the_identity_cache_is_mechanism():
    """dsfn.identity_cache (the caches of per-structure work) sits on the mechanism floor:
    it imports nothing of dsfn but its errors."""
    assert [i for i, _ in _imports(ROOT / "identity_cache.py") if i.startswith("dsfn") and i != "dsfn.errors"] == []


def test_the_rank_runner_does_not_import_the_mutation_tooling():
    assert crossings(graph(), "dsfn.testing.ranks", "dsfn.testing.mutations") == []


def test_no_private_name_is_imported_across_modules():
    assert private_imports() == []


def test_the_checks_see_what_they_forbid(tmp_path):
    """Negative controls: each check, on a graph (or source) that breaks its rule, reports it."""
    g = graph()
    made = circles({**g, "dsfn.runtime.env": g["dsfn.runtime.env"] | {"dsfn.runtime.mesh"}})
    assert any({"dsfn.runtime.env", "dsfn.runtime.mesh"} <= set(c) for c in made), made
    assert crossings({"dsfn.optim.base": {"dsfn.state.donation"}}, "dsfn.optim", "dsfn.state") == \
        [("dsfn.optim.base", "dsfn.state.donation")]
    lazy = tmp_path / "lazy.py"          # a function-level, TYPE_CHECKING-guarded private import
    lazy.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dsfn.optim.masks import _x\n"
                    "def f():\n    from dsfn.runtime.mesh import _current\n")
    assert private_imports({"dsfn.lazy": lazy}) == ["dsfn.lazy: from dsfn.optim.masks import _x",
                                                    "dsfn.lazy: from dsfn.runtime.mesh import _current"]
