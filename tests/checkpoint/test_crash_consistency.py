"""Crash consistency of `dsfn.checkpoint` under real process deaths (public API only).

1. SIGKILL at random points during saves (`test_sigkill_during_saves_never_leaves_a_torn_checkpoint`,
   CRASH_TRIALS trials; `test_sigkill_soak` runs SOAK_TRIALS (env DSFN_SOAK_TRIALS, default
   1000) under `-m slow`). Each trial forks a child from this (already imported) process that
   trains a ~8 MB state deterministically and saves after every step, mixing the engines
   across trials: a direct `ck.save` (with `user_data`), `async_checkpoint(engine="sync")`
   and `async_checkpoint(engine="async")`, with `keep=2` or all kept. Once the child signals
   that step 1 is committed, the parent SIGKILLs it after a seeded random time ("uniform"
   trials) or a seeded random time after the next save created its `.tmp_step_*` directory
   ("in_save" trials). Then: every `step_*` directory holds a manifest (a directory is never
   visible half-built) and `ck.verify` finds nothing wrong with it; `ck.latest_step` names a
   committed step, the newest or (killed between the rename and the `latest` update) the one
   before; the newest committed step and the latest one load bitwise equal to the state this
   process computes for that step by training the same model on the same batches (and carry
   their `user_data`); stale `.tmp_*` directories are never what `latest_step`/`read_manifest`
   resolve to and refuse to load; the next save removes them. A good fraction of trials must
   leave a `.tmp_step_*` directory, i.e. the kill really landed inside a save.
2. A flipped byte in rank 1's file of a 2-rank ZeRO-3 checkpoint: `ck.verify` names
   `rank_00001.safetensors` (and only it); `ck.load` raises a `CheckpointError` naming it,
   in a single process and on the 2 ranks; restoring the byte makes it whole again.
3. A rank dying in the middle of a save: 2 forked ranks with a real gloo group (our own
   processes: `run_on_ranks` would kill rank 0 as soon as rank 1 dies) commit step 1; during
   step 2's save rank 1 truncates its half-written data file and SIGKILLs itself, or freezes
   (SIGSTOP), from its own `os.fsync`, patched in that child only. Rank 0's save raises
   `CheckpointError` within the timeout it passed (sync engine: from `ck.save`; async engine:
   from `.wait()`), nothing is committed for step 2, step 1 is still `latest`, verifies and
   loads bitwise, and the next save removes the torn temporary.

Children exit with `os._exit` (no pytest/atexit teardown), die with the parent
(PR_SET_PDEATHSIG), and run torch with one thread (libgomp is not fork-safe otherwise); the
parent waits on them with deadlines and SIGKILLs whatever is left.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import pickle
import random
import select
import shutil
import signal
import time
import traceback

import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import train_step_for
from dsfn.transforms import async_checkpoint, shard_zero


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """`ck.load` may restore a checkpoint's global generator states into this process; give
    the rest of the session its own back."""
    np = None
    with contextlib.suppress(ImportError):
        import numpy as np
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state() if np else None)
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    if np is not None:
        np.random.set_state(saved[2])


# -- SIGKILL trials ----------------------------------------------------------------------------
CRASH_TRIALS = 20
SOAK_TRIALS = int(os.environ.get("DSFN_SOAK_TRIALS", "1000"))
CRASH_SEED = 20240611                       # the kill times of trial i derive from (seed, i)
SOAK_SEED = 7
SIZES = [128, 1024, 512, 16]                # ~0.66 M params: params + 2 Adam moments ~ 8 MB
MODEL_SEED, DATA_SEED = 0, 1234
MAX_STEPS = 400                             # the child stops there (never reached in practice)
MAX_KILL_DELAY_S = 0.3                      # kill uniformly in [0, this] after step 1 committed
# "uniform": the kill time alone is random; "in_save": after a random wait, the parent waits
# for the next save to create its .tmp_step_* directory and kills a random moment later
KILL_STRATEGIES = ("uniform", "in_save")
MAX_IN_SAVE_DELAY_S = 0.012                 # its .tmp_step_* lives ~15-20 ms here (~8 MB state)
MODES = ("save", "async", "sync")           # direct ck.save / the transform's two engines
KEEPS = (2, None)
MIN_MID_SAVE_FRACTION = 0.4                 # trials whose kill left a .tmp_step_* directory
MIN_AIMED_MID_SAVE_FRACTION = 0.6           # the same among the "in_save" trials (~90% measured)
READY_TIMEOUT_S = 60.0


def _die_with_parent() -> None:
    """SIGKILL this child when the test process dies (no orphans)."""
    with contextlib.suppress(Exception):    # best effort
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG


def _fork(body, *args) -> tuple[int, int]:
    """Fork a child running `body(write_fd, *args)`; returns (pid, read end of its pipe).

    A failure in the child is sent as b"E" + traceback before it exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # the child
        code = 70
        try:
            os.close(r)
            _die_with_parent()
            torch.set_num_threads(1)
            body(w, *args)
            code = 0
        except BaseException:  # noqa: BLE001 (reported through the pipe)
            with contextlib.suppress(Exception):
                os.write(w, b"E" + traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _read_until(fd: int, token: bytes, timeout_s: float) -> bytes:
    """Read from `fd` until `token` arrives, EOF, or the timeout; returns what was read."""
    buf = b""
    deadline = time.monotonic() + timeout_s
    while token not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return buf


def _read_rest(fd: int) -> bytes:
    """Everything left in a pipe whose writer is dead."""
    buf = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return buf


def _kill_and_reap(pid: int) -> int:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


@contextlib.contextmanager
def _one_thread():
    """Compute like the forked children do (one intra-op thread): bitwise the same sums."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _crash_model(transforms=()):
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, MODEL_SEED))
    step = dsfn.compose(*transforms)(train_step_for(apply_fn))
    return step, step.init_state(params, dsfn.optim.adamw(lr=1e-3))


_BATCHES: list = []


def _batches() -> list:
    if not _BATCHES:
        _BATCHES.extend(regression_batches(MAX_STEPS, 8, SIZES[0], SIZES[-1], seed=DATA_SEED))
    return _BATCHES


def _digest(state) -> dict[str, str]:
    """Leaf path -> sha256 of dtype, shape and bytes (bitwise identity, small to keep)."""
    out = {}
    for path, x in tree.leaves_with_path(state):
        h = hashlib.sha256()
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(json.dumps(x, sort_keys=True, default=repr).encode())
        out[path] = h.hexdigest()
    return out


class _Expected:
    """The state after step N of the children's training, computed here (lazily, as digests)."""

    def __init__(self):
        self.digests: dict[int, dict[str, str]] = {}
        self._state = None
        self._step = None
        self.like = None

    def at(self, n: int) -> dict[str, str]:
        if n not in self.digests:
            with _one_thread():
                if self._state is None:
                    self._step, self._state = _crash_model()
                    self.like = self._state
                    self.digests[0] = _digest(self._state)
                while max(self.digests) < n:
                    k = max(self.digests)
                    self._state, _ = self._step(self._state, _batches()[k])
                    self.digests[k + 1] = _digest(self._state)
        return self.digests[n]


_EXPECTED = _Expected()


def _train_and_save(w: int, root: str, mode: str, keep, seed: int) -> None:
    """The child of one trial: train, save after every step, say b"R" once step 1 is committed."""
    if mode == "save":
        step, state = _crash_model()
    else:
        ckpt = async_checkpoint(root, every=1, keep=keep, engine=mode)
        step, state = _crash_model([ckpt])
    for i, batch in enumerate(_batches()):
        state, _ = step(state, batch)
        n = i + 1
        if mode == "save":
            ck.save(root, state, keep=keep, user_data={"step": n, "trial_seed": seed})
        if n == 1:
            if mode == "async":
                ckpt.wait()                   # step 1 committed before the parent's clock starts
            os.write(w, b"R")
    if mode != "save":
        ckpt.wait()
    os.write(w, b"D")                           # finished: wait to be killed
    time.sleep(3600)


def _committed_and_stale(root: str) -> tuple[list[int], list[str], list[str]]:
    """(steps of the step_* directories, names of step_* dirs without a manifest, .tmp_* names)."""
    steps, torn, stale = [], [], []
    for name in sorted(os.listdir(root)):
        if name.startswith(".tmp_"):
            stale.append(name)
        elif name.startswith("step_"):
            if os.path.isfile(os.path.join(root, name, "manifest.json")):
                steps.append(int(name[len("step_"):]))
            else:
                torn.append(name)
    return steps, torn, stale


def _wait_for_new_save(root: str, timeout_s: float) -> str | None:
    """Poll `root` until a `.tmp_step_*` directory appears that was not there at the call."""
    def tmps():
        try:
            return {n for n in os.listdir(root) if n.startswith(".tmp_step_")}
        except FileNotFoundError:
            return set()
    before = tmps()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        new = tmps() - before
        if new:
            return min(new)
        time.sleep(0.0005)
    return None


def _crash_trial(root: str, trial: int, base_seed: int) -> dict:
    """One SIGKILL trial; asserts every property, returns what happened."""
    seed = base_seed * 1_000_003 + trial
    rng = random.Random(seed)
    mode, keep = MODES[trial % len(MODES)], KEEPS[(trial // 6) % len(KEEPS)]
    strategy = KILL_STRATEGIES[trial % len(KILL_STRATEGIES)]
    if strategy == "uniform":
        delay, extra = rng.uniform(0.0, MAX_KILL_DELAY_S), None
        when = f"{delay * 1e3:.1f} ms after step 1 committed"
    else:
        delay, extra = rng.uniform(0.0, MAX_KILL_DELAY_S / 2), rng.uniform(0.0, MAX_IN_SAVE_DELAY_S)
        when = (f"{extra * 1e3:.1f} ms after the first save that started {delay * 1e3:.1f} ms "
                "after step 1 committed")
    ctx = f"trial {trial} (seed {seed}, base seed {base_seed}): mode={mode} keep={keep} SIGKILL {when}"
    os.makedirs(root)
    pid, r = _fork(_train_and_save, root, mode, keep, seed)
    try:
        got = _read_until(r, b"R", READY_TIMEOUT_S)
        if not got.startswith(b"R"):                 # b"E" + traceback, EOF, or nothing in time
            status = _kill_and_reap(pid)
            pytest.fail(f"{ctx}: the child never committed step 1 (wait status {status}): "
                        f"{(got + _read_rest(r)).decode(errors='replace')}")
        time.sleep(delay)
        if extra is not None:
            started = _wait_for_new_save(root, READY_TIMEOUT_S)
            ctx += f" ({started or 'no new save seen'})"
            time.sleep(extra)
        status = _kill_and_reap(pid)
        rest = _read_rest(r)
    finally:
        os.close(r)
        with contextlib.suppress(ChildProcessError):
            _kill_and_reap(pid)
    assert b"E" not in rest, f"{ctx}: the child failed: {rest.decode(errors='replace')}"
    finished = b"D" in rest
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{ctx}: status {status}"

    steps, torn, stale = _committed_and_stale(root)
    assert not torn, f"{ctx}: step directories without a manifest are visible: {torn}"
    assert steps, f"{ctx}: no committed checkpoint although step 1 was committed before the kill"
    newest = steps[-1]
    latest = ck.latest_step(root)
    assert latest in steps and latest >= newest - 1, f"{ctx}: latest_step {latest}, committed {steps}"
    manifest = ck.read_manifest(root)
    assert os.path.basename(manifest.path) == f"step_{latest:08d}" and manifest.step == latest, ctx
    for s in steps:
        problems = ck.verify(os.path.join(root, f"step_{s:08d}"))
        assert problems == [], f"{ctx}: committed step {s} (of {steps}) is not intact: {problems}"
    assert ck.verify(root) == [], ctx
    _EXPECTED.at(newest)
    for s, where in {(newest, os.path.join(root, f"step_{newest:08d}")), (latest, root)}:
        loaded = _digest(ck.load(where, _EXPECTED.like))
        want = _EXPECTED.at(s)
        bad = sorted(p for p in want if loaded.get(p) != want[p]) + sorted(set(loaded) - set(want))
        assert not bad, f"{ctx}: step {s} loaded from {where} differs from the trained state at {bad[:5]}"
        want_user_data = {"step": s, "trial_seed": seed} if mode == "save" else None
        assert ck.read_manifest(where).user_data == want_user_data, ctx
    tmp_steps = [n for n in stale if n.startswith(".tmp_step_")]
    manifest_in_tmp = any(os.path.isfile(os.path.join(root, n, "manifest.json")) for n in tmp_steps)
    for name in tmp_steps:
        n = int(name[len(".tmp_step_"):])
        assert n > newest, f"{ctx}: a temporary {name} for a step at or below the newest committed {newest}"
        with pytest.raises(ck.CheckpointError, match="uncommitted"):
            ck.load(os.path.join(root, name), _EXPECTED.like)
    # the next save removes every stale temporary
    nxt = ck.save(root, ck.load(root, _EXPECTED.like), step=MAX_STEPS + 1)
    _, torn2, stale2 = _committed_and_stale(root)
    assert not stale2 and not torn2, f"{ctx}: after the next save: stale {stale2}, torn {torn2}"
    assert ck.latest_step(root) == MAX_STEPS + 1 and ck.verify(nxt) == [], ctx
    shutil.rmtree(root)
    return {"mode": mode, "strategy": strategy, "mid_save": bool(tmp_steps), "finished": finished,
            "lagging": latest != newest, "manifest_in_tmp": manifest_in_tmp, "newest": newest}


def _run_crash_trials(base: str, n: int, base_seed: int) -> list[dict]:
    out = [_crash_trial(os.path.join(base, f"trial_{i:05d}"), i, base_seed) for i in range(n)]
    mid = sum(o["mid_save"] for o in out)
    aimed = [o for o in out if o["strategy"] == "in_save"]
    mid_aimed = sum(o["mid_save"] for o in aimed)
    summary = (f"{n} trials (base seed {base_seed}): {mid} killed inside a save (.tmp_step_* left; "
               f"{mid_aimed} of the {len(aimed)} aimed at a save), "
               f"{sum(o['finished'] for o in out)} finished before the kill, "
               f"{sum(o['manifest_in_tmp'] for o in out)} between the manifest and the rename, "
               f"{sum(o['lagging'] for o in out)} with `latest` one step behind the newest commit; "
               f"newest committed steps {sorted({o['newest'] for o in out})}")
    print(summary)
    assert mid >= MIN_MID_SAVE_FRACTION * n, "too few kills landed inside a save: " + summary
    assert mid_aimed >= MIN_AIMED_MID_SAVE_FRACTION * len(aimed), "too few aimed kills hit a save: " + summary
    assert not any(o["finished"] for o in out), "a child finished all its steps before the kill: " + summary
    return out


def test_sigkill_during_saves_never_leaves_a_torn_checkpoint(tmp_path):
    t0 = time.perf_counter()
    _run_crash_trials(str(tmp_path), CRASH_TRIALS, CRASH_SEED)
    print(f"{CRASH_TRIALS} SIGKILL trials in {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_sigkill_soak(tmp_path):
    """The same property over SOAK_TRIALS (DSFN_SOAK_TRIALS, default 1000) kills."""
    _run_crash_trials(str(tmp_path), SOAK_TRIALS, SOAK_SEED)


# -- 2 ranks: helpers ------------------------------------------------------------------------------
ZERO_SIZES = [6, 10, 3]          # odd parameter counts: FlatShard pads, both ranks own slices
ZERO_BATCHES = regression_batches(3, 8, 6, 3, seed=3)


def _zero_model(stage=None):
    apply_fn, params = dsfn.functionalize(make_mlp(ZERO_SIZES, 0))
    step = dsfn.compose(*([shard_zero(stage)] if stage is not None else []))(train_step_for(apply_fn))
    return step, params, dsfn.optim.adamw(lr=1e-2)


def _logical_leaves(state) -> list:
    """(path, tensor) of a single-process (logical) state, optimizer closures left out."""
    return tree.leaves_with_path(state.replace(tx=None))


def _same(a: list, b: list) -> list[str]:
    """Paths where two (path, tensor) lists differ (bitwise); [] when identical."""
    if [p for p, _ in a] != [p for p, _ in b]:
        return [f"paths differ: {[p for p, _ in a]} vs {[p for p, _ in b]}"]
    return [p for (p, x), (_, y) in zip(a, b) if x.dtype != y.dtype or not torch.equal(x, y)]


def _single_like():
    step, params, tx = _zero_model()
    return step.init_state(params, tx)


# -- 2. a flipped byte in rank 1's file ----------------------------------------------------------
def _save_zero3(root):
    init_mesh()
    step, params, tx = _zero_model(3)
    state = step.init_state(params, tx)
    state, _ = step(state, ZERO_BATCHES[0])
    ck.save(root, state)
    return tree.leaves_with_path(step.gather(state).replace(tx=None))


def _load_zero3(root):
    init_mesh()
    step, params, tx = _zero_model(3)
    try:
        ck.load(root, step.init_state(params, tx))
        return "loaded"
    except ck.CheckpointError as e:
        return f"CheckpointError: {e}"


def _flip_byte(path: str, rng: random.Random, where: str) -> tuple[int, str]:
    """XOR one byte of a safetensors file's tensor data with 0xFF: anywhere after the header
    (`where="anywhere"`) or inside one of its `params.*` tensors (`"params"`). Returns the
    offset and the tensor it lies in (from the file's safetensors header)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        spans = {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                 for k, v in header.items() if k != "__metadata__"}
        if where == "params":
            name = rng.choice(sorted(k for k, (a, b) in spans.items() if k.startswith("params.") and b > a))
            off = rng.randrange(*spans[name])
        else:
            off = rng.randrange(8 + n, os.fstat(f.fileno()).st_size)
            name = next((k for k, (a, b) in spans.items() if a <= off < b), "(between tensors)")
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    return off, name


@pytest.mark.filterwarnings("ignore:.*random generator:UserWarning")   # 2 ranks' RNG, loaded by 1
@pytest.mark.parametrize(("where", "seed"), [("params", 11), ("anywhere", 0), ("anywhere", 5), ("anywhere", 11)])
def test_flipped_byte_in_rank1_file_is_named_by_verify_and_load(tmp_path, where, seed):
    root = str(tmp_path)
    saved = run_on_ranks(_save_zero3, 2, root, timeout=90)[0]
    step_dir = os.path.join(root, "step_00000001")
    files = sorted(ck.read_manifest(root).files)
    assert files == ["rank_00000.safetensors", "rank_00001.safetensors"], files
    assert ck.verify(root) == []
    assert not _same(_logical_leaves(ck.load(root, _single_like())), saved)

    victim = os.path.join(step_dir, "rank_00001.safetensors")
    off, tensor = _flip_byte(victim, random.Random(seed), where)
    ctx = f"byte {off} ({tensor}) of {victim} flipped (seed {seed})"
    problems = ck.verify(root)
    assert problems and all("rank_00001.safetensors" in p for p in problems), f"{ctx}: {problems}"
    assert not any("rank_00000" in p for p in problems), f"{ctx}: {problems}"
    # in its own layout rank 1 reads all of its file (its slices, its generator states)
    msgs = run_on_ranks(_load_zero3, 2, root, timeout=90)
    assert msgs[1].startswith("CheckpointError") and "rank_00001.safetensors" in msgs[1], \
        f"{ctx}: rank 1's load: {msgs[1]}"
    assert msgs[0] == "loaded" or "rank_00001.safetensors" in msgs[0], f"{ctx}: rank 0's load: {msgs[0]}"
    if where == "params":          # a single process reads every params slice
        with pytest.raises(ck.CheckpointError, match=r"rank_00001\.safetensors"):
            ck.load(root, _single_like())

    _flip_byte(victim, random.Random(seed), where)          # the same byte back
    assert ck.verify(root) == []
    assert not _same(_logical_leaves(ck.load(root, _single_like())), saved)


# -- 3. a rank dying mid-save ----------------------------------------------------------------------
RANK_MARGIN_S = 5.0
RANKS_DEADLINE_S = 90.0          # the whole 2-rank run, start-up included


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "DSFN_FORCE_CPU": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _fork_ranks(fn, world: int, *args, needed=(0,), deadline_s: float = RANKS_DEADLINE_S) -> tuple[dict, dict, dict]:
    """Run `fn(rank, *args)` on `world` forked gloo ranks that meet at a TCPStore hosted here.

    Unlike run_on_ranks, a rank that dies does not stop the others. Waits (at most
    `deadline_s`) for the ranks in `needed` to report or die, then gives every rank a moment
    to exit and SIGKILLs what is left (a frozen rank, a hung one). Returns
    ({rank: ("ok", value) | ("error", traceback)} for the ranks that reported, {rank: wait status},
    {rank: its /proc state letter ("T": stopped) for the ranks that had to be killed})."""
    from torch.distributed import TCPStore

    pids, result_fds, port_fds = [], [], []
    store = None
    try:
        for rank in range(world):
            pr, pw = os.pipe()

            def body(w, rank=rank, pr=pr):
                port = int(os.read(pr, 32).decode())
                os.environ.update(_rank_env(rank, world, port))
                from dsfn.runtime import env
                env.init_distributed(timeout_s=60)
                try:
                    out = ("ok", fn(rank, *args))
                except BaseException:  # noqa: BLE001 (reported to the parent)
                    out = ("error", traceback.format_exc())
                data = pickle.dumps(out)
                view = memoryview(b"P" + data)
                while view:
                    view = view[os.write(w, view):]

            pid, r = _fork(body)
            os.close(pr)
            pids.append(pid)
            result_fds.append(r)
            port_fds.append(pw)
        # started after the forks, so no child holds a copy of its server thread
        store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                         wait_for_workers=False)
        for pw in port_fds:
            with contextlib.suppress(OSError):
                os.write(pw, str(store.port).encode())
        bufs = {r: b"" for r in range(world)}
        open_fds = dict(enumerate(result_fds))
        deadline = time.monotonic() + deadline_s
        while any(r in open_fds for r in needed) and time.monotonic() < deadline:
            ready, _, _ = select.select(list(open_fds.values()), [], [], max(0.0, deadline - time.monotonic()))
            for rank, fd in list(open_fds.items()):
                if fd in ready:
                    chunk = os.read(fd, 1 << 20)
                    if chunk:
                        bufs[rank] += chunk
                    else:
                        del open_fds[rank]
        statuses, leftover = {}, {}
        for rank, pid in enumerate(pids):
            end = time.monotonic() + (5.0 if rank in needed else 0.5)
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done or time.monotonic() > end:
                    break
                time.sleep(0.02)
            if not done:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        leftover[rank] = f.read().rsplit(") ", 1)[1][:1]
                except OSError:
                    leftover[rank] = "?"
                status = _kill_and_reap(pid)
            statuses[rank] = status
        results = {}
        for rank, b in bufs.items():
            if b.startswith(b"P"):
                results[rank] = pickle.loads(b[1:])
            elif b.startswith(b"E"):
                results[rank] = ("error", b[1:].decode(errors="replace"))
        return results, statuses, leftover
    finally:
        for pid in pids:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                _kill_and_reap(pid)
        for fd in result_fds + port_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        del store


def _die_in_own_fsync(step_no: int, death: str, go_flag: str) -> None:
    """In this process only: the first fsync of this rank's data file for `step_no` cuts the
    file to half its size and then SIGKILLs the process (`death="kill"`: a rank dying half-way
    through its write) or SIGSTOPs it (`"freeze"`: a rank that hangs; the parent kills it).

    It first waits for the file `go_flag` (rank 0 is done with the training step): a
    background save runs while the step's last collective (the metrics' all-reduce) may still
    be in flight on rank 0, and a peer dying then fails *that* collective instead of the save."""
    real_fsync = os.fsync
    marker = f".tmp_step_{step_no:08d}"

    def dying_fsync(fd):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if marker in target and os.path.basename(target).startswith("rank_00001"):
            end = time.monotonic() + 30
            while not os.path.exists(go_flag) and time.monotonic() < end:
                time.sleep(0.001)
            os.truncate(target, os.path.getsize(target) // 2)
            os.kill(os.getpid(), signal.SIGKILL if death == "kill" else signal.SIGSTOP)
            time.sleep(3600)                   # never reached
        return real_fsync(fd)
    os.fsync = dying_fsync


def _rank_dies_mid_save(rank: int, root: str, go_flag: str, engine: str, death: str, timeout_s: float) -> dict:
    init_mesh()
    transforms = [shard_zero(3)]
    ckpt = None
    if engine == "async":
        ckpt = async_checkpoint(root, every=1, engine="async", timeout_s=timeout_s)
        transforms.append(ckpt)
    apply_fn, params = dsfn.functionalize(make_mlp(ZERO_SIZES, 0))
    step = dsfn.compose(*transforms)(train_step_for(apply_fn))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    # the target for reading step 1 back: init_state is collective, so made while both live
    like = dsfn.compose(shard_zero(3))(train_step_for(apply_fn)).init_state(params, dsfn.optim.adamw(lr=1e-2))
    state, _ = step(state, ZERO_BATCHES[0])
    if engine == "async":
        ckpt.wait()
    else:
        ck.save(root, state, timeout_s=timeout_s)
    step1_logical = tree.leaves_with_path(step.gather(state).replace(tx=None))
    step1_local = [x.clone() for x in tree.leaves(state.replace(tx=None))]
    if rank == 1:
        _die_in_own_fsync(2, death, go_flag)
    t0 = time.monotonic()
    outcome = "committed"
    try:
        state2, _ = step(state, ZERO_BATCHES[1])      # async: the save of step 2 starts here
        if rank == 0:
            open(go_flag, "w").close()                # rank 1 may die now
        if engine == "async":
            t0 = time.monotonic()                     # the training collectives are behind us
            ckpt.wait()
        else:
            ck.save(root, state2, timeout_s=timeout_s)
    except ck.CheckpointError as e:
        outcome = f"CheckpointError: {e}"
    except Exception as e:  # noqa: BLE001 (reported: any other error type is a failure)
        outcome = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    elapsed = time.monotonic() - t0
    # step 1 in rank 0's own (sharded) layout, read without any collective
    loaded = ck.load(root, like)
    same = all(x.dtype == y.dtype and torch.equal(x, y)
               for x, y in zip(tree.leaves(loaded.replace(tx=None)), step1_local))
    return {"outcome": outcome, "elapsed": elapsed, "latest": ck.latest_step(root), "verify": ck.verify(root),
            "loads_step1_local": same, "step1_logical": step1_logical}


@pytest.mark.filterwarnings("ignore:.*random generator:UserWarning")   # 2 ranks' RNG, loaded by 1
@pytest.mark.parametrize(("engine", "death", "timeout_s"), [
    ("sync", "kill", 10.0), ("async", "kill", 10.0),       # the peer's socket closes: fails at once
    ("sync", "freeze", 3.0), ("async", "freeze", 3.0),     # nothing closes: only the timeout ends it
])
def test_rank_dying_mid_save_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, engine, death, timeout_s):
    root, go_flag = str(tmp_path / "ckpt"), str(tmp_path / "rank0_trained")
    t0 = time.monotonic()
    results, statuses, leftover = _fork_ranks(_rank_dies_mid_save, 2, root, go_flag, engine, death, timeout_s)
    wall = time.monotonic() - t0
    ctx = (f"engine={engine} death={death}, results={ {r: v for r, v in results.items()} }, "
           f"statuses={statuses}, killed by the parent={leftover}, {wall:.1f} s")
    assert os.WIFSIGNALED(statuses[1]) and os.WTERMSIG(statuses[1]) == signal.SIGKILL, ctx
    if death == "kill":
        assert 1 not in leftover, f"rank 1 did not die in its save (the fsync hook never fired?): {ctx}"
    else:
        assert leftover.get(1) == "T", f"rank 1 was not frozen in its save (the fsync hook never fired?): {ctx}"
    assert 1 not in results and 0 not in leftover, ctx
    assert 0 in results and results[0][0] == "ok", f"rank 0 did not report: {ctx}"
    r0 = results[0][1]
    print(f"engine={engine} death={death}: rank 0 failed after {r0['elapsed']:.2f} s: {r0['outcome'][:300]}")
    assert r0["outcome"].startswith("CheckpointError"), f"rank 0's save of step 2: {r0['outcome']}"
    assert r0["elapsed"] < timeout_s + RANK_MARGIN_S, \
        f"rank 0 took {r0['elapsed']:.1f} s to fail (timeout {timeout_s} s): {r0['outcome']}"
    assert r0["latest"] == 1 and r0["verify"] == [] and r0["loads_step1_local"], ctx
    assert os.WIFEXITED(statuses[0]) and os.WEXITSTATUS(statuses[0]) == 0, ctx
    # on disk, seen from here
    assert not os.path.exists(os.path.join(root, "step_00000002")), sorted(os.listdir(root))
    assert os.path.isdir(os.path.join(root, ".tmp_step_00000002")), sorted(os.listdir(root))
    assert ck.latest_step(root) == 1 and ck.verify(root) == []
    loaded = ck.load(root, _single_like())
    assert not _same(_logical_leaves(loaded), r0["step1_logical"])
    with pytest.raises(ck.CheckpointError, match="uncommitted"):
        ck.load(os.path.join(root, ".tmp_step_00000002"), _single_like())
    ck.save(root, loaded, step=3)                                 # the next save cleans up
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000003"]
    assert ck.latest_step(root) == 3 and ck.verify(root) == []
