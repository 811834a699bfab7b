"""ZeRO-2 and ZeRO-3 over dp around a pipeline over pp: train equal to the single process.

A pipeline interleaves its micro-batches' forwards and backwards (1F1B runs F1 before B0), so
ZeRO's rounds of gradient buckets are backwards, not forwards (`BackwardRounds`): the
buckets here are small (3,000 elements, so a stage's gradients fill several) and each dp rank
runs 4 micro-batches, which is where rounds per forward would close a round before its
gradients came. Llama ties its embedding and head: the first and the last stage hold copies,
whose gradients ZeRO sums over pp after its reduction (`ZeroShards.sum_held_copies`).
ZeRO-3 stores each stage's parameters as FlatShards over the stage's dp ranks (1/(pp*dp) of
the model per rank) and gathers only what the stage runs. SGD-momentum state is compared at
fp32 tolerance; Muon and AdamW through the losses and parameters.
"""
import math

import pytest

import dsfn
from dsfn.runtime import current_mesh, init_mesh
from dsfn.state.layout import FlatShard, Nested, Placed, StageOwned
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.testing.pipelines import PIPELINE_OPTS, assert_runs_equal, pipeline_model
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import clip_grad_norm, pipeline_parallel, remat, shard_zero

BATCHES = token_batches(3, 8, 12, 101, seed=3)
OPTS = PIPELINE_OPTS
BUCKET = 3000


_model = pipeline_model


def _train(family, opt, stage=None, schedule=None, m=4, clip=None, recompute=None):
    """3 steps: (losses, logical state, {param: (layout kind, piece numel)}, pp index); with `stage`, at
    pp 2 x dp 2 with shard_zero(stage) around pipeline_parallel(schedule, m)."""
    model = _model(family)
    if recompute == "hf" and stage is not None:
        model.gradient_checkpointing_enable()
    apply_fn, params = dsfn.functionalize(model)
    ts = [clip_grad_norm(clip)] if clip else []
    if stage is not None:
        init_mesh(dp=2, pp=2)
        ts += [shard_zero(stage, reduce_bucket_size=BUCKET), pipeline_parallel(schedule, m, model=model)]
        ts += [remat()] if recompute == "remat" else []
    step = dsfn.compose(*ts)(train_step_for(apply_fn, lm_loss))
    losses, logical, state = _three_steps(step, params, opt)
    pieces = {k: (type(x.layout).__name__, x.data.numel()) if isinstance(x, Placed) else ("tensor", x.numel())
              for k, x in state.params.items()}
    pp = current_mesh().local_rank("pp") if stage is not None else 0
    return losses, logical, pieces, pp


def _three_steps(step, params, opt):
    """(losses, logical {"params", "opt_state"}, the placed state) of 3 steps of `step`."""
    state = step.init_state(params, OPTS[opt]())
    losses = []
    for b in BATCHES:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    g = step.gather(state)
    return losses, {"params": g.params, "opt_state": g.opt_state}, state


_check = assert_runs_equal


@pytest.mark.parametrize("stage,schedule,family,opt", [
    (2, "1f1b", "llama", "sgd"),          # tied embedding, one stage per rank
    (3, "1f1b", "llama", "sgd"),
    (2, "interleaved", "gpt", "sgd"),     # two stages per rank (loop placement)
    (3, "zbv", "qwen2", "muon"),          # two stages per rank (V placement); Muon maps whole tensors
])
def test_zero2_and_zero3_around_the_pipeline_equal_the_single_process(stage, schedule, family, opt):
    ref = _train(family, opt)
    _check(run_on_ranks(_train, 4, family, opt, stage, schedule, timeout=240), ref, opt)


@pytest.mark.parametrize("recompute,schedule,family", [("remat", "1f1b", "llama"), ("hf", "zbv", "qwen2")])
def test_zero3_around_a_pipeline_that_recomputes_its_layers(recompute, schedule, family):
    """remat() inside the pipeline, or the model's own gradient checkpointing: each stage's
    recompute in backward re-gathers its units (a stage before the last ends its forward early,
    StopForward, which ZeRO-3 takes as a completed forward: its recompute hooks stay)."""
    ref = _train(family, "sgd")
    _check(run_on_ranks(_train, 4, family, "sgd", 3, schedule, recompute=recompute, timeout=240), ref, "sgd")


