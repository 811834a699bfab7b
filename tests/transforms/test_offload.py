"""offload("cpu"|"nvme"): optimizer state and master weights live on the host / in files,
the update runs there, and every stack with it equals the same stack without it."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.errors import ConfigError, StackError
from dsfn.runtime import init_mesh, nvme
from dsfn.state.layout import (
    FlatShard,
    Offloaded,
    Placed,
    Replicated,
    gather_tree,
    is_placed,
)
from dsfn.testing import assert_trees_close, assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import (
    assert_matches_reference,
    mse_loss_fp32,
    train_step_for,
)
from dsfn.transforms import clip_grad_norm, compose, loss_scale, mixed_precision, offload, shard_zero
from dsfn.engines.offload import NvmeOffloaded

# ZeRO at 2 ranks vs one process differs by the gradient reduction order (as in test_zero);
# offload itself is checked bitwise against the same stack without it below
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _offl(device, path, host_kernel=True):
    return offload(device, path=path, host_kernel=host_kernel) if device == "nvme" else \
        offload(device, host_kernel=host_kernel)


def _leaves(state):
    return tree.leaves_with_path(state.opt_state, is_leaf=is_placed)


def _files_under(path):
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


# ----------------------------------------------------------------------------------------------
# equals the reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@settings(max_examples=3, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_offload_with_zero_equals_reference(tmp_path_factory, stage, device, sizes, seed):
    """fp32: shard_zero(s) + offload (default host kernel) at 2 ranks equals the
    single-process reference within fp32 rtol 1e-6 (the 2-rank gradient sum is a different
    reduction order than the full batch's, so not bitwise; offload itself is bitwise the stack
    without it: see the tests below)."""
    path = str(tmp_path_factory.mktemp("nvme"))
    sizes = [5, *sizes, 3]
    batches = regression_batches(3, 4, 5, 3, seed=seed)

    def make():
        return [shard_zero(stage, reduce_bucket_size=7), _offl(device, path)]

    assert_matches_reference(make, lambda: make_mlp(sizes, seed), lambda: dsfn.optim.adamw(lr=1e-2),
                             batches, 2, seed=seed, rtol=1e-6, atol=1e-7)
    assert _files_under(path) == []       # files are unlinked once mapped: nothing left behind


def _mp_rank(stage, device, path, seed, mp, host_kernel=False):
    """(offloaded run, same stack without offload): params, opt state, losses, logically.
    With `host_kernel` the offloaded update runs in the fused C++ kernel (its calls counted)."""
    init_mesh()
    from dsfn.ops import cpu_adam
    calls = []
    real = cpu_adam.cpu_adamw_multi_

    def spy(*a, **k):
        calls.append(len(a[0]))
        return real(*a, **k)
    cpu_adam.cpu_adamw_multi_ = spy
    out = []
    for with_offload in (True, False):
        torch.manual_seed(seed)
        apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], seed))
        t = [shard_zero(stage)] + ([_offl(device, path, host_kernel)] if with_offload else []) + \
            ([mixed_precision(torch.bfloat16)] if mp else [])
        step = compose(*t)(train_step_for(apply_fn, mse_loss_fp32))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
        if with_offload:
            off = [x for _, x in _leaves(state) if isinstance(x, Placed) and isinstance(x.layout, Offloaded)]
            # (master weights and) both moments of every parameter (4 params)
            assert len(off) == (12 if mp else 8)
            if device == "nvme":
                assert all(nvme.is_file_backed(x.data, path) for x in off)
        losses = []
        for b in regression_batches(3, 4, 6, 4, seed=seed):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        g = step.gather(state)
        out.append((g.params, g.opt_state, losses))
        if with_offload:
            t[1].close()
    cpu_adam.cpu_adamw_multi_ = real
    return out + [calls]


@pytest.mark.parametrize("stage,device,mp", [(1, "nvme", False), (3, "cpu", False), (1, "nvme", True),
                                           (2, "cpu", True), (3, "nvme", True)])
def test_offload_equals_stack_without_it_bitwise(tmp_path, stage, device, mp):
    """fp32, or bf16 compute with the fp32 master weights offloaded: at 2 ranks, bitwise the
    same losses and logical state as the same stack without offload."""
    for (p, o, losses), (rp, ro, rlosses), calls in run_on_ranks(_mp_rank, 2, stage, device, str(tmp_path), 3, mp,
                                                                 timeout=120):
        assert losses == rlosses and calls == []          # host_kernel=False: torch's arithmetic
        assert_trees_equal(p, rp)
        assert_trees_equal(o, ro)


@pytest.mark.parametrize("stage,device,mp", [(2, "nvme", False), (3, "cpu", True)])
def test_offload_host_kernel_runs_and_matches_within_an_ulp(tmp_path, stage, device, mp):
    """The default host update is the fused C++ AdamW (one call per step over every
    offloaded leaf): moments bitwise, params within an ulp of the run without offload."""
    for (p, o, losses), (rp, ro, rlosses), calls in run_on_ranks(_mp_rank, 2, stage, device, str(tmp_path), 3, mp,
                                                                 True, timeout=120):
        assert calls == [4, 4, 4]                          # 3 steps x the 4 parameters' shards
        assert torch.allclose(torch.tensor(losses), torch.tensor(rlosses), rtol=1e-6, atol=0)
        assert_trees_close(p, rp, rtol=1e-6, atol=1e-8)
        assert_trees_close(o, ro, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------
# layout, residency, the functional contract
# ----------------------------------------------------------------------------------------------

def _single(transforms, sizes=(8, 16, 4), seed=0):
    init_mesh()
    torch.manual_seed(seed)
    apply_fn, params = dsfn.functionalize(make_mlp(list(sizes), seed))
    step = compose(*transforms)(train_step_for(apply_fn))
    return step, step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2), seed=seed))


def test_layouts_mirrored_leaves_offloaded_scalars_not(tmp_path):
    o = offload("nvme", path=tmp_path)
    _step, state = _single([shard_zero(1), o])
    kinds = {p: type(x.layout).__name__ if isinstance(x, Placed) else "plain" for p, x in _leaves(state)}
    # Adam's two moments of the 4 parameters are offloaded; its count and lr (0-dim) are not
    assert sorted(kinds.values()).count("NvmeOffloaded") == 8, kinds
    for p, x in _leaves(state):
        if not isinstance(x, Placed):
            assert x.dim() == 0, p
    for _, x in _leaves(state):
        if isinstance(x, Placed):
            # world 1: a shard of one rank is the whole tensor, so ZeRO lays out nothing (no
            # copies, no gathers) and offload holds the replicated tensor
            assert isinstance(x.layout.inner, Replicated) and not isinstance(x.layout.inner, FlatShard)
            assert nvme.is_file_backed(x.data, str(tmp_path))
    _, cpu_state = _single([offload("cpu")])
    for p, x in _leaves(cpu_state):
        if isinstance(x, Placed):
            assert isinstance(x.layout, Offloaded) and isinstance(x.layout.inner, Replicated)
            assert x.data.device.type == "cpu"
    o.close()


def test_nvme_state_is_not_resident_and_files_hold_it(tmp_path):
    """After a step the offloaded state's pages are out of this process's resident memory
    (per-mapping Rss from /proc/self/smaps), its files map all of it, and its values (read
    back from the files) equal the cpu-offload run's."""
    sizes = (256, 512, 256)          # ~0.26 M params: 1 MiB per moment
    o = offload("nvme", path=tmp_path, subgroup_bytes=256 << 10)
    step, state = _single([o], sizes)
    cstep, cstate = _single([offload("cpu")], sizes)
    batch = {"x": torch.randn(4, 256), "y": torch.randn(4, 256)}
    for _ in range(2):
        state, _ = step(state, batch)
        cstate, _ = cstep(cstate, batch)
    off = [x.data for _, x in _leaves(state) if isinstance(x, Placed)]
    state_bytes = sum(t.numel() * t.element_size() for t in off)
    assert state_bytes > 2 << 20
    maps = nvme.mapped_files(o._store.dir)
    mapped = sum(v["size"] for v in maps.values())
    resident = sum(v["rss"] for v in maps.values())
    assert mapped >= state_bytes                       # the files hold the whole state
    assert resident <= 64 << 10, (resident, state_bytes)   # and almost none of it is resident
    # nor in the page cache: the pages were written to disk and evicted, not left dirty in host memory
    cached = sum(nvme.page_cache_bytes(t) for t in off)
    assert cached <= state_bytes // 8, (cached, state_bytes)
    # the cpu run holds the same bytes in anonymous memory
    assert not any(nvme.is_file_backed(x.data, str(tmp_path)) for _, x in _leaves(cstate) if isinstance(x, Placed))
    assert_trees_equal(gather_tree(state.opt_state), gather_tree(cstate.opt_state))
    assert_trees_equal(state.params, cstate.params)
    # dropping the states frees the mappings (and the disk space: the files were unlinked)
    del state, off
    import gc
    gc.collect()
    assert sum(v["size"] for v in nvme.mapped_files(o._store.dir).values()) == 0
    o.close()
    assert not os.path.exists(o._store.dir)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_old_state_stays_valid(tmp_path, device):
    """No donation: a step never writes its input; stepping from an old state again gives
    the same result."""
    o = _offl(device, tmp_path)
    step, s0 = _single([o])
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    before = tree.map(lambda t: t.clone(), s0.opt_state)
    s1, _ = step(s0, batch)
    s2, _ = step(s1, batch)
    assert_trees_equal(s0.opt_state, before)
    s1b, _ = step(s0, batch)
    assert_trees_equal(s1b.opt_state, s1.opt_state)
    assert_trees_equal(s1b.params, s1.params)
    assert int(s2.step) == 2


