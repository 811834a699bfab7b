"""dsfn.runtime.env: device/backend choice and process-group set-up from torchrun's variables."""
from __future__ import annotations

import os

import pytest
import torch

from dsfn.errors import ConfigError, DistributedError
from dsfn.launch import spawn
from dsfn.runtime import env

DIST_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def single_process(monkeypatch):
    """This process as a plain single-process run (whatever launched pytest)."""
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not env.is_distributed()


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("YES", True),
                                            ("0", False), ("", False), (None, False)])
def test_force_cpu_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("DSFN_FORCE_CPU", raising=False)
    else:
        monkeypatch.setenv("DSFN_FORCE_CPU", value)
    assert env.force_cpu() is expected


def test_cuda_when_visible_unless_forced(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("DSFN_FORCE_CPU", raising=False)
    assert env.device() == torch.device("cuda", 1) and env.backend() == "nccl"
    monkeypatch.setenv("DSFN_FORCE_CPU", "1")
    assert env.device() == torch.device("cpu") and env.backend() == "gloo"


def test_backend_override_runs_gloo_on_cuda_tensors(monkeypatch):
    """DSFN_BACKEND=gloo: several ranks on one GPU (NCCL refuses that); the device stays CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("DSFN_FORCE_CPU", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("DSFN_BACKEND", "gloo")
    assert env.device() == torch.device("cuda", 0) and env.backend() == "gloo"
    monkeypatch.setenv("DSFN_BACKEND", "mpi")
    with pytest.raises(ConfigError, match="DSFN_BACKEND"):
        env.backend()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DSFN_BACKEND", "nccl")
    with pytest.raises(ConfigError, match="needs CUDA"):
        env.backend()


def test_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DSFN_FORCE_CPU", raising=False)
    assert env.device() == torch.device("cpu") and env.backend() == "gloo"


def test_single_process_without_env_vars(single_process):
    assert env.init_distributed() is False
    assert not env.is_distributed()
    assert (env.rank(), env.world_size(), env.local_rank()) == (0, 1, 0)
    env.shutdown()  # no-op without a group


@pytest.mark.parametrize("present", [("RANK",), ("WORLD_SIZE", "MASTER_ADDR"),
                                     ("RANK", "WORLD_SIZE", "MASTER_PORT"), ("MASTER_ADDR",)])
def test_half_set_env_vars_name_what_is_missing(single_process, monkeypatch, present):
    values = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for var in present:
        monkeypatch.setenv(var, values[var])
    with pytest.raises(DistributedError) as info:
        env.init_distributed()
    msg = str(info.value)
    for var in env.REQUIRED_VARS:
        if var not in present:
            assert var in msg
    assert "torchrun" in msg and "dsfn.launch" in msg
    assert not env.is_distributed()


@pytest.mark.parametrize("rank,world", [("2", "2"), ("-1", "2"), ("x", "2"), ("0", "0")])
def test_inconsistent_env_vars(single_process, monkeypatch, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(DistributedError):
        env.init_distributed()
    assert not env.is_distributed()


def _inside_rank():
    # spawn already called init_distributed: a second call is a no-op.
    assert env.init_distributed() is True
    info = (env.is_distributed(), env.rank(), env.world_size(), env.local_rank(),
            env.local_world_size(), str(env.device()), env.backend())
    env.shutdown()
    return info + (env.is_distributed(), env.rank(), env.world_size())


@pytest.mark.parametrize("world_size", [1, 2])
def test_initialised_group_in_ranks(world_size):
    out = spawn(_inside_rank, world_size, timeout=60)
    # after shutdown: the launcher's rank and world (spawn's environment), as before the group
    assert out == [(True, r, world_size, r, world_size, "cpu", "gloo", False, r, world_size)
                   for r in range(world_size)]


def test_ensure_distributed_does_nothing_without_a_launcher(single_process, monkeypatch):
    assert env.ensure_distributed() is False
    monkeypatch.setenv("WORLD_SIZE", "1")        # torchrun --nproc-per-node 1: nothing to join
    monkeypatch.setenv("RANK", "0")
    assert env.ensure_distributed() is False
    assert not env.is_distributed()


@pytest.mark.parametrize("present", [("WORLD_SIZE",), ("WORLD_SIZE", "RANK", "MASTER_PORT"),
                                     ("WORLD_SIZE", "RANK", "MASTER_ADDR")])
def test_ensure_distributed_names_what_a_launch_lacks(single_process, monkeypatch, present):
    values = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for var in present:
        monkeypatch.setenv(var, values[var])
    with pytest.raises(DistributedError) as info:
        env.ensure_distributed()
    msg = str(info.value)
    assert "WORLD_SIZE=2" in msg and "torchrun" in msg
    for var in env.REQUIRED_VARS:
        assert (var in msg.split(" says ")[1].split(" so ")[0]) is (var not in present)
    assert not env.is_distributed()


def test_ensure_distributed_rejects_a_bad_world_size(single_process, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DistributedError, match="WORLD_SIZE='two'"):
        env.ensure_distributed()


def _ensure_inside_rank():
    return env.ensure_distributed(), env.world_size()


def test_ensure_distributed_keeps_an_existing_group():
    assert spawn(_ensure_inside_rank, 2, timeout=60) == [(True, 2), (True, 2)]


def _rank_before_any_step():
    import dsfn.runtime
    return dsfn.runtime.rank(), env.is_distributed()


def test_rank_before_the_first_step_reads_the_launcher(tmp_path):
    """Launched ranks asked before any Step (no process group yet) each say their own rank
    (every rank said 0)."""
    import subprocess
    import sys
    script = tmp_path / "r.py"
    script.write_text("import dsfn.runtime, torch.distributed as d\n"
                      "print('RANK', dsfn.runtime.rank(), dsfn.runtime.world_size(), d.is_initialized())\n")
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "dsfn.launch", "--nproc", "2", str(script)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("RANK")) == \
        ["RANK 0 2 False", "RANK 1 2 False"], r.stdout


def test_launched_ranks_lines_never_interleave(tmp_path):
    """Two ranks writing each line in pieces (as an unbuffered `print` does) reach the
    launcher's output as whole lines (the CI's flake: 'RANK 1RANK  0 2 False')."""
    import pathlib
    import subprocess
    import sys
    script = tmp_path / "w.py"
    # Both ranks wait for each other (a file barrier) so their writes overlap.
    script.write_text("import os, pathlib, sys, time\n"
                      "r = os.environ['RANK']\n"
                      f"here = pathlib.Path({str(tmp_path)!r})\n"
                      "(here / ('up' + r)).touch()\n"
                      "while not all((here / f'up{k}').exists() for k in '01'):\n"
                      "    time.sleep(0.001)\n"
                      "for i in range(2000):\n"
                      "    for piece in ('LINE ', r, ' ', str(i), '\\n'):\n"
                      "        os.write(1, piece.encode())\n")
    root = pathlib.Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "dsfn.launch", "--nproc", "2", str(script)], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert sorted(lines) == sorted(f"LINE {rank} {i}" for rank in (0, 1) for i in range(2000))
