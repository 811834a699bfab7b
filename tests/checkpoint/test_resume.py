"""Resume exactness with randomness: a GPT with dropout, a data pipeline that draws from
Python's `random` and numpy, 2 ranks under ZeRO-2 (each rank drawing its own dropout
masks). Train k steps, checkpoint, keep training; then scramble every generator, load the
checkpoint into the same layout and train again: losses and final state are bitwise
those of the uninterrupted run, with the sync and the async engine. Without restoring the
generators (`restore_rng=False`) they differ, so the test sees the dropout stream."""
import random

import numpy as np
import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import async_checkpoint, shard_zero

K, MORE = 3, 3


def _batches():
    return token_batches(K + MORE, 4, 16, 64, seed=3)


def _noisy(batch):
    """A data pipeline with its own randomness (Python and numpy generators)."""
    shift = random.randrange(64) + int(np.random.randint(64))
    return {k: (v + shift) % 64 for k, v in batch.items()}


def _setup(root, engine):
    cfg = GPTConfig.preset("tiny", vocab_size=64, seq_len=16, dropout=0.2)
    apply_fn, params = dsfn.functionalize(GPT(cfg, seed=0))
    ckpt = async_checkpoint(root, every=K, engine=engine)
    step = dsfn.compose(ckpt, shard_zero(2))(train_step_for(apply_fn, lm_loss))
    return step, ckpt, step.init_state(params, dsfn.optim.adamw(lr=1e-2))


def _train(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, _noisy(b))
        losses.append(float(m["loss"]))
    return state, losses


def _scramble(rank):
    torch.manual_seed(1234 + rank)
    random.seed(99 + rank)
    np.random.seed(7 + rank)


def _logical(step, state):
    return {p: x.clone() for p, x in tree.leaves_with_path(step.gather(state).replace(tx=None))}


def _run(root, engine):
    init_mesh()
    rank = torch.distributed.get_rank()
    _scramble(rank)
    step, ckpt, state = _setup(root, engine)
    state, first = _train(step, state, _batches()[:K])          # saves at step K
    ckpt.wait()
    final, rest = _train(step, state, _batches()[K:])
    ckpt.wait()
    out = {"uninterrupted": (rest, _logical(step, final))}
    for restore in (True, False):
        _scramble(rank)
        step, ckpt, like = _setup(root + "/unused", engine)
        loaded = ck.load(f"{root}/step_{K:08d}", like, restore_rng=restore)
        resumed, losses = _train(step, loaded, _batches()[K:])
        out[restore] = (losses, _logical(step, resumed))
    return out


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_resume_with_dropout_is_bitwise_the_uninterrupted_run(tmp_path, engine):
    for rank, out in enumerate(run_on_ranks(_run, 2, str(tmp_path), engine, timeout=180)):
        want_losses, want_state = out["uninterrupted"]
        losses, state = out[True]
        assert losses == want_losses, f"rank {rank}: resumed losses {losses} != uninterrupted {want_losses}"
        for p, x in want_state.items():
            assert torch.equal(state[p], x), f"rank {rank}: {p} differs after the resumed run"
        other, _ = out[False]
        assert other != want_losses, f"rank {rank}: without restoring the generators the run should differ"


def _rng_roundtrip(root):
    init_mesh()
    _scramble(5 + 10 * torch.distributed.get_rank())
    random.gauss(0, 1)                 # Python's cached gaussian is part of its state
    np.random.standard_normal()        # numpy's too
    ck.save(root, {"x": torch.zeros(3)}, step=1)
    want = (torch.rand(4), random.random(), random.gauss(0, 1), float(np.random.standard_normal()))
    _scramble(6)
    ck.load(root, {"x": torch.zeros(3)})
    return want, (torch.rand(4), random.random(), random.gauss(0, 1), float(np.random.standard_normal()))


def test_generators_round_trip_exactly(tmp_path):
    (want, got), = run_on_ranks(_rng_roundtrip, 1, str(tmp_path), timeout=60)
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_rank_files_hold_each_ranks_generators(tmp_path):
    results = run_on_ranks(_rng_roundtrip, 2, str(tmp_path), timeout=60)
    for want, got in results:
        assert torch.equal(want[0], got[0]) and want[1:] == got[1:]
    assert not torch.equal(results[0][0][0], results[1][0][0])     # the ranks' streams differ
    m = ck.read_manifest(tmp_path)
    assert sorted(m.raw["rng"]) == ["0", "1"]
    assert {m.raw["rng"][r]["file"] for r in "01"} == {"rank_00000.safetensors", "rank_00001.safetensors"}
    assert {"torch_cpu", "python", "numpy"} <= set(m.raw["rng"]["1"]["keys"])