def test_skipped_update_keeps_offloaded_leaves(tmp_path):
    """fp16 overflow (loss_scale skips the update): the offloaded leaves are the same objects."""
    o = offload("nvme", path=tmp_path)
    step, s0 = _single([o, mixed_precision(torch.float16), loss_scale(init_scale=2.0**15)])
    batch = {"x": torch.full((4, 8), float("inf")), "y": torch.zeros(4, 4)}
    s1, _m = step(s0, batch)
    assert int(s1.step) == 0
    for (_, a), (_, b) in zip(_leaves(s0), _leaves(s1)):
        if isinstance(a, Placed):
            assert a.data is b.data


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------

def test_checkpoint_roundtrip_nvme_and_plain(tmp_path):
    """save an nvme-offloaded state; load it into the nvme layout (file-backed again) and into
    a layout without offload: the same logical state."""
    o = offload("nvme", path=tmp_path / "nvme")
    step, state = _single([o])
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    state, _ = step(state, batch)
    ck.save(tmp_path / "ck", state.replace(tx=None), step=1)
    like_step, like = _single([offload("nvme", path=tmp_path / "nvme")], seed=7)
    loaded = ck.load(tmp_path / "ck", like.replace(tx=None))
    for (_, x), (_, y) in zip(_leaves(loaded), _leaves(state)):
        if isinstance(y, Placed):
            assert isinstance(x.layout, NvmeOffloaded)
            assert nvme.is_file_backed(x.data, str(tmp_path / "nvme"))
    assert_trees_equal(loaded.opt_state, state.opt_state)
    _plain_step, plain = _single([], seed=7)
    loaded_plain = ck.load(tmp_path / "ck", plain.replace(tx=None))
    assert_trees_equal(loaded_plain.opt_state, step.gather(state).opt_state)
    assert_trees_equal(loaded_plain.params, state.params)
    # training continues from the loaded nvme state as from the saved one
    a, _ = step(state, batch)
    b, _ = like_step(loaded.replace(tx=state.tx), batch)
    assert_trees_equal(a.opt_state, b.opt_state)


