"""dsfn.launch.spawn and `python -m dsfn.launch`: results by rank, fast and precise failures."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsfn.errors import ConfigError, RankFailure
from dsfn.launch import spawn

REPO = Path(__file__).resolve().parents[1]


def child_pids() -> list[int]:
    """Live (non-zombie) direct children of this process, read from /proc.

    multiprocessing's own helper (the resource tracker that start_method="spawn" starts
    once per process, and lives until the process exits) is not a leftover rank.
    """
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the ")" of the command name: state, ppid, ...
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) != me or state == "Z":
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"multiprocessing.resource_tracker" in cmdline or b"multiprocessing.forkserver" in cmdline:
            continue
        pids.append(int(entry))
    return pids


@pytest.fixture(autouse=True)
def no_leftover_children():
    before = set(child_pids())
    yield
    assert set(child_pids()) - before == set(), "spawn left child processes behind"


def _rank_info(scale):
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "DSFN_FORCE_CPU")
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "sum": t * scale, "env": {k: os.environ.get(k) for k in keys}}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_in_rank_order_with_all_reduce(world_size):
    out = spawn(_rank_info, world_size, args=(2.0,))
    assert len(out) == world_size
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    for r, info in enumerate(out):
        assert info["rank"] == r and info["world"] == world_size
        assert info["backend"] == "gloo"
        assert torch.equal(info["sum"], torch.full((3,), expected_sum))
        env = info["env"]
        assert env["RANK"] == str(r) and env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["DSFN_FORCE_CPU"] == "1"
    assert len({info["env"]["MASTER_PORT"] for info in out}) == 1


def test_closure_kwargs_and_large_results():
    big = 1 << 20  # 4 MiB per rank: more than a pipe buffer holds

    def fn(offset, *, n):
        return torch.arange(n, dtype=torch.float32) + offset + dist.get_rank()

    out = spawn(fn, 2, args=(10,), kwargs={"n": big})
    for r, t in enumerate(out):
        assert t.shape == (big,) and t[0].item() == 10 + r and t[-1].item() == big - 1 + 10 + r


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("DSFN_TEST_REMOVE_ME", "x")
    out = spawn(lambda: (os.environ.get("DSFN_TEST_FOO"), os.environ.get("DSFN_TEST_REMOVE_ME")),
                2, env={"DSFN_TEST_FOO": "bar", "DSFN_TEST_REMOVE_ME": None})
    assert out == [("bar", None), ("bar", None)]


def test_rank_that_raises_fails_fast_while_peers_block():
    def fn():
        if dist.get_rank() == 2:
            raise ValueError("boom on purpose")
        time.sleep(1000)  # blocked peers must not delay the report

    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(fn, 4, timeout=60)
    # far below the 60 s timeout and the peers' 1000 s sleep; the margin covers starting 4
    # ranks from a large test process on a loaded 2-core machine (seen: 5.4 s)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.rank == 2 and err.reason == "exception"
    assert "rank 2" in str(err) and "ValueError: boom on purpose" in str(err)
    assert "Traceback" in err.remote_traceback and "in fn" in err.remote_traceback


def test_root_cause_beats_collateral_collective_errors():
    def fn():
        if dist.get_rank() == 1:
            raise KeyError("root cause")
        dist.all_reduce(torch.ones(4))  # peers see a broken connection afterwards

    with pytest.raises(RankFailure) as info:
        spawn(fn, 4, timeout=60)
    assert info.value.rank == 1 and "KeyError" in str(info.value)


def test_hanging_rank_times_out_and_is_named():
    def fn():
        if dist.get_rank() == 1:
            time.sleep(1000)
        return "done"

    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        spawn(fn, 2, timeout=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 15     # the timeout, plus stack dumps and clean-up on a loaded machine
    err = info.value
    assert err.reason == "timeout" and err.rank == 1 and err.ranks == [1]
    assert "[1]" in str(err) and "3 s" in str(err)
    assert "in fn" in err.stacks[1]  # where the rank was stuck


def test_os_exit_is_reported_with_code():
    def fn():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankFailure) as info:
        spawn(fn, 2, timeout=60)
    err = info.value
    assert err.reason == "exit" and err.rank == 1 and err.exitcode == 3
    assert "rank 1" in str(err) and "code 3" in str(err)


def test_signal_death_is_reported():
    def fn():
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return 1

    with pytest.raises(RankFailure) as info:
        spawn(fn, 2, timeout=60)
    assert info.value.reason == "exit" and info.value.rank == 0
    assert info.value.exitcode == -signal.SIGKILL and "SIGKILL" in str(info.value)


def test_unpicklable_result_is_an_error_of_that_rank():
    with pytest.raises(RankFailure) as info:
        spawn(lambda: (lambda: None), 1)
    assert info.value.reason == "exception" and "cannot be pickled" in str(info.value)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_world_size_is_validated(bad):
    with pytest.raises(ConfigError):
        spawn(lambda: None, bad)


def test_bad_arguments():
    with pytest.raises(ConfigError):
        spawn(lambda: None, 1, start_method="threads")
    with pytest.raises(ConfigError):
        spawn(lambda: None, 1, timeout=0)
    with pytest.raises(ConfigError, match="picklable"):
        spawn(lambda: None, 1, start_method="spawn")


def _module_level_rank():
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), torch.get_num_threads() >= 1


def test_spawn_start_method():
    assert spawn(_module_level_rank, 2, start_method="spawn", timeout=60) == [(0, 2.0, True), (1, 2.0, True)]


def test_matmul_after_parent_used_openmp():
    # libgomp hangs a forked child that uses >1 thread after the parent has; spawn pins 1.
    a = torch.randn(256, 256)
    (a @ a).sum()
    out = spawn(lambda: float((torch.ones(256, 256) @ torch.ones(256, 256))[0, 0]), 2, timeout=30)
    assert out == [256.0, 256.0]


def _run_cli(tmp_path, body, *cli_args):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "dsfn.launch", *cli_args, str(script)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_cli_runs_script_on_n_ranks(tmp_path):
    proc = _run_cli(tmp_path, """
        import torch, torch.distributed as dist
        from dsfn.runtime import env
        assert env.init_distributed()
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"rank {env.rank()} of {env.world_size()} sum {t.item()} {env.backend()}")
        env.shutdown()
    """, "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 of 2 sum 2.0 gloo" in proc.stdout and "rank 1 of 2 sum 2.0 gloo" in proc.stdout


def test_cli_script_needs_no_init_call(tmp_path):
    """The first use of a Step initialises the group the launcher described."""
    proc = _run_cli(tmp_path, """
        import os
        import dsfn
        from dsfn.runtime import env, current_mesh
        from dsfn.transforms import data_parallel
        from dsfn.testing.models import make_mlp
        # different initial replicas per rank: place must sync them over the real group
        apply_fn, params = dsfn.functionalize(make_mlp([2, 3], seed=int(os.environ["RANK"])))
        step = dsfn.compose(data_parallel())(lambda s, b: (s, {}))
        assert not env.is_distributed()
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
        w = state.params["layers.0.weight"]
        print(f"rank {env.rank()} of {env.world_size()} dp {current_mesh().size('dp')} w {float(w.sum()):.6f}")
    """, "--nproc", "2", "--timeout", "50")
    assert proc.returncode == 0, proc.stderr
    # (unbuffered ranks may interleave a line with its newline: match, don't split lines)
    found = sorted(re.findall(r"rank (\d) of (\d) dp (\d) w (-?[\d.]+)", proc.stdout))
    assert [f[:3] for f in found] == [("0", "2", "2"), ("1", "2", "2")], proc.stdout
    assert found[0][3] == found[1][3]    # place synced the replicas


def test_cli_failing_rank_gives_nonzero_exit(tmp_path):
    proc = _run_cli(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(60)  # must be killed, not waited for
    """, "--nproc", "2")
    assert proc.returncode == 3
    assert "rank 1" in proc.stderr


def _nested_fork_spawn():
    from dsfn.errors import ConfigError
    try:
        spawn(abs, 2, args=(-1,), timeout=30)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_fork_from_a_process_with_a_process_group_is_refused():
    """A forked rank would inherit the parent's process group and hang in it."""
    (msg,) = spawn(_nested_fork_spawn, 1, timeout=60)
    assert "initialised torch.distributed process group" in msg and "start_method='spawn'" in msg
