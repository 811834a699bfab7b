"""The checkpoint host cache: a copied capture is a snapshot at the step boundary (in-place
writes afterwards do not reach the checkpoint; references do), the bound is respected in leaf
order, the buffer is reused across saves, and the transform's checkpoints equal the sync
engine's."""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.checkpoint import writer as save_mod
from dsfn.checkpoint.async_engine import AsyncSaver
from dsfn.checkpoint.host_cache import ALIGN, HostCache
from dsfn.errors import CheckpointError, ConfigError
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import train_step_for
from dsfn.transforms import async_checkpoint


def _state(sizes=(6, 10, 3)):
    apply_fn, params = dsfn.functionalize(make_mlp(list(sizes), 0))
    step = dsfn.compose()(lambda s, b: (s, {}))
    return step.init_state(params, dsfn.optim.adamw(lr=1e-2))


def _tensors(state):
    return [x for x in tree.leaves(state) if isinstance(x, torch.Tensor)]


def _save_held(tmp_path, state, cache):
    """Submit a background save while the writer is held back, scribble over every tensor of
    the state in place, then let the save run. Returns the loaded checkpoint's tensors."""
    saver = AsyncSaver(nice=0, cache=cache)
    originals = [t.clone() for t in _tensors(state)]
    with save_mod._save_lock:            # the background save cannot start writing yet
        saver.submit(tmp_path, state, step=1)
        for t in _tensors(state):
            t.add_(1)                    # what an in-place update after the step boundary does
    saver.wait()
    loaded = ck.load(tmp_path, like=state)
    return originals, _tensors(loaded), saver


def test_copy_capture_is_a_snapshot_and_reference_capture_is_not(tmp_path):
    state = _state()
    originals, saved, saver = _save_held(tmp_path / "copy", state, HostCache(None, "copy"))
    assert all(torch.equal(a, b) for a, b in zip(originals, saved))
    assert saver.last_stage.referenced_tensors == 0
    assert saver.last_stage.copied_bytes == sum(t.numel() * t.element_size() for t in originals)

    state = _state()
    originals, saved, saver = _save_held(tmp_path / "ref", state, HostCache(None, "reference"))
    assert all(torch.equal(a + 1, b) for a, b in zip(originals, saved))
    assert saver.last_stage.copied_bytes == 0


def test_auto_capture_references_host_tensors(tmp_path):
    """On host memory `auto` copies nothing: the state is already where the writer reads."""
    state = _state()
    cache = HostCache(None, "auto")
    staged, event, report = cache.stage(state)
    event.wait()
    assert report.copied_tensors == 0 and cache.buffer is None
    assert all(a is b for a, b in zip(_tensors(staged), _tensors(state)))


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=2, max_size=5), frac=st.floats(0, 1.2))
def test_bound_is_respected_in_leaf_order(sizes, frac):
    state = _state(sizes)
    tensors = _tensors(state)
    slots = [(t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for t in tensors]
    bound = int(frac * sum(slots))
    staged, event, report = HostCache(bound, "copy").stage(state)
    event.wait()
    # a prefix of the leaves is copied: the longest whose slots fit in the bound
    k = 0
    while k < len(slots) and sum(slots[:k + 1]) <= bound:
        k += 1
    out = _tensors(staged)
    assert report.copied_tensors == k and report.referenced_tensors == len(tensors) - k
    assert all(o is not t and torch.equal(o, t) for o, t in zip(out[:k], tensors[:k]))
    assert all(o is t for o, t in zip(out[k:], tensors[k:]))
    assert report.copied_bytes <= bound


def test_buffer_is_allocated_once_and_reused(tmp_path):
    cache = HostCache(None, "copy")
    saver = AsyncSaver(nice=0, cache=cache)
    state = _state()
    for s in (1, 2, 3):
        saver.submit(tmp_path, state, step=s)
        ptr = cache.buffer.data_ptr()
    saver.wait()
    assert cache.allocations == 1 and cache.buffer.data_ptr() == ptr
    bigger = _state((6, 40, 3))
    saver.submit(tmp_path, bigger, step=4)
    saver.wait()
    assert cache.allocations == 2            # grew once for the larger state
    assert all(torch.equal(a, b) for a, b in zip(_tensors(ck.load(tmp_path, like=bigger)), _tensors(bigger)))


def test_tied_tensor_is_copied_once():
    w = torch.randn(4, 4)
    state = {"a": w, "b": w, "c": torch.ones(3)}
    staged, event, report = HostCache(None, "copy").stage(state)
    assert report.copied_tensors == 2 and staged["a"] is staged["b"]
    assert torch.equal(staged["a"], w) and staged["a"].data_ptr() != w.data_ptr()


def test_transform_with_copy_capture_equals_sync_engine(tmp_path):
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 3], 0))
    train_step = train_step_for(apply_fn)

    batches = regression_batches(4, 8, 6, 3, seed=2)
    dirs = {}
    for name, kw in {"copy": dict(capture="copy", host_cache_size=1 << 20), "sync": dict(engine="sync")}.items():
        ckpt = async_checkpoint(tmp_path / name, every=2, **kw)
        step = dsfn.compose(ckpt)(train_step)
        state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
        for b in batches:
            state, metrics = step(state, b)
            if name == "copy" and int(state.step) % 2 == 0:
                assert metrics["ckpt_cached_bytes"] > 0
        ckpt.wait()
        dirs[name] = ck.load(tmp_path / name, like=state)
    a, b = (tree.leaves_with_path(dirs[k]) for k in ("copy", "sync"))
    assert [p for p, _ in a] == [p for p, _ in b]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b) if isinstance(x, torch.Tensor))


