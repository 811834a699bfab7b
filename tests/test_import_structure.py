"""The floors and their rules, read from the source.

Every `import` counts: function-level ones and those under `if TYPE_CHECKING:` too, so a
lazy or type-only import cannot hide a circle. The rules (docs/architecture.md):

- no import circles anywhere in dsfn (module level; a package's `__init__` aside);
- no import loops between folders: each subpackage of dsfn (state, checkpoint, ops, ...) and
  each top-level module (`dsfn/logical.py`, ...) is one node, and the graph of what imports
  what among them (package `__init__`s included) has no cycle;
- engines (machinery) import no transform (policy);
- a transform module imports no other transform module but the mechanism's own
  (`core`, `compose`, `facts`): transforms meet through primitives and stack facts;
- no transform imports an integration, and no integration a transform (model rules are
  reached through `dsfn.adapters`);
- optimizers import neither the runtime, the transforms nor the state floor;
- the state floor imports no transform;
- the effects mechanism is the bottom layer (imports nothing of dsfn), and the identity
  cache imports nothing of dsfn but `dsfn.errors`;
- dsfn imports nothing of the repository's test machinery (the top-level `conformance`
  package: the matrix and the mutations); the shipped rank runner (`dsfn.testing.ranks`)
  knows the mutations only as an `at_rank_start` hook they register;
- a leading underscore means "this module only": no dsfn-private name is imported across
  modules, nor read as an attribute of another dsfn module (`reader._helper(...)`, where
  `reader` names an imported dsfn module);
- `Transform` declares every hook a Step and the stack facts call (`compose.HOOKS`), and
  compose, facts and core call them directly (no `getattr(t, "hook", default)` probing).

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


def _module_of(imported: str) -> str | None:
    """The dsfn module an imported dotted name lives in (the longest known prefix)."""
    m = imported
    while m not in MODULES and "." in m:
        m = m.rpartition(".")[0]
    return m if m in MODULES else None


def folder_of(module: str) -> str:
    """A module's node in the folder graph: its subpackage of dsfn (`dsfn.state`), or the
    top-level module itself (`dsfn.logical`; `dsfn` for the package's own `__init__`)."""
    return ".".join(module.split(".")[:2])


def folder_graph(modules: dict[str, pathlib.Path] = MODULES) -> dict[tuple[str, str], list[str]]:
    """(folder A, folder B) -> the imports behind that edge ("module imports name"), for every
    import in the source (function-level and TYPE_CHECKING ones too, `__init__`s included)."""
    out: dict[tuple[str, str], list[str]] = {}
    for m, p in modules.items():
        for mod, name in _imports(p, m):
            if mod != "dsfn" and not mod.startswith("dsfn."):
                continue
            target = _module_of(mod) or mod
            a, b = folder_of(m), folder_of(target)
            if a != b:
                out.setdefault((a, b), []).append(f"{m} imports {mod}{'.' + name if name else ''}")
    return out


def folder_cycles(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """Each folder-level import loop (one per strongly connected component of the folder
    graph): one cycle through it, then every import between its folders."""
    g: dict[str, set[str]] = {}
    for a, b in edges:
        g.setdefault(a, set()).add(b)
    out = []
    for comp in circles(g):
        inside = set(comp)
        start = comp[0]
        # the shortest way back to `start` inside the component (breadth first)
        prev, frontier, back = {start: None}, [start], None
        while frontier and back is None:
            nxt = []
            for v in frontier:
                for w in sorted(g[v] & inside):
                    if w == start:
                        back = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if back is not None:
                    break
            frontier = nxt
        path = [back]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path = path[::-1] + [start]
        inner = sorted((a, b) for a, b in edges if a in inside and b in inside)
        hops = [f"  {a} -> {b}: " + "; ".join(edges[(a, b)][:3]) + (" ..." if len(edges[(a, b)]) > 3 else "")
                for a, b in inner]
        out.append(" -> ".join(path) + " (the loop's folders: " + ", ".join(comp) + "; the imports between them:)\n"
                   + "\n".join(hops))
    return out


def private_attributes(modules: dict[str, pathlib.Path] = MODULES) -> list[str]:
    """`module._name` where `module` is a name bound to another imported dsfn module
    (`from dsfn.checkpoint import reader` ... `reader._assemble`; `import dsfn.x as x`;
    dotted chains such as `dsfn.ops.cpu_adam._SOURCE`), anywhere in the source."""
    out = []
    for m, p in modules.items():
        pkg = m if p.stem == "__init__" else m.rpartition(".")[0]
        source = ast.parse(p.read_text())
        bound: dict[str, str] = {}
        for node in ast.walk(source):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    if f"{base}.{a.name}" in MODULES:
                        bound[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES:
                        bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

        def module_named(n: ast.expr) -> str | None:
            if isinstance(n, ast.Name):
                return bound.get(n.id)
            if isinstance(n, ast.Attribute):
                base = module_named(n.value)
                return f"{base}.{n.attr}" if base and f"{base}.{n.attr}" in MODULES else None
            return None
        for node in ast.walk(source):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                mod = module_named(node.value)
                if mod is not None and mod != m:
                    out.append(f"{m}:{node.lineno}: {mod}.{node.attr}")
    return sorted(out)


def test_no_import_circles():
    assert circles(graph()) == []


def test_no_import_loops_between_folders():
    loops = folder_cycles(folder_graph())
    assert not loops, "import loops between folders:\n" + "\n".join(loops)


# sequence_split: the machinery sequence_parallel and context_parallel share (a base class, no policy)
MECHANISM = {"dsfn.transforms.core", "dsfn.transforms.compose", "dsfn.transforms.facts",
             "dsfn.transforms.sequence_split"}


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


TOOLING = "conformance"        # the repository's test machinery (conformance/), not installed with dsfn


def tooling_imports(modules: dict[str, pathlib.Path] = MODULES) -> list[str]:
    """Every import of the `conformance` package (or a module of it) by a dsfn module
    ("module imports name"), function-level and TYPE_CHECKING ones too."""
    return sorted(f"{m} imports {mod}{'.' + name if name else ''}" for m, p in modules.items()
                  for mod, name in _imports(p, m) if mod == TOOLING or mod.startswith(TOOLING + "."))


def test_dsfn_imports_nothing_of_the_conformance_tooling():
    """The rank runner (`dsfn.testing.ranks`) and the rest of dsfn import neither the matrix
    nor the mutations (which reach the ranks through `at_rank_start`), and neither lives in dsfn."""
    assert tooling_imports() == []
    assert not [m for m in MODULES if m.rpartition(".")[2] in ("conformance", "mutations")]


def test_no_private_name_is_imported_across_modules():
    assert private_imports() == []


def test_no_private_attribute_of_another_module_is_read():
    assert private_attributes() == []


HOOK_CALLERS = ("transforms/compose.py", "transforms/facts.py", "transforms/core.py", "state/init.py")


def hooks_called(path: pathlib.Path) -> tuple[set[str], list[str]]:
    """What `path` reads off the transforms of a stack: the attributes of each loop variable
    over something named `...stack...` (`for t in self.stack`, `for i, t in enumerate(stack)`,
    comprehensions too), `handle_<primitive>` and dunders aside; and each `getattr` / `hasattr` probe of
    such a variable for a literal name ("file:line: getattr(t, 'name')")."""
    called, probes = set(), []
    source = ast.parse(path.read_text())

    def names(target: ast.expr) -> set[str]:
        return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    def over_stack(it: ast.expr) -> bool:
        return "stack" in ast.unparse(it)
    scopes = []
    for node in ast.walk(source):
        if isinstance(node, (ast.For, ast.AsyncFor)) and over_stack(node.iter):
            scopes.append((names(node.target), node.body))
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for gen in node.generators:
                if over_stack(gen.iter):
                    scopes.append((names(gen.target), [node]))
    for vars_, body in scopes:
        for stmt in body:
            for n in ast.walk(stmt):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in vars_ \
                        and not n.attr.startswith(("handle_", "__")):
                    called.add(n.attr)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                        and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in vars_ \
                        and len(n.args) > 1 and isinstance(n.args[1], ast.Constant) \
                        and not str(n.args[1].value).startswith(("handle_", "__")):
                    probes.append(f"{path.name}:{n.lineno}: {n.func.id}({n.args[0].id}, {n.args[1].value!r})")
    return called, probes


def test_transform_declares_every_hook_compose_calls():
    from dsfn.transforms.compose import HOOKS
    from dsfn.transforms.core import Transform
    called, probes = set(), []
    for rel in HOOK_CALLERS:
        c, p = hooks_called(ROOT / rel)
        called |= c
        probes += p
    assert {"place", "place_after", "explain_note", "facts", "roles"} <= called, called   # the scan sees them
    assert sorted(h for h in called | set(HOOKS) if not hasattr(Transform, h)) == []
    assert probes == []                      # declared hooks are called, not probed for
    assert called <= set(HOOKS), sorted(called - set(HOOKS))    # is_transform checks them all


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
    # a folder loop made by one function-level back-import (runtime -> state -> runtime)
    back = tmp_path / "back.py"
    back.write_text("def f():\n    from dsfn.state.layout import FlatShard\n")
    loops = folder_cycles(folder_graph({**MODULES, "dsfn.runtime.back": back}))
    assert len(loops) == 1 and loops[0].startswith("dsfn.runtime -> dsfn.state -> dsfn.runtime") \
        and "dsfn.runtime.back imports dsfn.state.layout.FlatShard" in loops[0], loops
    # a private attribute of another module, reached through a bound module and a dotted chain
    peek = tmp_path / "peek.py"
    peek.write_text("import dsfn\nfrom dsfn.checkpoint import writer as W\n"
                    "def f():\n    from dsfn.ops import cpu_adam\n    return W._x, cpu_adam._y, dsfn.runtime.mesh._z\n")
    assert private_attributes({"dsfn.peek": peek}) == ["dsfn.peek:5: dsfn.checkpoint.writer._x",
                                                       "dsfn.peek:5: dsfn.ops.cpu_adam._y",
                                                       "dsfn.peek:5: dsfn.runtime.mesh._z"]
    # the conformance tooling imported by the rank runner (a function-level import)
    runner = tmp_path / "runner.py"
    runner.write_text("import os\ndef f():\n    from conformance import mutations\n    import conformance.matrix\n")
    assert tooling_imports({"dsfn.testing.runner": runner}) == ["dsfn.testing.runner imports conformance.matrix",
                                                                "dsfn.testing.runner imports conformance.mutations"]
    # a hook probed for instead of called
    probe = tmp_path / "probe.py"
    probe.write_text("def f(stack):\n    for t in stack:\n        getattr(t, 'place_later', None)\n"
                     "    return [t.explain_later() for t in stack]\n")
    assert hooks_called(probe) == ({"explain_later"}, ["probe.py:3: getattr(t, 'place_later')"])
