"""`async_checkpoint`: background saves while training runs its own collectives, equal to the
states training produced, equal to the sync engine, failures raised loudly, retention."""
import errno
import os
import subprocess
import sys
import time

import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree

# the package re-exports the function `save`, which shadows the submodule's attribute
from dsfn.checkpoint import writer as save_mod
from dsfn.checkpoint.format import committed_steps
from dsfn.errors import ConfigError
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.transforms import async_checkpoint, shard_zero

SIZES = [6, 10, 3]                      # 10 and 3 do not divide by 2: FlatShard padding
BATCHES = regression_batches(7, 8, 6, 3, seed=1)
SAVED_STEPS = [2, 4, 6]
WRITE_DELAY_S = 0.3


def _make(transforms):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

    def train_step(state, batch):
        loss, g = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(g), {"loss": loss}
    step = dsfn.compose(*transforms)(train_step)
    return step, step.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))


def _logical(step, state):
    return step.gather(state).replace(tx=None)


def _equal(a, b):
    la, lb = tree.leaves_with_path(a), tree.leaves_with_path(b)
    return [p for p, _ in la] == [p for p, _ in lb] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(la, lb))


def _slow_writer(delay_s):
    """Make every rank-file write take `delay_s` longer, so training runs on during saves."""
    real = save_mod._write_rank_file

    def slow(*a, **k):
        time.sleep(delay_s)
        return real(*a, **k)
    save_mod._write_rank_file = slow


def _train(step, state, batches, keep_logical=False):
    losses, logical, metrics = [], {}, []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
        if keep_logical:       # a collective on the training group while a save may be in flight
            logical[int(state.step)] = tree.map(torch.clone, _logical(step, state))   # a copy, not a view
    return state, losses, logical, metrics


def _rank_run(root, stage):
    init_mesh()
    _slow_writer(WRITE_DELAY_S)
    out = {}
    step, state = _make([shard_zero(stage)])
    _, out["plain_losses"], _, _ = _train(step, state, BATCHES)
    for engine in ("async", "sync"):
        t = async_checkpoint(f"{root}/{engine}", every=2, engine=engine)
        step, state = _make([shard_zero(stage), t])
        t0 = time.perf_counter()
        _, losses, logical, metrics = _train(step, state, BATCHES, keep_logical=True)
        train_s = time.perf_counter() - t0
        t.wait()
        loaded = {}
        for s in SAVED_STEPS:
            _, like = _make([shard_zero(stage)])
            loaded[s] = _logical(step, ck.load(f"{root}/{engine}/step_{s:08d}", like))
        out[engine] = {"losses": losses, "metrics": metrics, "train_s": train_s,
                       "equal": {s: _equal(loaded[s], logical[s]) for s in SAVED_STEPS}, "loaded": loaded}
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_zero_async_equals_training_and_sync(tmp_path, stage):
    results = run_on_ranks(_rank_run, 2, str(tmp_path), stage, timeout=120)
    for rank, out in enumerate(results):
        for engine in ("async", "sync"):
            r = out[engine]
            assert r["losses"] == out["plain_losses"], f"rank {rank} {engine}: checkpointing changed the losses"
            assert all(r["equal"].values()), f"rank {rank} {engine}: checkpoint != trained state {r['equal']}"
            due = [i + 1 for i, m in enumerate(r["metrics"]) if "ckpt_blocked_s" in m]
            assert due == SAVED_STEPS, due
        # the sync engine gives identical checkpoints: same logical values, same data files
        for s in SAVED_STEPS:
            assert _equal(out["async"]["loaded"][s], out["sync"]["loaded"][s])
        # the first async save blocks only for the capture, not for the (slowed) write; later
        # ones may wait for the previous save (one in flight); every sync save blocks for the write
        blocked = {e: [m["ckpt_blocked_s"] for m in out[e]["metrics"] if "ckpt_blocked_s" in m]
                   for e in ("async", "sync")}
        assert blocked["async"][0] < WRITE_DELAY_S / 2 and min(blocked["sync"]) >= WRITE_DELAY_S, blocked
    for engine in ("async", "sync"):
        assert committed_steps(str(tmp_path / engine)) == SAVED_STEPS
        assert ck.latest_step(tmp_path / engine) == SAVED_STEPS[-1]
    # identical data files, tensor by tensor (the bytes differ only in the order safetensors
    # writes its metadata dict, which is not deterministic)
    for s in SAVED_STEPS:
        da, ds = (tmp_path / e / f"step_{s:08d}" for e in ("async", "sync"))
        assert sorted(ck.read_manifest(da).files) == sorted(ck.read_manifest(ds).files)
        for name in ck.read_manifest(da).files:
            assert _file_tensors(da / name) == _file_tensors(ds / name), name


