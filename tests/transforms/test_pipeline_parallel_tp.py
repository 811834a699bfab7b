"""pipeline_parallel with tensor_parallel and sequence_parallel inside each stage: Megatron's
TP x PP (x DP) trains equal to the single process.

The documented order is compose([sequence_parallel() or context_parallel(),] [shard_zero(1),] pipeline_parallel(...),
tensor_parallel(...)): the pipeline cuts the model into stages, each stage's parameters are split
over its tp group (`Nested(StageOwned("pp"), DimShard("tp"))`: pp rank s's tp group holds the
pieces, the other stages an empty tensor). Models: dsfn's GPT (tied embedding and head, a fused
qkv split per part) and a tiny Llama (tied, its Hugging Face tp plan), 4 layers each. The
reference is the same train step in one process on the whole batch; SGD-momentum state is
compared at fp32 tolerance (rtol 1e-5, atol 1e-6: the tp all-reduces sum in another order),
AdamW / Muon through the losses and the parameters at the same tolerance.
"""
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

import dsfn
from dsfn.engines.pipeline.runner import StageLinks
from dsfn.errors import StackError, UnplacedStateError
from dsfn.models.gpt import tp_plan
from dsfn.runtime import current_mesh, init_mesh
from dsfn.state.layout import DimShard, Nested, PackedDimShard, Placed, StageOwned, is_placed
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import token_batches
from dsfn.testing.pipelines import FP32, PIPELINE_OPTS, pipeline_model
from dsfn.testing.reference import lm_loss
from dsfn.transforms import (async_checkpoint, clip_grad_norm, context_parallel, pipeline_parallel, sequence_parallel,
                             shard_zero, tensor_parallel)

BATCHES = token_batches(3, 8, 12, 101, seed=1)
OPTS = PIPELINE_OPTS


def _model(family):
    return pipeline_model(family, vocab_size=101)


def _tp(model, family):
    return tensor_parallel(tp_plan() if family == "gpt" else "auto", model=model)


def _step_fn(apply_fn):
    """The standard train step, reporting the gradients' global norm too (`dsfn.logical`)."""
    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: lm_loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss, "grad_norm": dsfn.logical.global_norm(grads)}
    return train_step


class _Recorded(StageLinks):
    """StageLinks that keep the global rank each stage was mapped to (the transform's mapping)."""

    seen: list = []

    def __init__(self, rank_of, *a, **k):
        _Recorded.seen.append(list(rank_of))
        super().__init__(rank_of, *a, **k)


def _train(family, opt, mesh=None, outer=(), inner_tp=True, m=4, clip=None):
    """Train 3 steps: (losses, grad norms, logical state, this rank's {param: (layout, piece shape)},
    the global rank of each stage its links used, this rank's mesh coordinates)."""
    if mesh:
        init_mesh(**mesh)
    model = _model(family)
    apply_fn, params = dsfn.functionalize(model)
    ts = list(outer) + ([clip_grad_norm(clip)] if clip else [])
    if mesh:
        ts.append(pipeline_parallel("1f1b", m, model=model))
        if inner_tp and mesh.get("tp", 1) > 1:
            ts.append(_tp(model, family))
    step = dsfn.compose(*ts)(_step_fn(apply_fn))
    # placed with its optimizer state made whole (the mirrors follow their parameters' layouts);
    # the checkpoint test below builds it placed (init_state)
    state = step.place(dsfn.TrainState.create(params, OPTS[opt]()))
    layouts = {k: (x.layout if isinstance(x, Placed) else None, tuple(dsfn.tree.leaves(x)[0].shape))
               for k, x in state.params.items()}
    layouts.update({f"opt_state.{k}": (x.layout, tuple(x.data.shape))          # the optimizer state's mirrors
                    for k, x in dsfn.tree.leaves_with_path(state.opt_state, is_leaf=is_placed)
                    if isinstance(x, Placed)})
    losses, norms = [], []
    _Recorded.seen = []
    with mock.patch("dsfn.transforms.pipeline_parallel.StageLinks", _Recorded):
        for b in BATCHES:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
            norms.append(float(metrics["grad_norm"]))
    g = step.gather(state)
    coords = dict(current_mesh().coords) if mesh else {}
    return losses, norms, {"params": g.params, "opt_state": g.opt_state}, layouts, list(_Recorded.seen), coords