def _async_ckpt_rank(root, nvme_path, continue_from):
    """2 ranks, ZeRO-3 + nvme offload (params too) + bf16 master weights + async checkpoints
    every 2 steps; or (continue_from) the same training resumed from a checkpoint into
    ZeRO-2 + cpu offload. Returns the logical state after the 4 batches (or the 2 after the
    resume) and the losses."""
    from dsfn.transforms import async_checkpoint
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))
    batches = regression_batches(4, 4, 6, 4, seed=3)
    if continue_from is None:
        ckpt = async_checkpoint(root, every=2, keep=None)
        t = [shard_zero(3), offload("nvme", params=True, path=nvme_path), mixed_precision(), ckpt]
    else:
        t = [shard_zero(2), offload("cpu"), mixed_precision()]
    step = compose(*t)(train_step_for(apply_fn, mse_loss_fp32))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))
    if continue_from is not None:
        state = ck.load(os.path.join(root, f"step_{continue_from:08d}"), state)
        batches = batches[continue_from:]
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    if continue_from is None:
        ckpt.wait()
    return step.gather(state).replace(tx=None), losses


def test_async_checkpoint_of_nvme_offloaded_zero3_reloads_into_another_layout(tmp_path):
    """async_checkpoint captures file-backed (NVMe) state correctly: the step-2 checkpoint,
    loaded into ZeRO-2 + cpu offload, continues training to bitwise the uninterrupted run's
    state and losses; the step-4 one loaded in one process without offload equals it too."""
    root, path = str(tmp_path / "ck"), str(tmp_path / "nvme")
    full = run_on_ranks(_async_ckpt_rank, 2, root, path, None, timeout=120)
    resumed = run_on_ranks(_async_ckpt_rank, 2, root, path, 2, timeout=120)
    for (state, losses), (rstate, rlosses) in zip(full, resumed):
        assert rlosses == losses[2:]
        assert_trees_equal(rstate.params, state.params)
        assert_trees_equal(rstate.opt_state, state.opt_state)
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))
    plain = compose(mixed_precision())(train_step_for(apply_fn, mse_loss_fp32))
    like = plain.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))
    loaded = plain.gather(ck.load(root, like, restore_rng=False)).replace(tx=None)
    assert int(loaded.step) == 4
    assert_trees_equal(loaded.params, full[0][0].params)
    assert_trees_equal(loaded.opt_state, full[0][0].opt_state)