def _file_tensors(path):
    from safetensors import safe_open
    f = safe_open(str(path), framework="pt")
    return {k: (str(f.get_tensor(k).dtype), f.get_tensor(k).numpy().tobytes()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _rank_fails(root):
    init_mesh()
    t = async_checkpoint(root, every=2)
    step, state = _make([shard_zero(2), t])
    state, *_ = _train(step, state, BATCHES[:2])
    t.wait()                                          # step 2 commits on both ranks
    if torch.distributed.get_rank() == 1:
        def boom(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        save_mod._write_rank_file = boom
    state, *_ = _train(step, state, BATCHES[2:4])    # step 4's save fails in the background
    try:
        t.wait()
        return "no error"
    except ck.CheckpointError as e:
        return str(e)


def test_two_ranks_background_failure_raises_on_every_rank(tmp_path):
    msgs = run_on_ranks(_rank_fails, 2, str(tmp_path), timeout=60)
    for m in msgs:
        assert "background checkpoint save of step 4" in m and "No space left on device" in m and "rank 1" in m, m
    assert ck.latest_step(tmp_path) == 2                  # the previous checkpoint is intact
    assert not (tmp_path / "step_00000004").exists()


# -- single process (no process group) -----------------------------------------------------------
def test_single_process_async_and_retention(tmp_path):
    t = async_checkpoint(tmp_path, every=1, keep=2)
    step, state = _make([t])
    states = {}
    for b in BATCHES[:5]:
        state, m = step(state, b)
        assert "ckpt_blocked_s" in m
        states[int(state.step)] = tree.map(torch.clone, state.replace(tx=None))
    t.wait()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004", "step_00000005"]
    _, like = _make([])
    assert _equal(ck.load(tmp_path, like).replace(tx=None), states[5])
    assert _equal(ck.load(tmp_path / "step_00000004", like).replace(tx=None), states[4])


def test_single_process_failure_raises_at_next_step_and_wait(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied (simulated)")
    monkeypatch.setattr(save_mod, "_write_rank_file", boom)
    t = async_checkpoint(tmp_path / "c", every=2)
    step, state = _make([t])
    state, *_ = _train(step, state, BATCHES[:2])             # the save of step 2 starts and fails
    while t.busy:
        time.sleep(0.01)
    with pytest.raises(ck.CheckpointError, match="Permission denied") as e:
        step(state, BATCHES[2])
    assert isinstance(e.value.cause, ck.CheckpointError) and "step 2" in str(e.value)
    assert e.value.__cause__ is e.value.cause
    state, *_ = _train(step, state, BATCHES[2:4])           # raised once; step 4's save fails too
    with pytest.raises(ck.CheckpointError, match="step 4.*Permission denied"):
        t.wait()
    t.wait()                                                 # nothing in flight, nothing pending


def test_unwritable_directory_fails_loudly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    t = async_checkpoint(blocker / "ckpt", every=1)           # a path under a regular file (root too)
    step, state = _make([t])
    step(state, BATCHES[0])
    with pytest.raises(ck.CheckpointError, match="Not a directory|could not prepare"):
        t.wait()


_EXIT_SCRIPT = """
import sys, time, torch, dsfn
from dsfn.checkpoint import writer
from dsfn.transforms import async_checkpoint
from dsfn.testing.models import make_mlp
real = writer._write_rank_file
def slow(*a, **k):
    time.sleep(0.3)
    return real(*a, **k)
writer._write_rank_file = slow       # the save is still running when the script ends
apply_fn, params = dsfn.functionalize(make_mlp([2, 2], 0))
def train_step(state, b):
    loss, g = dsfn.value_and_grad(lambda p, b: (apply_fn(p, b["x"]) ** 2).mean())(state.params, b)
    return state.apply_gradients(g), {"loss": loss}
step = dsfn.compose(async_checkpoint(sys.argv[1], every=1))(train_step)
step(step.init_state(params, dsfn.optim.sgd(lr=0.1)), {"x": torch.ones(1, 2)})
"""


def test_atexit_flushes_the_last_save_and_reports_a_failure(tmp_path):
    (tmp_path / "file").write_text("x")
    ok = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "ok")], check=False,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ck.latest_step(tmp_path / "ok") == 1, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "file" / "ckpt")], check=False,
                         capture_output=True, text=True, timeout=60)
    assert "background checkpoint save of step 1" in bad.stderr, bad.stderr[-2000:]
    assert bad.returncode == 1           # a job whose last save failed does not look successful


