"""Under a launcher (torchrun), a Step initialises the process group itself: no init call.

Before this, `torchrun --nproc_per_node 2 script.py` without an explicit init ran the
stack at world size 1 on every rank: N independent trainings, silently.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dsfn
from dsfn.errors import DistributedError
from dsfn.runtime import env
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import run_training
from dsfn.transforms import shard_zero

REPO = Path(__file__).resolve().parents[1]
SIZES, N_STEPS, GLOBAL_BATCH = [6, 8, 3], 3, 8

# A typical torchrun script: each rank reads its RANK and trains on its half of every
# global batch (as a DistributedSampler would give it), and never initialises anything.
SCRIPT = textwrap.dedent(f"""
    import os, sys, json
    import torch
    import dsfn
    from dsfn.runtime import env, current_mesh
    from dsfn.testing.models import make_mlp, regression_batches
    from dsfn.testing.reference import train_step_for, mse_loss
    from dsfn.transforms import compose, shard_zero

    out = sys.argv[1]
    rank, half = int(os.environ["RANK"]), {GLOBAL_BATCH} // 2
    apply_fn, params = dsfn.functionalize(make_mlp({SIZES}, seed=0))
    step = compose(shard_zero(3, split_batch=False))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9), seed=0))
    for batch in regression_batches({N_STEPS}, {GLOBAL_BATCH}, {SIZES[0]}, {SIZES[-1]}, seed=1):
        state, metrics = step(state, {{k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}})
    final = step.gather(state)
    torch.save({{"world": env.world_size(), "dp": current_mesh().size("dp"),
                "params": {{k: v.detach().clone() for k, v in final.params.items()}}}},
               os.path.join(out, f"rank{{rank}}.pt"))
""")


def _batches(rows=slice(None)):
    return [{k: v[rows] for k, v in b.items()}
            for b in regression_batches(N_STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=1)]


def _reference(batches):
    """Single-process training on `batches` (this process has no process group)."""
    res = run_training(lambda: make_mlp(SIZES, seed=0), lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9),
                       batches)
    return res.state.params


def _run_torchrun(tmp_path: Path, nproc: int = 2, timeout: float = 120.0) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    child_env.update(DSFN_FORCE_CPU="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                     PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    # --standalone: torchrun picks a free rendezvous port itself (no race with other tests)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(script), str(out)]
    proc = subprocess.Popen(cmd, env=child_env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout:g} s:\n{stdout[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed (exit {proc.returncode}):\n{stdout[-4000:]}"
    return out


def test_torchrun_without_init_call_trains_as_one_world_of_two(tmp_path):
    out = _run_torchrun(tmp_path)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    assert [(r["world"], r["dp"]) for r in ranks] == [(2, 2), (2, 2)]
    assert_trees_close(ranks[1]["params"], ranks[0]["params"], rtol=0, atol=0)
    full = _reference(_batches())
    assert_trees_close(ranks[0]["params"], full, rtol=1e-5, atol=1e-6)
    # negative control: what rank 0 would end with as a silent world-1 run on its half
    alone = _reference(_batches(slice(0, GLOBAL_BATCH // 2)))
    diff = max((alone[k] - full[k]).abs().max().item() for k in full)
    assert diff > 1e-3


@pytest.fixture
def half_launched(monkeypatch):
    """This process looks like rank 0 of 2 under a launcher that forgot MASTER_ADDR."""
    for var in ("MASTER_ADDR", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not env.is_distributed()


@pytest.mark.parametrize("entry", ["place", "init_state", "call", "gather", "explain"])
def test_world_size_2_with_incomplete_env_names_the_missing_variable(half_launched, entry):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, seed=0))
    tx = dsfn.optim.sgd(lr=0.1)
    step = dsfn.compose(shard_zero(3))(lambda s, b: (s, {}))
    state = dsfn.TrainState.create(params, tx)
    calls = {"place": lambda: step.place(state), "init_state": lambda: step.init_state(params, tx),
             "call": lambda: step(state, _batches()[0]), "gather": lambda: step.gather(state),
             "explain": lambda: step.explain(state, _batches()[0])}
    with pytest.raises(DistributedError, match="MASTER_ADDR") as info:
        calls[entry]()
    assert "WORLD_SIZE=2" in str(info.value)
    assert not env.is_distributed()