def test_files_removed_at_process_exit(tmp_path):
    code = ("import torch, dsfn\nfrom dsfn.runtime import init_mesh\nfrom dsfn.transforms import offload\n"
            "from dsfn.testing.models import make_mlp\ninit_mesh()\n"
            "apply_fn, params = dsfn.functionalize(make_mlp([4, 8, 2]))\n"
            f"o = offload('nvme', path={str(tmp_path)!r})\n"
            "step = dsfn.compose(o)(lambda s, b: (s, {}))\n"
            "st = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))\n"
            "import os; print(len(os.listdir(" + repr(str(tmp_path)) + ")))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"          # the store's directory existed while running
    assert os.listdir(tmp_path) == []


def test_store_directory_of_a_killed_process_is_cleaned_by_the_next_store(tmp_path):
    """A SIGKILLed run leaves only its (empty) store directory; the next store on the path
    removes it, and leaves a live process's directory alone."""
    import signal
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nfrom dsfn.runtime import nvme\n"
                              f"s = nvme.FileStore({str(tmp_path)!r})\nprint(s.dir, flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    stale = child.stdout.readline().strip()
    live = nvme.FileStore(tmp_path)
    assert os.path.isdir(stale)                 # its owner is alive: kept
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert os.path.isdir(stale)
    nxt = nvme.FileStore(tmp_path)
    assert not os.path.exists(stale)
    assert sorted(os.listdir(tmp_path)) == sorted({os.path.basename(live.dir), os.path.basename(nxt.dir)})
    live.close()
    nxt.close()


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="path="):
        offload("nvme")
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="not a writable directory"):
        offload("nvme", path=afile / "sub")
    with pytest.raises(ConfigError, match="'cpu' .* 'nvme'"):
        offload("gpu")
    with pytest.raises(ConfigError, match="takes no path"):
        offload("cpu", path=tmp_path)
    with pytest.raises(ConfigError, match="unknown argument"):
        offload("cpu", pinned=True)
    for bad in (0, 1.5, -0.2):
        with pytest.raises(ConfigError, match="cores"):
            offload("cpu", cores=bad)


def test_cores_sets_the_host_kernel_threads(monkeypatch):
    """offload(cores=f) runs the host AdamW with DeepSpeed's cpuadam_cores_perc rule:
    max(1, int(f * cpu_count)) threads, and the same results as with every thread."""
    from dsfn.ops import cpu_adam
    seen = []
    real = cpu_adam.cpu_adam_threads
    monkeypatch.setattr(cpu_adam, "cpu_adam_threads", lambda cores=None: seen.append(cores) or real(cores))
    out = []
    for cores in (0.5, None):
        apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
        step = compose(offload("cpu", cores=cores))(train_step_for(apply_fn, mse_loss_fp32))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
        for b in regression_batches(3, 4, 6, 4, seed=1):
            state, _ = step(state, b)
        out.append(step.gather(state).replace(tx=None))
    assert 0.5 in seen and None in seen
    assert_trees_equal(out[0], out[1])


def test_bad_stacks():
    with pytest.raises(StackError, match="needs\\s+shard_zero\\(3\\)|shard_zero\\(3\\)"):
        compose(shard_zero(2), offload("cpu", params=True))
    with pytest.raises(StackError, match="shard_zero\\(3\\)"):
        compose(offload("cpu", params=True))
    with pytest.raises(StackError, match="inside shard_zero"):
        compose(offload("cpu"), shard_zero(1))
    with pytest.raises(StackError, match="outside mixed_precision"):
        compose(mixed_precision(), offload("cpu"))


def test_disk_full_errors_before_any_state_changes(tmp_path, monkeypatch):
    o = offload("nvme", path=tmp_path)
    step, s0 = _single([o])
    batch = {"x": torch.randn(4, 8), "y": torch.randn(4, 4)}
    before = tree.map(lambda t: t.clone(), s0)

    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nvme, "_fallocate", full)
    with pytest.raises(nvme.NvmeSpaceError, match="no space"):
        step(s0, batch)
    with pytest.raises(nvme.NvmeSpaceError):
        _single([offload("nvme", path=tmp_path)])
    assert_trees_equal(s0.opt_state, before.opt_state)
    assert_trees_equal(s0.params, before.params)
    monkeypatch.undo()
    s1, _ = step(s0, batch)               # the state is still good
    assert int(s1.step) == 1


# ----------------------------------------------------------------------------------------------
# overlap (SuperOffload-style speculation)
# ----------------------------------------------------------------------------------------------

def _overlap_rank(stage, device, path, mp, fp16_overflow, clip=False, simulated=True):
    """Both runs' results; `simulated`: the overlap run's host shards are taken as device ones
    (a `SimulatedCopyEngine` stages them: the pipeline and the speculation run), else it is
    CPU training (no device: nothing to overlap with, nothing speculated)."""
    from dsfn.runtime.host_copies import SimulatedCopyEngine
    init_mesh()
    out = []
    for overlap in (True, False):
        apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))
        kw = dict(path=path) if device == "nvme" else {}
        o = offload(device, overlap=overlap, cores=0.5 if overlap else None, **kw)
        if overlap and simulated:
            o._session.pipe.engine = SimulatedCopyEngine()
        t = [shard_zero(stage, reduce_bucket_size=16), o]
        if mp:
            t.append(mixed_precision(torch.float16 if fp16_overflow else torch.bfloat16))
        if fp16_overflow:
            t.append(loss_scale(init_scale=2.0 ** 17, hysteresis=1))     # overflows first, then trains
        if clip:
            t.append(clip_grad_norm(0.05))
        step = compose(*t)(train_step_for(apply_fn, mse_loss_fp32))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))
        losses = []
        for b in regression_batches(6, 4, 6, 4, seed=1):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        g = step.gather(state)
        s = o._session
        out.append((g.params, g.opt_state, losses,
                    (s.started, s.hits, s.misses, int(state.step), s.pipe.items, s.reused) if s else None))
        o.close()
    return out