def test_sync_engine_inline_and_bad_config(tmp_path):
    t = async_checkpoint(tmp_path, every=2, engine="sync")
    step, state = _make([t])
    state, *_ = _train(step, state, BATCHES[:3])
    assert ck.latest_step(tmp_path) == 2 and not t.busy
    for bad in ({"every": 0}, {"every": 2, "engine": "nope"}, {"every": 2, "keep": 0}, {"every": 2, "timeout_s": 0},
                {"every": 2, "timeout_s": "60"}):
        with pytest.raises(ConfigError):
            async_checkpoint(tmp_path, **bad)


def test_host_cache_size_with_a_capture_by_reference_is_a_config_error(tmp_path):
    """Issue 31: capture='reference' copies nothing into the host cache, so a host_cache_size
    would be accepted and do nothing: refused, naming the captures that use it."""
    with pytest.raises(ConfigError, match=r"capture='reference', host_cache_size=1024\).*'auto'.*'copy'"):
        async_checkpoint(tmp_path, every=1, capture="reference", host_cache_size=1024)
    for capture in ("auto", "copy"):
        async_checkpoint(tmp_path, every=1, capture=capture, host_cache_size=1024).wait()
    async_checkpoint(tmp_path, every=1, capture="reference").wait()


def _groups_per_timeout():
    import torch.distributed as dist
    init_mesh()
    made = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: (made.append(k["timeout"].total_seconds()), real(*a, **k))[1]
    try:
        first = save_mod.checkpoint_group(600.0)
        again = save_mod.checkpoint_group(600)
        short = save_mod.checkpoint_group(30.0)
    finally:
        dist.new_group = real
    return first is again, short is not first, made


def test_a_save_timeout_applies_after_a_group_with_another_timeout_exists():
    """Checkpointing's gloo group is made per timeout: a save (or async_checkpoint(timeout_s=))
    with a new timeout gets a group with that timeout, not the first save's (which would accept
    timeout_s and ignore it); the same timeout reuses its group."""
    for same, other, made in run_on_ranks(_groups_per_timeout, 2, timeout=60):
        assert same and other and made == [600.0, 30.0]


def test_writer_thread_yields_the_cpu_to_training(tmp_path, monkeypatch):
    """The background writer lowers its own nice value (the training thread keeps its own)."""
    import threading
    seen = []
    real = save_mod._write_rank_file

    def spy(*a, **k):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(*a, **k)
    monkeypatch.setattr(save_mod, "_write_rank_file", spy)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver = ck.AsyncSaver()
    _, state = _make([])
    saver.submit(tmp_path, state)
    saver.wait()
    assert seen == [min(19, base + 10)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


def test_disk_full_midway_through_a_file_fails_that_save_and_keeps_the_previous(tmp_path, monkeypatch):
    """ENOSPC after part of the rank file reached the disk: the background save fails loudly,
    `latest` still names the previous step, which verifies and loads; the next save removes
    the torn temporary directory."""
    from dsfn.runtime import sfio
    real = sfio._write_all
    calls = {"n": 0, "fail": False}

    def full_disk(fd, mv):
        calls["n"] += 1
        if calls["fail"]:                  # half of this write reaches the disk, then the disk is full
            real(fd, mv[:len(mv) // 2])
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return real(fd, mv)
    monkeypatch.setattr(sfio, "_write_all", full_disk)
    t = async_checkpoint(tmp_path, every=2)
    step, state = _make([t])
    state, *_ = _train(step, state, BATCHES[:2])
    t.wait()
    good = tree.map(torch.clone, state.replace(tx=None))
    calls.update(n=0, fail=True)
    state, *_ = _train(step, state, BATCHES[2:4])             # step 4's save runs out of space
    with pytest.raises(ck.CheckpointError, match="No space left"):
        t.wait()
    assert calls["n"] >= 1
    assert ck.latest_step(tmp_path) == 2 and ck.verify(tmp_path) == []
    _, like = _make([])
    assert _equal(ck.load(tmp_path, like).replace(tx=None), good)
    assert any(n.startswith(".tmp_step_00000004") for n in os.listdir(tmp_path))
    calls["fail"] = False
    state, *_ = _train(step, state, BATCHES[4:6])
    t.wait()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000006"]
