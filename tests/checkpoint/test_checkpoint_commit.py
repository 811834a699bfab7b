"""Atomic commit, stale temporaries, retention, checksums and bad input."""
import json
import os

import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.errors import DsfnError
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import train_step_for
from dsfn.transforms import shard_zero

# the package re-exports the function `save`, which shadows the submodule's attribute
from dsfn.checkpoint import writer as save_mod


def _setup(stage=None):
    apply_fn, params = dsfn.functionalize(make_mlp([4, 5, 2], 0))
    step = dsfn.compose(*([shard_zero(stage)] if stage is not None else []))(train_step_for(apply_fn))
    tx = dsfn.optim.adamw(lr=1e-2)
    return step, step.init_state(params, tx)


def _train(step, state, n, seed=0):
    for b in regression_batches(n, 4, 4, 2, seed=seed):
        state, _ = step(state, b)
    return state


def _equal(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))


def test_roundtrip_single_process_with_user_data(tmp_path):
    step, like = _setup()
    state = _train(step, like, 3)
    out = ck.save(tmp_path, state, user_data={"epoch": 1, "cursor": [3, 4]})
    assert os.path.basename(out) == "step_00000003" and ck.latest_step(tmp_path) == 3
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert _equal(ck.load(tmp_path, like), state)
    assert _equal(ck.load(out, like), state)
    assert ck.read_manifest(tmp_path).user_data == {"epoch": 1, "cursor": [3, 4]}
    for f in os.listdir(out):   # no pickle: only JSON and safetensors
        assert f == "manifest.json" or f.endswith(".safetensors")


def test_crash_before_rename_leaves_previous_checkpoint(tmp_path, monkeypatch):
    step, like = _setup()
    s1 = _train(step, like, 1)
    ck.save(tmp_path, s1)
    s2 = _train(step, s1, 1, seed=5)

    def crash(*a, **k):
        raise OSError("simulated crash between writing the files and the rename")
    monkeypatch.setattr(save_mod, "commit", crash)
    with pytest.raises(ck.CheckpointError, match="simulated crash"):
        ck.save(tmp_path, s2)
    assert ck.latest_step(tmp_path) == 1
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert (tmp_path / ".tmp_step_00000002").is_dir()          # the torn save is only a temporary
    assert _equal(ck.load(tmp_path, like), s1)
    with pytest.raises(ck.CheckpointError, match="uncommitted"):
        ck.load(tmp_path / ".tmp_step_00000002", like)
    monkeypatch.undo()
    ck.save(tmp_path, _train(step, s2, 1, seed=6))                 # the next save cleans the temporary
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001", "step_00000003"]
    assert ck.latest_step(tmp_path) == 3