def _check(results, ref, opt):
    for losses, norms, state, *_ in results:
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[0]), **FP32), (losses, ref[0])
        assert torch.allclose(torch.tensor(norms), torch.tensor(ref[1]), **FP32), (norms, ref[1])
        compared = state if opt == "sgd" else {"params": state["params"]}
        expected = ref[2] if opt == "sgd" else {"params": ref[2]["params"]}
        assert_trees_close(compared, expected, **FP32)


def _check_links(results, mesh):
    """Each rank sends to / receives from the rank of the other stage at its own (dp, sp, tp)
    coordinates: stage s's rank differs from this rank only along "pp", where it is s."""
    axes = list(mesh)
    for rank, (*_, seen, coords) in enumerate(results):
        assert seen, f"rank {rank} ran no pipeline"
        for rank_of in seen:
            for s, r in enumerate(rank_of):
                theirs, rest = {}, r
                for a in reversed(axes):           # row-major, the last axis fastest (dsfn.runtime.mesh)
                    theirs[a], rest = rest % mesh[a], rest // mesh[a]
                assert theirs == {**{a: coords[a] for a in axes}, "pp": s}, (rank, coords, s, r, theirs)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_pp2_x_tp2_equals_the_single_process_and_lays_stages_out_over_tp(family):
    ref = _train(family, "sgd")
    mesh = {"pp": 2, "tp": 2}
    out = run_on_ranks(_train, 4, family, "sgd", mesh, timeout=180)
    _check(out, ref, "sgd")
    _check_links(out, mesh)
    layer0 = "blocks.0.mlp.fc.weight" if family == "gpt" else "model.layers.0.mlp.up_proj.weight"
    layer3 = layer0.replace(".0.", ".3.")
    tied = "tok_emb.weight" if family == "gpt" else "model.embed_tokens.weight"
    for rank, (*_, layouts, _seen, coords) in enumerate(out):
        # a stage's parameter: pp rank s's tp group holds DimShard pieces, the other stage nothing
        for name, stage in ((layer0, 0), (layer3, 1)):
            layout, shape = layouts[name]
            assert isinstance(layout, Nested) and layout.inner.owners == (stage,), (name, layout)
            assert isinstance(layout.outer, DimShard) and layout.outer.axis == "tp", layout
            full = layout.shape
            expected = (full[0] // 2, full[1]) if coords["pp"] == stage else (0,)
            assert shape == expected, (rank, name, shape, expected)
        # the tied embedding and head: both ends, each split over its tp group
        layout, shape = layouts[tied]
        assert layout.inner == StageOwned("pp", (0, 1), layout.shape) and shape[0] == -(-layout.shape[0] // 2), layout
        # a parameter tp does not split (a norm) is the stage's whole tensor, StageOwned alone
        norm = "blocks.0.ln1.weight" if family == "gpt" else "model.layers.0.input_layernorm.weight"
        assert isinstance(layouts[norm][0], StageOwned), layouts[norm]


@pytest.mark.parametrize("opt", ["sgd", "muon"])
def test_zero1_pp2_x_tp2_x_dp2_equals_the_single_process(opt):
    """World 8, every axis 2: ZeRO-1 shards each stage's tp pieces over dp (Muon orthogonalises
    each whole matrix: ZeRO rebuilds the tp piece, the pipeline hands it to tp on its stage)."""
    ref = _train("gpt", opt)
    mesh = {"dp": 2, "pp": 2, "tp": 2}
    out = run_on_ranks(_train, 8, "gpt", opt, mesh, [shard_zero(1)], True, 2, timeout=300)
    _check(out, ref, opt)
    _check_links(out, mesh)
    for rank, (*_, layouts, _seen, coords) in enumerate(out):
        # the momentum of a stage-0 qkv: ZeRO's FlatShard over dp of the stage's tp piece
        (layout, shape), = [v for k, v in layouts.items() if k.startswith("opt_state") and
                            k.endswith("blocks.0.attn.qkv.weight")]
        assert isinstance(layout, Nested) and isinstance(layout.inner, Nested), layout
        assert layout.inner.inner == StageOwned("pp", (0,), (192, 64)), layout
        assert isinstance(layout.inner.outer, PackedDimShard) and layout.outer.axis == "dp", layout
        assert shape == ((96 * 64 // 2,) if coords["pp"] == 0 else (0,)), (rank, shape)


def test_pp2_x_tp2_adamw_losses_and_parameters():
    ref = _train("llama", "adamw")
    _check(run_on_ranks(_train, 4, "llama", "adamw", {"pp": 2, "tp": 2}, timeout=180), ref, "adamw")


def test_clip_grad_norm_sees_the_global_norm_over_pp_and_tp():
    """The clip at 0.05 (below the norm: every update is scaled by it) and the reported norm
    equal the single process's: each piece counted once over both axes."""
    ref = _train("gpt", "sgd", clip=0.05)
    out = run_on_ranks(_train, 4, "gpt", "sgd", {"pp": 2, "tp": 2}, clip=0.05, timeout=180)
    assert ref[1][0] > 0.05 * 2, "the clip must bite for the test to see the norm"
    _check(out, ref, "sgd")


@pytest.mark.parametrize("family, tp", [("gpt", 1), ("llama", 1), ("gpt", 2)])
def test_pp2_x_sp2_sends_each_sequence_shard_to_the_same_sp_rank(family, tp):
    """sequence_parallel outside the pipeline: each sp rank's stage sends its own slice of the
    hidden states to the same sp rank of the next stage (and, with tp 2 inside, each tp rank
    to its tp rank: world 8). GPT's attention is AutoSP's, Llama's Hugging Face's."""
    ref = _train(family, "sgd")
    mesh = {"pp": 2, "sp": 2, "tp": tp}
    out = run_on_ranks(_train, 4 * tp, family, "sgd", mesh, [sequence_parallel()], timeout=300)
    _check(out, ref, "sgd")
    _check_links(out, mesh)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_pp2_x_cp2_runs_ring_attention_inside_each_stage(family):
    """context_parallel outside the pipeline: each stage's attention is the ring over its cp
    group (head and tail chunks; the labels, already targets, cut alike: shift_labels=False),
    each cp rank's stage sending its chunks' hidden states to the same cp rank of the next."""
    ref = _train(family, "sgd")
    mesh = {"pp": 2, "cp": 2}
    out = run_on_ranks(_train, 4, family, "sgd", mesh, [context_parallel(shift_labels=False)], timeout=300)
    _check(out, ref, "sgd")
    _check_links(out, mesh)


def test_tensor_parallel_outside_the_pipeline_is_a_stack_error():
    model = _model("gpt")
    apply_fn, _ = dsfn.functionalize(model)
    with pytest.raises(StackError, match=r"tensor_parallel\(\) is outside pipeline_parallel.*"
                                         r"compose\(pipeline_parallel\(\.\.\.\), tensor_parallel\(\.\.\.\)\)"):
        dsfn.compose(_tp(model, "gpt"), pipeline_parallel("1f1b", 4, model=model))(_step_fn(apply_fn))
    with pytest.raises(StackError, match="tensor_parallel\\(\\) is outside pipeline_parallel"):
        dsfn.compose(shard_zero(1), _tp(model, "gpt"), pipeline_parallel("1f1b", 4, model=model))(_step_fn(apply_fn))
    # a negative control: the documented order composes
    dsfn.compose(shard_zero(1), pipeline_parallel("1f1b", 4, model=model), _tp(model, "gpt"))(_step_fn(apply_fn))


# ----------------------------------------------------------------------------------------------
# checkpoints across layouts


def _save(root):
    """pp 2 x tp 2, AdamW, async_checkpoint at step 2; then a third step. (logical state at step
    2, step 3's loss, step 3's parameters)."""
    init_mesh(pp=2, tp=2)
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    ck = async_checkpoint(f"{root}/pptp", every=2)
    step = dsfn.compose(ck, pipeline_parallel("1f1b", 4, model=model), _tp(model, "llama"))(_step_fn(apply_fn))
    state = step.init_state(params, OPTS["adamw"]())
    for b in BATCHES[:2]:
        state, _ = step(state, b)
    ck.wait()
    g = step.gather(state)
    state, metrics = step(state, BATCHES[2])
    return ({"params": g.params, "opt_state": g.opt_state, "step": g.step}, float(metrics["loss"]),
            step.gather(state).params)


def _load(root, tp):
    """The pp2 x tp2 checkpoint loaded at tp `tp` without a pipeline (1: one process), then one
    more step: (logical state loaded, its step's loss, the parameters after it)."""
    if tp > 1:
        init_mesh(tp=tp)
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(*([_tp(model, "llama")] if tp > 1 else []))(_step_fn(apply_fn))
    state = dsfn.checkpoint.load(f"{root}/pptp", like=step.init_state(params, OPTS["adamw"]()), restore_rng=False)
    g = step.gather(state)
    state, metrics = step(state, BATCHES[2])
    return ({"params": g.params, "opt_state": g.opt_state, "step": g.step}, float(metrics["loss"]),
            step.gather(state).params)


def test_a_pp2_x_tp2_checkpoint_reloads_without_the_pipeline_and_continues_equal(tmp_path):
    """Saved at pp 2 x tp 2 (each stage's tp ranks write their pieces; the manifest describes the
    nested layout), loaded bitwise at tp 1 (one process) and tp 2 alone; the next step equals
    the pp2 x tp2 run's next step."""
    saved, loss3, params3 = run_on_ranks(_save, 4, str(tmp_path), timeout=240)[0]
    manifest = json.loads(next(Path(tmp_path, "pptp").rglob("manifest.json")).read_text())
    described = manifest["leaves"]["params.model.layers.3.mlp.up_proj.weight"]["layout"]
    assert described["type"] == "Nested" and described["inner"]["type"] == "StageOwned" \
        and described["inner"]["owners"] == [1] and described["outer"]["type"] == "DimShard", described
    for tp in (1, 2):
        for rank, (got, loss, params) in enumerate(run_on_ranks(_load, tp, str(tmp_path), tp, timeout=240)):
            assert_trees_equal(got, saved, msg=f"pp2 x tp2 checkpoint loaded at tp {tp}, rank {rank}")
            assert abs(loss - loss3) <= 1e-5 * abs(loss3), (tp, loss, loss3)
            assert_trees_close(params, params3, **FP32)


def test_a_state_placed_by_tensor_parallel_alone_is_refused_by_the_pipeline():
    """A state placed for tp 2 only (its pieces on every stage) given to the pp x tp step: an
    UnplacedStateError naming the parameter, not a run on the wrong pieces."""
    def fn():
        init_mesh(pp=2, tp=2)
        model = _model("gpt")
        apply_fn, params = dsfn.functionalize(model)
        tp_only = dsfn.compose(_tp(model, "gpt"))(_step_fn(apply_fn))
        step = dsfn.compose(pipeline_parallel("1f1b", 4, model=model), _tp(model, "gpt"))(_step_fn(apply_fn))
        state = tp_only.init_state(params, OPTS["sgd"]())
        try:
            step(state, BATCHES[0])
        except UnplacedStateError as e:
            return str(e)
        return "ran"
    for text in run_on_ranks(fn, 4, timeout=120):
        assert "pipeline_parallel: parameter" in text and "step.place" in text, text
