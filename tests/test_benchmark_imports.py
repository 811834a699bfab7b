"""Scripts run as `python benchmarks/NAME.py` (`./dev bench NAME`) have their own folder first
on sys.path, so a file there named like an installed package hides that package from every
library the script imports (a `benchmarks/kernels.py` once hid the `kernels` package that
transformers 5.x imports). Each benchmark is imported here the way `./dev bench` runs it."""
from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("benchmarks", "examples")


def _scripts(folder: str) -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / folder).glob("*.py"))


def test_no_script_shadows_an_installed_or_standard_module():
    """No module under benchmarks/ or examples/ takes the top-level name of an installed
    distribution's package, or of a standard-library module."""
    installed = set(importlib.metadata.packages_distributions())
    taken = installed | set(sys.stdlib_module_names)
    clashes = {f"{d}/{p.name}": ("stdlib" if p.stem in sys.stdlib_module_names
                                 else importlib.metadata.packages_distributions()[p.stem])
               for d in SCRIPT_DIRS for p in _scripts(d) if p.stem in taken}
    assert not clashes, f"these scripts hide installed modules when run from their folder: {clashes}"


def _import_as_dev_bench(folder: pathlib.Path, body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(folder)!r})     # what `python {folder.name}/NAME.py` does
        """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=300, env=_env())


def _env() -> dict:
    import os
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)             # as from a plain shell (dsfn is installed editable)
    env["PYTHONPATH"] = str(ROOT)           # ...or from this checkout
    return env


def test_every_benchmark_imports_and_a_transformers_model_runs_from_its_folder():
    """Every benchmark module imports with benchmarks/ first on sys.path, and from that path
    `import transformers` and a tiny Llama forward (which imports transformers' kernel hub) work."""
    pytest.importorskip("transformers")
    names = [p.stem for p in _scripts("benchmarks")]
    r = _import_as_dev_bench(ROOT / "benchmarks", f"""
        import importlib, torch
        import transformers
        from dsfn.testing.models import make_tiny_causal_lm
        m = make_tiny_causal_lm("llama")
        out = m(input_ids=torch.randint(0, 101, (1, 8)))
        assert out.logits.shape == (1, 8, 101)
        bad = {{}}
        for name in {names!r}:
            try:
                importlib.import_module(name)
            except Exception as e:   # report every one, not the first
                bad[name] = f"{{type(e).__name__}}: {{e}}"
        print("BAD", bad)
        sys.exit(1 if bad else 0)
        """)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_every_example_imports_from_its_folder():
    names = [p.stem for p in _scripts("examples")]
    r = _import_as_dev_bench(ROOT / "examples", f"""
        import importlib
        for name in {names!r}:
            importlib.import_module(name)
        """)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