@pytest.mark.parametrize("world,stage,device,mp,fp16,clip", [
    (2, 3, "cpu", False, False, False), (2, 2, "nvme", True, False, False), (2, 3, "nvme", True, False, False),
    (2, 2, "cpu", True, True, False), (2, 3, "cpu", True, True, False), (2, 1, "cpu", True, False, False),
    (2, 2, "cpu", True, False, True),
    # world 1: ZeRO lays out and reduces nothing; offload's own source feeds the pipeline
    (1, 3, "cpu", False, False, False), (1, 2, "cpu", False, False, False), (1, 2, "cpu", True, False, False),
    (1, 3, "nvme", True, False, False), (1, 2, "cpu", True, True, False), (1, 3, "cpu", True, True, False),
    (1, 3, "cpu", True, False, True)])
def test_overlap_is_bitwise_the_plain_offloaded_run(tmp_path, world, stage, device, mp, fp16, clip):
    """Speculative host updates (started as gradient shards are reduced, or at world 1 as
    backward makes the gradients, from what the inner transforms will make of them: master
    cast, unscaling) are used only when their inputs are exactly the real ones: results equal
    overlap=False bitwise. An fp16 overflow skips the step (its speculations are discarded),
    the steps after it hit. With clipping nothing is speculated: the update waits for the
    global norm (the gradients still leave the device in buckets and are not copied again)."""
    for (p, o, losses, (started, hits, misses, n_updates, items, reused)), (rp, ro, rlosses, _) in run_on_ranks(
            _overlap_rank, world, stage, device, str(tmp_path), mp, fp16, clip, timeout=120):
        assert losses == rlosses
        assert_trees_equal(p, rp)
        assert_trees_equal(o, ro)
        assert items == 6 * len(losses)    # one source: each of the 6 parameters' gradient once a step
        assert reused > 0                  # the update used the buckets' host copies
        if clip:
            assert started == 0 and hits == 0      # no host work wasted on updates that must wait
            continue
        assert started > 0
        if fp16:
            assert 0 < n_updates < 6     # the scripted overflow skipped steps, later ones trained
        assert hits > 0, (started, hits, misses)


@pytest.mark.parametrize("world,stage", [(1, 3), (2, 2)])
def test_overlap_without_a_device_speculates_nothing(tmp_path, world, stage):
    """CPU training (no device, no copy engine): there is nothing to overlap with, so no
    bucket is submitted and nothing is speculated (that work could only run on the training
    thread before the real update, costing more than it): the plain update, bitwise."""
    for (p, o, losses, (started, hits, misses, n_updates, items, _)), (rp, ro, rlosses, _) in run_on_ranks(
            _overlap_rank, world, stage, "cpu", str(tmp_path), True, False, False, False, timeout=120):
        assert losses == rlosses
        assert_trees_equal(p, rp)
        assert_trees_equal(o, ro)
        assert items == 0 and started == 0 and hits == 0 and misses > 0


def _world1_overlap_run(stage, mp, overlap, events):
    from dsfn.runtime.host_copies import SimulatedCopyEngine
    from dsfn.runtime.syncs import count_host_syncs
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))

    def train_step(state, batch):
        def loss_fn(p, b):
            for k, x in p.items():      # the model's use of each parameter: its gradient is made here
                x.register_hook(lambda g, k=k: events.append(("grad", k)))
            return mse_loss_fp32(apply_fn, p, b)
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        events.append(("backward done", None))
        return state.apply_gradients(grads), {"loss": loss}
    o = offload("cpu", overlap=overlap)
    if overlap:         # a slow simulated device stream: the host shards are staged as device ones
        sess = o._session
        sess.pipe.engine = SimulatedCopyEngine(seconds_per_byte=1e-6, latency=2e-3)
        submit = sess.pipe.submit
        sess.pipe.submit = lambda items: (events.append(("submit", len(items))), submit(items))[1]
    t = [shard_zero(stage, reduce_bucket_size=16), o] + ([mixed_precision(torch.bfloat16)] if mp else [])
    step = compose(*t)(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))
    per_step = []
    for b in regression_batches(4, 4, 6, 4, seed=2):
        events.clear()
        before = (o._session.hits, o._session.misses, o._session.started) if overlap else None
        with count_host_syncs() as syncs:
            state, m = step(state, b)
        after = (o._session.hits, o._session.misses, o._session.started) if overlap else None
        per_step.append((list(events), float(m["loss"]), syncs.total, syncs.background["synchronize"],
                         before and tuple(a - b for a, b in zip(after, before))))
    return per_step, step.gather(state), len(params)


