"""benchmarks/gpu_checks.sh --dry-run: the GPU script's CPU-checkable parts run here (its
Python helpers at small sizes / on CPU ranks) and it lists what it would run on CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"


def _run(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": ""}
    env.pop("OUT")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_dry_run_passes_and_lists_the_cuda_sections(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r = _run("--dry-run")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "== dry run: all PASS" in out
    for part in ("dry syntax: PASS", "dry index: PASS", "dry e2e: PASS", "dry nccl: PASS", "dry step: PASS",
                 "dry step2: PASS", "PASS two-rank zero3", "PASS two-rank tp2", "PASS two-rank sp2",
                 "checkpoint reloads bitwise PASS", "zero3 (experts as units)"):
        assert part in out, part
    plan = out.split("== on CUDA it would run")[1].split(":", 1)[1].split("== dry run")[0]
    for name, what in (("ops", "tests/ops"), ("index", "gpu_index_math.py"),
                       ("e2e", "--nproc-per-node 1 benchmarks/gpu_e2e.py"), ("kernels", "ops_kernels.py --cuda-only"),
                       ("nccl", "gpu_nccl_probe.py"), ("step", "--nproc-per-node 1 benchmarks/gpu_step.py"),
                       ("step2", "DSFN_BACKEND=gloo"), ("offload", "benchmarks/offload_gpu.py")):
        assert f"  {name}|" in plan and what in plan, (name, plan)
    caps = {line.split("|")[0].strip(): int(line.split("|")[1]) for line in plan.splitlines() if line.count("|") >= 2}
    assert len(caps) == 10
    # two groups, each one 10-minute command with room to start: the figures (the default) and the checks
    assert sum(caps[k] for k in ("step", "step2", "offload")) <= 540
    assert sum(caps[k] for k in ("e2e", "kernels", "group", "compile", "ops", "index", "nccl")) <= 540
    assert "dry offload: PASS" in out and "dry group: PASS" in out


def test_unknown_argument_is_refused():
    """The control: the script does check what it is given (exit 2, nothing run)."""
    r = _run("--bogus", timeout=30)
    assert r.returncode == 2 and "unknown argument --bogus" in r.stdout
    r = _run("--sections", "step,warp", timeout=30)
    assert r.returncode == 2 and "unknown section warp" in r.stdout