def test_zero3_stores_each_stage_sharded_over_its_dp_ranks_and_clips_the_global_norm():
    """Each parameter lives on its stage's dp ranks as halves (ZeRO-3 over dp 2 of a StageOwned
    piece) and nowhere else; the tied embedding on both ends. Clipping's norm spans both axes."""
    ref = _train("llama", "sgd", clip=0.05)
    out = run_on_ranks(_train, 4, "llama", "sgd", 3, "1f1b", clip=0.05, timeout=240)
    _check(out, ref, "sgd")
    full = {k: v.numel() for k, v in ref[1]["params"].items()}
    for rank, (_, _, pieces, pp) in enumerate(out):
        for name, (kind, numel) in pieces.items():
            on_stage_0 = name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))
            mine = on_stage_0 if pp == 0 else not on_stage_0 or name == "model.embed_tokens.weight"
            if mine:
                assert kind == "Nested" and numel == math.ceil(full[name] / 2), (rank, name, kind, numel)
            else:
                assert numel == 0, (rank, name, kind, numel)


def test_the_layout_names_a_tied_copy_through_zeros_shard():
    from dsfn.state.layout import held_copies
    tied = StageOwned("pp", (0, 3), (5, 4))
    assert held_copies(tied) is tied
    assert held_copies(Nested(tied, FlatShard("dp", (5, 4)))) is tied
    assert held_copies(StageOwned("pp", (1,), (5, 4))) is None       # one owner: its gradient is whole
    assert held_copies(FlatShard("dp", (5, 4))) is None


def _gathered_bytes(m):
    """ZeRO-3 (dp 2) around a 1F1B pipeline (pp 2) of m micro-batches: (all-gathered bytes over
    dp in the second step, the gathered size of this rank's stage: its pieces x dp x 4 bytes)."""
    from dsfn.runtime.collectives import counters
    init_mesh(dp=2, pp=2)
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(3), pipeline_parallel("1f1b", m, model=model))(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS["sgd"]())
    state, _ = step(state, BATCHES[0])
    counters.reset()
    state, _ = step(state, BATCHES[1])
    stage_bytes = sum(x.data.numel() for x in state.params.values()) * 2 * 4
    return counters.bytes("dp", "all_gather"), stage_bytes


def test_zero3_gathers_each_micro_batchs_stage_once_in_forward_and_once_in_backward():
    """The forwards and backwards of several micro-batches are outstanding at once (their units'
    hooks kept for recomputes): a gatherer acts only for its own micro-batch, so a step gathers
    the stage's units exactly 2 x m times — no unit of another stage (their pieces are empty), no
    re-gather by another micro-batch's gatherer."""
    for m in (2, 4):
        for gathered, stage_bytes in run_on_ranks(_gathered_bytes, 4, m, timeout=240):
            assert gathered == 2 * m * stage_bytes, (m, gathered, stage_bytes)


def _train_hybrid(family):
    """pp 2 x dp 4 (world 8) with hybrid ZeRO-3 around the pipeline: each stage's state sharded
    over groups of 2 of its dp ranks, copies across the 2 groups; 3 steps' losses and state."""
    model = _model(family)
    apply_fn, params = dsfn.functionalize(model)
    init_mesh(dp=4, pp=2)
    step = dsfn.compose(shard_zero(3, shard_group=2, reduce_bucket_size=BUCKET),
                        pipeline_parallel("1f1b", 2, model=model))(train_step_for(apply_fn, lm_loss))
    return _three_steps(step, params, "sgd")[:2]


def test_hybrid_zero3_around_the_pipeline_equals_the_single_process():
    """HSDP (shards over groups of 2 dp ranks, copies across the groups) around a pp-2 pipeline
    at world 8: each bucket's shards are all-reduced across the groups once per step."""
    ref = _train("llama", "sgd")
    _check(run_on_ranks(_train_hybrid, 8, "llama", timeout=300), ref, "sgd")


def _train_zero3_pp_tp(family):
    """dp 2 x pp 2 x tp 2 (world 8): ZeRO-3 around the pipeline, tensor parallel inside each
    stage (each stage's tp pieces sharded over its dp ranks); 3 steps' losses and state."""
    from dsfn.transforms import tensor_parallel
    model = _model(family)
    apply_fn, params = dsfn.functionalize(model)
    init_mesh(dp=2, pp=2, tp=2)
    step = dsfn.compose(shard_zero(3, reduce_bucket_size=BUCKET), pipeline_parallel("1f1b", 2, model=model),
                        tensor_parallel("auto", model=model))(train_step_for(apply_fn, lm_loss))
    return _three_steps(step, params, "sgd")[:2]


def test_zero3_around_a_pipeline_with_tensor_parallel_stages_equals_the_single_process():
    """Every axis > 1: the tied embedding's tp pieces summed over the first and last stage by
    ZeRO (a non-owner's zeros shaped as an owner's tp piece's shard)."""
    ref = _train("llama", "sgd")
    _check(run_on_ranks(_train_zero3_pp_tp, 8, "llama", timeout=300), ref, "sgd")