@pytest.mark.parametrize("stage,mp", [(3, False), (2, True), (3, True)])
def test_world1_overlap_buckets_leave_during_backward_and_hit(stage, mp):
    """World 1 (ZeRO reduces nothing, so no reducer reports buckets): offload's own source
    hands each bucket of finished gradients to the pipeline while backward still runs (the
    first bucket is submitted before backward's last gradient is made), the host AdamW of
    every parameter is speculated and used after the first step, host syncs stay <= 3 per
    step (one background event wait per bucket, none on the training thread), and the results
    are bitwise those without overlap."""
    events: list = []
    runs, states, n_params = _world1_overlap_run(stage, mp, True, events)
    plain, pstates, _ = _world1_overlap_run(stage, mp, False, [])
    assert [r[1] for r in runs] == [r[1] for r in plain]
    assert_trees_equal(states.params, pstates.params)
    assert_trees_equal(states.opt_state, pstates.opt_state)
    for i, (ev, _, main_syncs, worker_waits, (hits, misses, started)) in enumerate(runs):
        kinds = [k for k, _ in ev]
        submits = [j for j, k in enumerate(kinds) if k == "submit"]
        grads = [j for j, k in enumerate(kinds) if k == "grad"]
        assert len(grads) == n_params and len(submits) >= 3, ev
        assert submits[0] < grads[-1], ev             # the first bucket left during backward
        assert submits[-1] < kinds.index("backward done"), ev   # the last right after it
        assert sum(n for k, n in ev if k == "submit") == n_params    # every gradient, once
        assert main_syncs <= 3 and worker_waits == len(submits)
        if i > 0:       # after warm-up (the first step leaves the inputs): every leaf speculated and used
            assert (started, hits, misses) == (n_params, n_params, 0), (i, started, hits, misses)


def test_overlap_with_no_bucket_source_is_a_config_error_at_place():
    """With accumulate in the stack a micro-batch's gradient is not the step's, so offload's
    world-1 source stays off; with no ZeRO reducer either (world 1) nothing could ever overlap:
    overlap=True is refused at place (issue 31), not accepted and ignored. The same stack
    without overlap places and trains."""
    from dsfn.runtime.host_copies import SimulatedCopyEngine
    from dsfn.transforms import accumulate
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
    o = offload("cpu", overlap=True)
    o._session.pipe.engine = SimulatedCopyEngine()      # a device to overlap with: still no source
    step = compose(shard_zero(2), accumulate(2), o, mixed_precision(torch.bfloat16))(
        train_step_for(apply_fn, mse_loss_fp32))
    with pytest.raises(ConfigError, match=r"overlap=True\) with accumulate.*drop accumulate or overlap"):
        step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    with pytest.raises(ConfigError, match="overlap=True"):
        step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
    plain = compose(shard_zero(2), accumulate(2), offload("cpu"), mixed_precision(torch.bfloat16))(
        train_step_for(apply_fn, mse_loss_fp32))
    state = plain.init_state(params, dsfn.optim.adamw(lr=1e-2))
    state, _ = plain(state, regression_batches(1, 8, 6, 4, seed=7)[0])


def _overlap_under_whole_reduce(outer):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
    step = compose(outer(), offload("cpu", overlap=True))(train_step_for(apply_fn, mse_loss_fp32))
    try:
        step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("outer", ["data_parallel", "shard_zero(0)"])
def test_overlap_under_a_whole_gradient_all_reduce_is_a_config_error(outer):
    """data_parallel and shard_zero(0) over 2 ranks all-reduce whole gradients and report no
    buckets: overlap=True could never act there, so place refuses it, naming the fix."""
    from dsfn.transforms import data_parallel
    make = data_parallel if outer == "data_parallel" else (lambda: shard_zero(0))
    for msg in run_on_ranks(_overlap_under_whole_reduce, 2, make, timeout=120):
        assert msg is not None and f"under {outer if outer != 'data_parallel' else 'data_parallel()'} over dp=2" in msg
        assert "shard_zero(1|2|3)" in msg


def test_params_true_without_zero3_is_refused_and_with_it_acts_on_one_rank():
    """offload(params=True) streams ZeRO-3's parameters; under shard_zero(2) they would stay where
    they are: refused when composed, not accepted and ignored. Under shard_zero(3) it acts on one
    rank too (ZeRO-Infinity: tests/transforms/test_offload_one_device.py)."""
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
    with pytest.raises(StackError, match=r"params=True.*shard_zero\(3\)"):
        compose(shard_zero(2), offload("cpu", params=True))(train_step_for(apply_fn, mse_loss_fp32))
    step = compose(shard_zero(3), offload("cpu", params=True))(train_step_for(apply_fn, mse_loss_fp32))
    assert step.init_state(params, dsfn.optim.adamw(lr=1e-2)) is not None


