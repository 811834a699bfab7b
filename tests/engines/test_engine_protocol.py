"""Engines are lifecycle objects with verbs: none takes a handler's continuation.

A transform's handler is the only place `call_next` runs (docs/architecture.md, rule 2);
an engine method that took it would be a second handler, ordered by whoever calls it
rather than by the stack. Read from the source, as tests/test_import_structure.py does.
"""
import ast
from pathlib import Path

ENGINES = Path(__file__).resolve().parents[2] / "dsfn" / "engines"


def _functions_taking_call_next(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            if "call_next" in names:
                out.append(node.name)
    return out


def test_no_engine_method_takes_call_next():
    found = {str(p.relative_to(ENGINES)): _functions_taking_call_next(ast.parse(p.read_text()))
             for p in sorted(ENGINES.rglob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"engine functions taking call_next (make them verbs the handler calls): {found}"


def test_the_check_sees_a_method_taking_call_next():
    src = "class E:\n    def value_and_grad(self, call_next, fn):\n        return call_next(fn)\n"
    assert _functions_taking_call_next(ast.parse(src)) == ["value_and_grad"]
