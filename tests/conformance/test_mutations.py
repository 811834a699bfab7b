"""Mutation checks (`-m slow`): each injected bug fails the rows it affects and the default selection.

For every mutation of `conformance.mutations` (monkeypatched, nothing written to the
library; rank processes install it from DSFN_MUTATION):
- every row of `mutations.rows(name)` (each affected stack with SGD-momentum, AdamW and
  Muon, at the world where each of its axes is 2) fails its comparison with an
  AssertionError — not a crash;
- the default selection fails: `pytest tests/conformance` or the feature's own test file,
  run as a subprocess with the mutation (`-x`: the first failure is enough).
`benchmarks/mutations.py` prints the same as a table; tests/conformance/README.md records it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import conformance as K
from conformance import mutations as M

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", list(M.MUTATIONS))
def test_every_affected_row_fails(name, tmp_path):
    rows = M.rows(name)
    assert rows, f"{name}: no matrix row is affected"
    missed = []
    with M.active(name):
        for i, case in enumerate(rows):
            try:
                K.run_case(case, str(tmp_path / str(i)))
                missed.append(case.id)
            except AssertionError:
                pass
    assert not missed, f"{name} ({M.MUTATIONS[name].bug}) passed rows it affects: {missed}"


@pytest.mark.parametrize("name", list(M.MUTATIONS))
def test_the_default_selection_fails(name):
    env = {**os.environ, M.ENV: name, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/conformance",
                          *M.MUTATIONS[name].owner], cwd=str(ROOT), env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 1 and " failed" in out.stdout, \
        f"{name}: the default selection did not fail (exit {out.returncode}):\n{out.stdout[-3000:]}"