def test_options_offload_cannot_use_are_config_errors():
    """subgroup_bytes is NVMe's write granularity (host memory has none); cores sizes the host
    AdamW kernel, which host_kernel=False and non-Adam optimizers never run: each is refused
    (at construction, or at place once the optimizer is known) rather than ignored."""
    with pytest.raises(ConfigError, match=r"device='cpu', subgroup_bytes=1024\).*offload\('nvme'"):
        offload("cpu", subgroup_bytes=1024)
    offload("cpu", subgroup_bytes=64 << 20)         # the default, given: nothing to refuse
    with pytest.raises(ConfigError, match=r"cores=0.5, host_kernel=False"):
        offload("cpu", cores=0.5, host_kernel=False)
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
    step = compose(offload("cpu", cores=0.5))(train_step_for(apply_fn, mse_loss_fp32))
    with pytest.raises(ConfigError, match=r"cores=0.5\).*never runs it"):
        step.init_state(params, dsfn.optim.sgd(lr=1e-2, momentum=0.9))
    with pytest.raises(ConfigError, match="never runs it"):
        step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=1e-2, momentum=0.9)))
    with pytest.raises(ConfigError, match="never runs it"):
        step.init_state(params, dsfn.optim.adamw(lr=1e-2, amsgrad=True))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))      # Adam runs the kernel: accepted
    state, _ = step(state, regression_batches(1, 4, 6, 4, seed=1)[0])


# ----------------------------------------------------------------------------------------------
# params=True: ZeRO-3 parameter shards in host memory too
# ----------------------------------------------------------------------------------------------

def _params_rank(mp, device, root):
    init_mesh()
    out = []
    for params_too in (True, False):
        apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))
        o = offload(device, params=params_too, host_kernel=False, **({"path": root} if device == "nvme" else {}))
        t = [shard_zero(3), o] + ([mixed_precision(torch.bfloat16)] if mp else [])
        step = compose(*t)(train_step_for(apply_fn, mse_loss_fp32))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2, weight_decay=0.1))
        kinds = sorted({type(x.layout).__name__ for x in tree.leaves(state.params, is_leaf=is_placed)
                        if isinstance(x, Placed)})
        if device == "nvme" and params_too:     # every nvme leaf (params and optimizer state) is in a file
            nv = [x for x in tree.leaves(state, is_leaf=is_placed)
                  if isinstance(x, Placed) and type(x.layout).__name__ == "NvmeOffloaded"]
            assert len(nv) == (6 + 12 + (6 if mp else 0)) and all(nvme.is_file_backed(x.data, root) for x in nv)
        losses = []
        for b in regression_batches(3, 4, 6, 4, seed=3):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        kinds_after = sorted({type(x.layout).__name__ for x in tree.leaves(state.params, is_leaf=is_placed)
                              if isinstance(x, Placed)})
        g = step.gather(state)
        out.append((g.params, g.opt_state, losses, kinds, kinds_after))
    return out


@pytest.mark.parametrize("mp,device", [(False, "cpu"), (True, "cpu"), (False, "nvme"), (True, "nvme")])
def test_offload_params_equals_zero3_and_keeps_params_offloaded(tmp_path, mp, device):
    want = ["NvmeOffloaded"] if device == "nvme" else ["Offloaded"]
    for (p, o, losses, kinds, after), (rp, ro, rlosses, rkinds, _) in run_on_ranks(
            _params_rank, 2, mp, device, str(tmp_path), timeout=120):
        assert kinds == after == want and rkinds == ["FlatShard"]
        assert losses == rlosses
        assert_trees_equal(p, rp)
        assert_trees_equal(o, ro)


def _params_ckpt(root):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 7, 4], 0))
    step = compose(shard_zero(3), offload("cpu", params=True))(train_step_for(apply_fn, mse_loss_fp32))
    tx = dsfn.optim.adamw(lr=1e-2)
    state = step.init_state(params, tx)
    batches = regression_batches(4, 4, 6, 4, seed=5)
    for b in batches[:2]:
        state, _ = step(state, b)
    dsfn.checkpoint.save(root, state)
    loaded = dsfn.checkpoint.load(root, like=step.init_state(params, tx))
    kinds = sorted({type(x.layout).__name__ for x in tree.leaves(loaded.params, is_leaf=is_placed)
                    if isinstance(x, Placed)})
    for b in batches[2:]:
        state, _ = step(state, b)
        loaded, _ = step(loaded, b)
    return kinds, step.gather(state).replace(tx=None), step.gather(loaded).replace(tx=None)


def test_offload_params_checkpoint_round_trip(tmp_path):
    for kinds, a, b in run_on_ranks(_params_ckpt, 2, str(tmp_path), timeout=120):
        assert kinds == ["Offloaded"]
        assert_trees_equal(a, b)


