"""sequence_parallel with packed rows: several documents per row, position_ids restarting at 0.

Inside Ulysses attention every rank holds the whole sequence for its heads, so the mask
is built there from the whole sequence's position_ids (all-gathered over sp once per
forward): causal, within each document (a document starts where a position is not its
predecessor + 1, HF's rule), and within the sliding window if the layer has one.

Reference: the same documents unpacked — each its own row, right-padded, with an
attention_mask — in one process (and, as a check of the reference, the single-process
packed run, where HF builds the block-diagonal mask itself with use_cache=False). The
first label of every document is -100 (so no target crosses a boundary) and a few more
are ignored, unevenly over the sp slices. fp32, rtol 1e-5, SGD with momentum, 3 steps.
The negative control ignores the document boundaries under sp and differs.
"""
from __future__ import annotations


import pytest
import torch

import dsfn
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm
from dsfn.testing.reference import train_step_for
from dsfn.transforms import compose, remat, sequence_parallel, shard_zero

pytest.importorskip("transformers")
VOCAB = 101
DOCS = [[(7, 9, 8), (5, 11, 8)], [(10, 6, 8), (8, 8, 8)], [(3, 13, 8), (9, 7, 8)]]   # per step, per row: 24 tokens


def packed_batches() -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    for step, rows in enumerate(DOCS):
        t = sum(rows[0])
        ids = torch.randint(0, VOCAB, (len(rows), t), generator=g)
        pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in rows])
        lab = ids.clone()
        lab[pos == 0] = -100                  # no target crosses into the next document
        lab[0, 2 + step] = -100               # a few more, unevenly over the slices
        lab[1, -3:] = -100
        out.append({"input_ids": ids, "labels": lab, "position_ids": pos})
    return out


def unpacked_batches() -> list[dict]:
    """The same documents, one per row, right-padded to the step's longest."""
    out = []
    for b, rows in zip(packed_batches(), DOCS):
        docs = []
        for r, row in enumerate(rows):
            start = 0
            for n in row:
                docs.append((b["input_ids"][r, start:start + n], b["labels"][r, start:start + n]))
                start += n
        t = max(len(d[0]) for d in docs)
        ids = torch.zeros(len(docs), t, dtype=torch.long)
        lab = torch.full((len(docs), t), -100)
        mask = torch.zeros(len(docs), t, dtype=torch.long)
        for i, (x, y) in enumerate(docs):
            ids[i, :len(x)], lab[i, :len(y)], mask[i, :len(x)] = x, y, 1
        out.append({"input_ids": ids, "labels": lab, "attention_mask": mask})
    return out


def packed_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                    use_cache=False).loss


def unpacked_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"],
                    attention_mask=batch["attention_mask"], use_cache=False).loss


def make_model(family):
    """llama: sdpa; gemma2: eager, soft-capping, sliding window 4 on alternate layers;
    mistral: sdpa with a sliding window 5 on every layer (the window and the documents)."""
    return make_tiny_causal_lm(family, **({"sliding_window": 4} if family == "gemma2" else {}))


def train(family, mesh=None, packed=True, zero=False, ignore_documents=False, checkpointed=False):
    if mesh:
        init_mesh(**mesh)
    if ignore_documents:        # negative control: a plain causal mask over the whole row
        from dsfn.integrations.hf import attention
        attention._documents = lambda ctx, position_ids: (None, None)
    model = make_model(family)
    apply_fn, params = dsfn.functionalize(model)
    stack = ((sequence_parallel(),) + ((shard_zero(3),) if zero else ()) + ((remat(),) if checkpointed else ())
             if mesh else ())
    step = compose(*stack)(train_step_for(apply_fn, packed_loss if packed else unpacked_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.5, momentum=0.9)))
    losses = []
    for b in (packed_batches() if packed else unpacked_batches()):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    s = step.gather(state)
    return losses, {"params": s.params, "opt_state": s.opt_state}


def assert_equal(results, ref):
    for rank, (losses, state) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6, msg=f"rank {rank} state")


def max_diff(results, ref):
    return max(float((a - ref[1]["params"][k]).abs().max()) for k, a in results[0][1]["params"].items())


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
def test_packed_single_process_equals_unpacked(family):
    """The reference is right: HF's own block-diagonal mask equals one document per row."""
    assert_equal([train(family)], train(family, packed=False))


@pytest.mark.parametrize("family,mesh,zero", [
    ("llama", {"sp": 2}, False),
    ("llama", {"sp": 4}, False),
    ("gemma2", {"sp": 2}, False),
    ("mistral", {"sp": 2}, False),
    ("llama", {"dp": 2, "sp": 2}, True),
])
def test_packed_rows_under_sp_equal_the_unpacked_documents(family, mesh, zero):
    world = 1
    for v in mesh.values():
        world *= v
    got = run_on_ranks(train, world, family, mesh, True, zero, timeout=180)
    assert_equal(got, train(family, packed=False))


def test_packed_rows_with_remat_recompute_the_same_mask():
    """remat's recompute in backward re-enters Ulysses attention: the documents found in the
    forward are reused (no all-gather in backward), the result is the same."""
    got = run_on_ranks(train, 2, "llama", {"sp": 2}, True, False, False, True, timeout=180)
    assert_equal(got, train("llama", packed=False))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_negative_control_ignoring_document_boundaries_differs(family):
    ref = train(family, packed=False)
    got = run_on_ranks(train, 2, family, {"sp": 2}, True, False, True, timeout=180)
    assert max_diff(got, ref) > 1e-3


def _explained(mesh, packed):
    init_mesh(**mesh)
    apply_fn, params = dsfn.functionalize(make_model("llama"))
    loss = packed_loss if packed else (lambda f, p, b: f(p, input_ids=b["input_ids"], labels=b["labels"]).loss)
    step = compose(sequence_parallel())(train_step_for(apply_fn, loss))
    batch = packed_batches()[0]
    if not packed:          # no position_ids anywhere: the transform numbers the tokens
        batch = {k: v for k, v in batch.items() if k != "position_ids"}
    return step.explain(step.init_state(params, dsfn.optim.sgd(lr=0.1)), batch).collectives


def test_one_small_all_gather_of_the_position_ids_per_forward():
    """The documents are found once per forward (not per layer), and not at all when the
    transform made the positions itself (consecutive by construction)."""
    packed = run_on_ranks(_explained, 2, {"sp": 2}, True)[0]
    plain = run_on_ranks(_explained, 2, {"sp": 2}, False)[0]
    rows, t = 2, 24
    assert packed[("sp", "all_gather")][0] == plain.get(("sp", "all_gather"), (0, 0))[0] + 1
    assert packed[("sp", "all_gather")][1] == plain.get(("sp", "all_gather"), (0, 0))[1] + rows * t * 8