def test_bad_cache_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="capture"):
        async_checkpoint(tmp_path, every=1, capture="pinned")
    with pytest.raises(ConfigError, match="host_cache_size"):
        async_checkpoint(tmp_path, every=1, host_cache_size=-1)
    with pytest.raises(ConfigError, match="engine='sync'"):
        async_checkpoint(tmp_path, every=1, engine="sync", capture="copy")
    with pytest.raises(CheckpointError, match="capacity"):
        HostCache(1.5)


def test_staging_does_not_wait_for_the_writer(tmp_path):
    """The capture returns while a held writer has not written anything (blocking = copy)."""
    saver = AsyncSaver(nice=0, cache=HostCache(None, "copy"))
    done = threading.Event()
    with save_mod._save_lock:
        saver.submit(tmp_path, _state(), step=1)
        done.set()
        assert saver.busy
    saver.wait()
    assert done.is_set() and ck.read_manifest(tmp_path).step == 1


def test_transform_stores_user_data_of_each_save(tmp_path):
    """`user_data(state)` runs at each save; the manifest of that step holds its result."""
    apply_fn, params = dsfn.functionalize(make_mlp([6, 10, 3], 0))
    train_step = train_step_for(apply_fn)

    position = {"batch": 0}
    ckpt = async_checkpoint(tmp_path, every=2, user_data=lambda s: {"batch": position["batch"], "step": int(s.step)})
    step = dsfn.compose(ckpt)(train_step)
    state = step.init_state(params, dsfn.optim.sgd(lr=0.1))
    for b in regression_batches(4, 8, 6, 3, seed=2):
        position["batch"] += 1
        state, _ = step(state, b)
    ckpt.wait()
    for s in (2, 4):
        m = ck.read_manifest(tmp_path / f"step_{s:08d}")
        assert m.user_data == {"batch": s, "step": s}
    with pytest.raises(ConfigError, match="user_data"):
        async_checkpoint(tmp_path, every=1, user_data={"not": "callable"})
    bad = dsfn.compose(async_checkpoint(tmp_path / "bad", every=1, user_data=lambda s: {"x": object()}))(train_step)
    with pytest.raises(CheckpointError, match="user_data"):
        bad(step.init_state(params, dsfn.optim.sgd(lr=0.1)), regression_batches(1, 8, 6, 3, seed=2)[0])


def test_failed_cache_allocation_is_a_checkpoint_error(monkeypatch):
    from dsfn.checkpoint import host_cache
    state = _state()

    def no_memory(*a, **k):
        raise RuntimeError("simulated: cannot allocate")
    monkeypatch.setattr(host_cache.torch, "empty", no_memory)
    with pytest.raises(CheckpointError, match="host_cache_size"):
        HostCache(None, "copy").stage(state)