def _stream_peak(root, stream):
    """Peak resident growth during one offload('nvme') step: 8 matrices of 1 MiB, 16 MiB of
    Adam moments in files."""
    import ctypes
    import importlib
    import re
    O = importlib.import_module("dsfn.engines.offload")      # offload's machinery: the update's NVMe plan
    init_mesh()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)
    libc.mallopt(-1, 128 << 10)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(8)])
    apply_fn, params = dsfn.functionalize(model)
    o = offload("nvme", path=root, subgroup_bytes=1 << 20)
    step = compose(o)(train_step_for(apply_fn))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-3))
    batch = {"x": torch.randn(4, 512), "y": torch.randn(4, 512)}
    state, _ = step(state, batch)                 # warm-up (code pages, first files)
    plans = []
    real = O.NvmePlan

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            plans.append(self)
    O.NvmePlan = Spy if stream else (lambda *a, **k: None)
    try:
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

        def status(key):
            with open("/proc/self/status") as f:
                return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024
        before = status("VmRSS")
        state, _ = step(state, batch)
        peak = status("VmHWM") - before
    finally:
        O.NvmePlan = real
    o.close()
    return peak, [p.streamed for p in plans]


def test_nvme_update_streams_through_subgroups(tmp_path):
    """The host AdamW writes the new moments straight into their new file, sub-group by
    sub-group (read ahead, released when done): the step's resident peak stays well below
    that of the non-streamed update, which materialises all 16 MiB of new moments first."""
    (peak_s, streamed), = run_on_ranks(_stream_peak, 1, str(tmp_path / "s"), True, timeout=120)
    (peak_n, _), = run_on_ranks(_stream_peak, 1, str(tmp_path / "n"), False, timeout=120)
    assert streamed == [16]                        # mu and nu of the 8 matrices went to their files
    assert peak_s + (8 << 20) <= peak_n, (peak_s, peak_n)


def test_nvme_never_madvises_memory_outside_its_files(tmp_path):
    """release/prefetch refuse anonymous memory (DONTNEED there would zero live heap data)."""
    heap = torch.ones(1 << 16)
    for fn in (nvme.release, nvme.prefetch):
        with pytest.raises(RuntimeError, match="not in an NVMe state file"):
            fn([heap])
    assert bool((heap == 1).all())
    store = nvme.FileStore(tmp_path)
    (t,) = store.store([torch.arange(5000, dtype=torch.float32)])
    nvme.prefetch([t])
    nvme.release([t])                       # inside a state file: fine, and the data stays
    assert torch.equal(t, torch.arange(5000, dtype=torch.float32))
    store.close()


def _full_stack_rank(device, path):
    from dsfn.transforms import accumulate, clip_grad_norm
    init_mesh()
    out = []
    for with_offload in (True, False):
        apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 4], 0))
        off = [_offl(device, path, host_kernel=False)] if with_offload else []
        step = compose(shard_zero(2), accumulate(2), *off, mixed_precision(torch.bfloat16),
                       clip_grad_norm(0.5))(train_step_for(apply_fn, mse_loss_fp32))
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
        losses = []
        for b in regression_batches(3, 8, 6, 4, seed=7):
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        g = step.gather(state)
        out.append((g.params, g.opt_state, losses))
        for t in off:
            t.close()
    return out


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_composes_with_accumulate_and_clipping(tmp_path, device):
    """shard_zero(2), accumulate(2), offload, mixed_precision, clip_grad_norm: bitwise the same
    stack without offload (the update runs on the host after accumulation and clipping)."""
    for (p, o, losses), (rp, ro, rlosses) in run_on_ranks(_full_stack_rank, 2, device, str(tmp_path),
                                                          timeout=120):
        assert losses == rlosses
        assert_trees_equal(p, rp)
        assert_trees_equal(o, ro)


def test_nvme_path_whose_parent_does_not_exist_is_refused(tmp_path):
    """A typo or an unmounted disk is not created (as root it would land on the root disk);
    only the last level of the path may be missing."""
    missing = tmp_path / "not_mounted" / "dsfn"
    with pytest.raises(ConfigError, match="nor its parent"):
        offload("nvme", path=str(missing))
    assert not (tmp_path / "not_mounted").exists()
    t = offload("nvme", path=str(tmp_path / "made"))       # the last level is made
    assert (tmp_path / "made").is_dir()
    t.close()


def test_speculative_host_adamw_leaves_one_core_to_the_training_thread(monkeypatch):
    """overlap=True's host AdamW runs beside the thread feeding the device: by default on
    torch's threads but one (issue 24: host threads = the cores not feeding the GPU)."""
    from dsfn.ops.cpu_adam import cpu_adam_threads
    from dsfn.engines.offload import cores_beside_training
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    for threads, want in ((16, 15), (8, 7), (2, 1), (1, 1)):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        assert cpu_adam_threads(cores_beside_training()) == want