def test_host_memory_running_out_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that runs out of host memory while its tensors are written (MemoryError half-way
    through a file) fails naming it, and the checkpoint written before it still loads bitwise:
    the torn files are only a temporary, never `latest`."""
    from dsfn.runtime import sfio
    step, like = _setup()
    s1 = _train(step, like, 1)
    ck.save(tmp_path, s1)
    real = sfio.write_file

    def out_of_memory(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)                   # a half-written file
        raise MemoryError("simulated: no host memory left for the next tensor")
    monkeypatch.setattr(sfio, "write_file", out_of_memory)
    with pytest.raises((ck.CheckpointError, MemoryError), match="no host memory"):
        ck.save(tmp_path, _train(step, s1, 1, seed=5))
    monkeypatch.setattr(sfio, "write_file", real)
    assert ck.latest_step(tmp_path) == 1
    assert _equal(ck.load(tmp_path, like), s1)


def test_crash_after_rename_before_latest_still_loads_newest_committed(tmp_path, monkeypatch):
    step, like = _setup()
    s1 = _train(step, like, 1)
    ck.save(tmp_path, s1)
    s2 = _train(step, s1, 1, seed=5)
    monkeypatch.setattr(save_mod, "write_latest", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(ck.CheckpointError):
        ck.save(tmp_path, s2)
    # `latest` still names step 1, which is committed and loads
    assert ck.latest_step(tmp_path) == 1 and _equal(ck.load(tmp_path, like), s1)


def test_retention_keeps_newest(tmp_path):
    step, state = _setup()
    for i in range(5):
        state = _train(step, state, 1, seed=i)
        ck.save(tmp_path, state, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000004", "step_00000005"]
    # retention orders by step number, and never deletes the checkpoint `latest` names:
    # an older step saved last survives beside the highest one
    ck.save(tmp_path, state, step=3, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000003", "step_00000005"]
    assert ck.latest_step(tmp_path) == 3
    with pytest.raises(ck.CheckpointError, match="keep"):
        ck.save(tmp_path, state, keep=0)


def test_resave_same_step_replaces(tmp_path):
    step, like = _setup()
    s1 = _train(step, like, 1)
    ck.save(tmp_path, s1, step=7)
    s2 = _train(step, s1, 1, seed=3)
    ck.save(tmp_path, s2, step=7)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000007"]
    assert _equal(ck.load(tmp_path, like), s2)


def test_corrupt_byte_names_the_file(tmp_path):
    step, like = _setup()
    out = ck.save(tmp_path, _train(step, like, 1))
    f = os.path.join(out, "rank_00000.safetensors")
    with open(f, "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ck.CheckpointError, match="rank_00000.safetensors") as e:
        ck.load(tmp_path, like)
    assert isinstance(e.value, DsfnError) and "corrupt" in str(e.value)


def test_bad_input_errors(tmp_path):
    step, like = _setup()
    with pytest.raises(ck.CheckpointError, match="not a directory"):
        ck.load(tmp_path / "nope", like)
    with pytest.raises(ck.CheckpointError, match="no committed checkpoint"):
        ck.load(tmp_path, like)
    out = ck.save(tmp_path, _train(step, like, 1))
    # a model of another shape
    _, other = dsfn.functionalize(make_mlp([4, 6, 2], 0))
    with pytest.raises(ck.CheckpointError, match=r"params\.layers\.0\.bias.*shape"):
        ck.load(tmp_path, step.init_state(other, dsfn.optim.adamw(lr=1e-2)))
    # another dtype
    with pytest.raises(ck.CheckpointError, match=r"leaf 'params\.layers\.0\.bias' has dtype"):
        ck.load(tmp_path, like.replace(params=tree.map(lambda p: p.double(), like.params)))
    # a leaf the checkpoint lacks
    with pytest.raises(ck.CheckpointError, match="no leaf 'extra.cursor'"):
        ck.load(tmp_path, like.replace(extra={"cursor": torch.zeros(2)}))
    # a missing rank file
    os.rename(os.path.join(out, "rank_00000.safetensors"), os.path.join(out, "moved"))
    with pytest.raises(ck.CheckpointError, match="rank_00000.safetensors is missing"):
        ck.load(tmp_path, like)
    os.rename(os.path.join(out, "moved"), os.path.join(out, "rank_00000.safetensors"))
    # a manifest from the future
    mpath = os.path.join(out, "manifest.json")
    with open(mpath) as fh:
        m = json.load(fh)
    m["version"] = 99
    with open(mpath, "w") as fh:
        json.dump(m, fh)
    with pytest.raises(ck.CheckpointError, match="version 99"):
        ck.load(tmp_path, like)


def test_missing_or_truncated_file_fails_before_anything_is_read(tmp_path, monkeypatch):
    """The file check runs in the validation pass: no data read, no generator touched."""
    from dsfn.checkpoint import reader
    step, like = _setup()
    out = ck.save(tmp_path, _train(step, like, 1))
    f = os.path.join(out, "rank_00000.safetensors")
    opened = []
    real_get = reader.Reader.get
    monkeypatch.setattr(reader.Reader, "get", lambda self, name: opened.append(name) or real_get(self, name))
    before = [t.clone() for t in tree.leaves(like) if isinstance(t, torch.Tensor)]
    rng_before = torch.get_rng_state()
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 1)
    with pytest.raises(ck.CheckpointError, match="truncated or replaced"):
        ck.load(tmp_path, like)
    os.remove(f)
    with pytest.raises(ck.CheckpointError, match="rank_00000.safetensors is missing"):
        ck.load(tmp_path, like)
    assert opened == []
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(a, b) for a, b in zip(before, (t for t in tree.leaves(like) if isinstance(t, torch.Tensor))))


def test_non_json_value_rejected(tmp_path):
    _, like = _setup()
    with pytest.raises(ck.CheckpointError, match="JSON"):
        ck.save(tmp_path, like, user_data={"f": object()})


def _one_rank_fails(root):
    init_mesh()
    step, state = _setup(stage=1)
    state = _train(step, state, 1)
    ck.save(root, state)                               # step 1 commits on both ranks
    state = _train(step, state, 1, seed=2)
    if torch.distributed.get_rank() == 1:
        def boom(*a, **k):
            raise OSError("disk full on rank 1")
        save_mod._write_rank_file = boom
    try:
        ck.save(root, state)
        return "saved"
    except ck.CheckpointError as e:
        return str(e)


def test_one_rank_failing_commits_nothing(tmp_path):
    msgs = run_on_ranks(_one_rank_fails, 2, str(tmp_path), timeout=60)
    assert all("rank 1" in m and "disk full" in m for m in msgs), msgs
    assert ck.latest_step(tmp_path) == 1
    assert not (tmp_path / "step_00000002").exists()


def test_identical_states_give_byte_identical_files(tmp_path):
    step, like = _setup()
    state = _train(step, like, 2)
    a, b = ck.save(tmp_path / "a", state), ck.save(tmp_path / "b", state)
    files_a, files_b = ck.read_manifest(a).files, ck.read_manifest(b).files
    assert files_a == files_b
