"""The architecture's figures, read from the source (issue 39's table):

    python benchmarks/architecture.py

- module-hook mechanisms: the modules of dsfn that hook a module's forward (register a
  forward (pre-)hook, global or per module, or assign a module's `forward`), one per file;
- engine methods taking `call_next`: functions under dsfn/engines/ with a parameter of that
  name (an engine then runs a handler's continuation);
- pipeline names in ZeRO's engine files: lines of dsfn/engines/zero*.py (or engines/zero/)
  naming the pipeline (pipelin*, stage_cop*, micro_batch*, BackwardRounds, own_recomputes);
- estimate.py's lines, and the transforms it finds by name (`.name ==` / `name in`
  comparisons against a transform's name string);
- functions over 80 lines and files over 450 lines in dsfn/;
- folder-level import loops (each subpackage of dsfn, and each top-level module, a node).

Each figure is a count over the source tree this script sits in; nothing is run.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dsfn"
HOOKS = re.compile(r"register_forward_pre_hook|register_forward_hook|register_module_forward_pre_hook|"
                   r"register_module_forward_hook|\.forward\s*=[^=]")
PIPELINE_WORDS = re.compile(r"pipelin|stage_cop|micro_batch|BackwardRounds|own_recomputes|StageOwned")


def sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def hook_mechanisms() -> list[str]:
    """Files (outside the ops' tiled compute, which swaps a forward for its own tiles inside
    one call) that hook or swap a module's forward."""
    return [str(p.relative_to(ROOT)) for p in sources() if HOOKS.search(p.read_text())]


def call_next_engine_methods() -> list[str]:
    out = []
    for p in sources():
        if "engines" not in p.relative_to(PKG).parts:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if "call_next" in names:
                    out.append(f"{p.relative_to(ROOT)}:{node.name}")
    return out


def zero_pipeline_lines() -> int:
    files = [p for p in sources() if "engines" in p.parts and (p.name.startswith("zero") or "zero" in p.parent.name)]
    return sum(1 for p in files for line in p.read_text().splitlines() if PIPELINE_WORDS.search(line))


def estimate_figures() -> tuple[int, int]:
    p = PKG / "estimate.py"
    text = p.read_text()
    by_name = set(re.findall(r"""\.name\s*(?:==|in)\s*\(?\s*["']([a-z_]+)["']""", text))
    by_name |= set(re.findall(r"""["']([a-z_]+)["']\s*(?:==|in)\s*[a-z_.]*\.name""", text))
    by_name |= set(re.findall(r"""_find\([^,]+,\s*["']([a-z_]+)["']""", text))
    return len(text.splitlines()), len(by_name)


def long_functions(limit: int = 80) -> list[str]:
    out = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{p.relative_to(ROOT)}:{node.name} ({n})")
    return out


def long_files(limit: int = 450) -> list[str]:
    return [f"{p.relative_to(ROOT)} ({n})" for p in sources() if (n := len(p.read_text().splitlines())) > limit]


def folder_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(p: Path) -> str:
    rel = p.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for p in sources():
        mod = module_name(p)
        node = folder_of(mod)
        graph.setdefault(node, set())
        package = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        for n in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in n.names]
            for t in targets:
                if t.startswith("dsfn.") and (ROOT / (t.replace(".", "/") + ".py")).exists() or \
                        t.startswith("dsfn.") and (ROOT / t.replace(".", "/") / "__init__.py").exists():
                    other = folder_of(t)
                    if other != node and other != "dsfn":
                        graph[node].add(other)
    return graph


def folder_cycles() -> list[list[str]]:
    """The strongly connected components of the folder graph with more than one node."""
    graph = folder_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    hooks = hook_mechanisms()
    calls = call_next_engine_methods()
    est_lines, est_names = estimate_figures()
    funcs, files = long_functions(), long_files()
    cycles = folder_cycles()
    print(f"module-hook mechanisms (files hooking or swapping a forward): {len(hooks)}")
    for h in hooks:
        print(f"    {h}")
    print(f"engine methods taking call_next: {len(calls)}")
    for c in calls:
        print(f"    {c}")
    print(f"pipeline names in ZeRO's engine files: {zero_pipeline_lines()} lines")
    print(f"estimate.py: {est_lines} lines, {est_names} transforms found by name")
    print(f"functions > 80 lines: {len(funcs)}; files > 450 lines: {len(files)}")
    for f in funcs + files:
        print(f"    {f}")
    print(f"folder-level import loops (strongly connected groups): {len(cycles)}")
    for c in cycles:
        print(f"    {' <-> '.join(c)}")


if __name__ == "__main__":
    main()
