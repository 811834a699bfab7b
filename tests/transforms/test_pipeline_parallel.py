"""pipeline_parallel: every schedule trains equal to the single process; parameters live on
their stages; bad input is a named error.

Models: dsfn's GPT (untied), a tiny Llama (tied embedding and head: owned by the first and
the last stage) and Qwen2 (untied, q/k/v biases), 4 layers each so that every schedule,
interleaved and ZBV's 2 stages per rank included, runs at pp 2. The reference is the same
train step in one process, on the whole batch (the pipeline's micro-batches are each scaled
by 1/m: their sum is the whole batch's mean). SGD-momentum state is compared at fp32
tolerance, AdamW and Muon through the losses and parameters.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsfn
from dsfn.engines.pipeline.schedules import Kind, build_schedule
from dsfn.errors import ConfigError, StackError
from dsfn.runtime import current_mesh, init_mesh
from dsfn.state.layout import Placed, StageOwned
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, make_tiny_causal_lm, token_batches
from dsfn.testing.pipelines import PIPELINE_OPTS, assert_runs_equal, pipeline_model
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import accumulate, clip_grad_norm, data_parallel, mixed_precision, pipeline_parallel, shard_zero

BATCHES = token_batches(3, 8, 12, 101, seed=1)
OPTS = PIPELINE_OPTS


_model = pipeline_model


def _train(family, opt, outer=(), mesh=None, schedule=None, m=4, **pp):
    """Train 3 steps: (losses, logical state, {param: its layout's owners or None})."""
    if mesh:
        init_mesh(**mesh)
    model = _model(family)
    apply_fn, params = dsfn.functionalize(model)
    ts = list(outer) + ([pipeline_parallel(schedule, m, model=model, **pp)] if schedule else [])
    step = dsfn.compose(*ts)(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS[opt]())
    losses = []
    for b in BATCHES:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    owners = {k: (x.layout.owners, tuple(x.data.shape)) if isinstance(x, Placed) and isinstance(x.layout, StageOwned)
              else None for k, x in state.params.items()}
    g = step.gather(state)
    return losses, {"params": g.params, "opt_state": g.opt_state}, owners


_check = assert_runs_equal


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv"])
@pytest.mark.parametrize("family", ["gpt", "llama", "qwen2"])
def test_every_schedule_equals_the_single_process(schedule, family):
    ref = _train(family, "sgd")
    _check(run_on_ranks(_train, 2, family, "sgd", (), {"pp": 2}, schedule, timeout=120), ref, "sgd")


@settings(max_examples=4, deadline=None)
@given(case=st.sampled_from([("1f1b", 4, 4), ("1f1b", 4, 8), ("gpipe", 4, 2), ("interleaved", 2, 2), ("zbv", 2, 8)]),
       opt=st.sampled_from(["adamw", "muon"]))
def test_pipeline_sizes_and_microbatches_train_alike(case, opt):
    """pp 2 and 4, 2 to 8 micro-batches, with the Adam-like optimizers."""
    schedule, p, m = case
    ref = _train("llama", opt)
    _check(run_on_ranks(_train, p, "llama", opt, (), {"pp": p}, schedule, m, timeout=180), ref, opt)


def test_parameters_live_on_their_stages_and_a_tied_embedding_on_both_ends():
    out = run_on_ranks(_train, 2, "llama", "sgd", (), {"pp": 2}, "1f1b", timeout=120)
    tied = "model.embed_tokens.weight"
    for rank, (_, _, owners) in enumerate(out):
        assert owners[tied][0] == (0, 1), "the tied embedding and head belong to the first and the last stage"
        assert owners["model.layers.0.self_attn.q_proj.weight"][0] == (0,)
        assert owners["model.layers.3.self_attn.q_proj.weight"][0] == (1,)
        assert owners["model.norm.weight"][0] == (1,)
        for name, (who, shape) in owners.items():     # a stage holds only what it runs
            assert (shape != (0,)) == (rank in who), (rank, name, who, shape)


def test_composes_with_data_parallel_zero1_and_clipping():
    ref = _train("qwen2", "sgd")
    for outer in ([data_parallel()], [shard_zero(1)]):
        _check(run_on_ranks(_train, 4, "qwen2", "sgd", outer, {"dp": 2, "pp": 2}, "1f1b", 2, timeout=180), ref, "sgd")
    clipped = _train("qwen2", "sgd", [clip_grad_norm(0.05)])
    _check(run_on_ranks(_train, 2, "qwen2", "sgd", [clip_grad_norm(0.05)], {"pp": 2}, "1f1b", timeout=120),
           clipped, "sgd")


def test_uneven_and_manual_splits():
    ref = _train("gpt", "sgd")
    out = run_on_ranks(_train, 2, "gpt", "sgd", (), {"pp": 2}, "1f1b", 4, split=[3, 1], timeout=120)
    _check(out, ref, "sgd")
    owners = out[0][2]
    assert owners["blocks.2.attn.qkv.weight"][0] == (0,) and owners["blocks.3.attn.qkv.weight"][0] == (1,)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="dualpipe", microbatches=4), "choose one of"),
    (dict(schedule="1f1b", microbatches=0), "an int >= 1"),
    (dict(schedule="1f1b", microbatches=4, virtual=2), "only 'interleaved'"),
    (dict(schedule="1f1b", microbatches=4, model=make_mlp([4, 4, 2])), "cannot find the layers"),
    (dict(schedule="1f1b", microbatches=4, layers="blocks.0"), None),
    (dict(schedule="1f1b", microbatches=4, record_timeline="yes"), "True or False"),
])
def test_bad_options_are_config_errors(kwargs, match):
    if match is None:       # a layers= path that is not a ModuleList
        with pytest.raises(ConfigError, match="not a ModuleList"):
            pipeline_parallel(**kwargs, model=_model("gpt"))
        return
    with pytest.raises(ConfigError, match=match):
        pipeline_parallel(**kwargs)


def _error(fn):
    try:
        fn()
    except Exception as e:          # noqa: BLE001 — the test reads the rank's error
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("case, expected", [
    ("too_few_microbatches", "ConfigError"),
    ("batch_not_divisible", "ShapeError"),
    ("too_few_layers", "fewer than the 8 stages"),
    ("bad_split", "summing to the model's 4 layers"),
    ("interleaved_not_multiple", "ConfigError"),
])
def test_bad_layouts_are_named_errors(case, expected):
    def fn():
        init_mesh(pp=2)
        args = {"too_few_microbatches": dict(schedule="1f1b", m=1),
                "batch_not_divisible": dict(schedule="1f1b", m=3),
                "too_few_layers": dict(schedule="interleaved", m=4, virtual=4),
                "bad_split": dict(schedule="1f1b", m=4, split=[1, 1]),
                "interleaved_not_multiple": dict(schedule="interleaved", m=3)}[case]
        schedule, m = args.pop("schedule"), args.pop("m")
        return _error(lambda: _train("gpt", "sgd", (), None, schedule, m, **args))
    out = run_on_ranks(fn, 2, timeout=120)
    assert all(expected in r for r in out), out


def test_stacks_that_cannot_compose_are_stack_errors():
    model = _model("gpt")
    apply_fn, _ = dsfn.functionalize(model)
    step_fn = train_step_for(apply_fn, lm_loss)
    with pytest.raises(StackError, match="accumulate.*inside pipeline_parallel"):
        dsfn.compose(pipeline_parallel("1f1b", 4, model=model), accumulate(2))(step_fn)
    with pytest.raises(StackError, match="shard_zero\\(\\) is inside pipeline_parallel.*put shard_zero\\(\\) outside"):
        dsfn.compose(pipeline_parallel("1f1b", 4, model=model), shard_zero(3))(step_fn)
    # a negative control: the same transforms in a working order compose
    for stage in (1, 2, 3):
        dsfn.compose(shard_zero(stage), pipeline_parallel("1f1b", 4, model=model))(step_fn)


def test_a_single_rank_pipeline_is_micro_batching():
    """pp 1: the schedule runs its micro-batches on one rank (accumulation), nothing placed."""
    ref = _train("gpt", "sgd")
    out = run_on_ranks(_train, 1, "gpt", "sgd", (), None, "1f1b", 4, timeout=60)
    _check(out, ref, "sgd")
    assert current_mesh is not None and all(v is None for v in out[0][2].values())


def test_explain_states_the_schedule_and_the_bytes_each_boundary_carries():
    """Each of the 4 micro-batches' activations [2, 12, d] crosses 0 -> 1, its gradient 1 -> 0:
    explain's note and the runtime's counters agree with that count."""
    def fn():
        init_mesh(pp=2)
        model = _model("gpt")
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(pipeline_parallel("1f1b", 4, model=model))(train_step_for(apply_fn, lm_loss))
        ex = step.explain(step.init_state(params, OPTS["sgd"]()), BATCHES[0])
        return str(ex), ex.collectives.get(("pp", "send"), (0, 0)), model.config.d_model
    out = run_on_ranks(fn, 2, timeout=120)
    for rank, (text, (calls, nbytes), d) in enumerate(out):
        per_step = 8 * 12 * d * 4                 # the batch's rows x tokens x width, fp32
        assert nbytes == per_step and calls == 4, (rank, calls, nbytes)
        edge = "stage 0->1" if rank == 0 else "stage 1->0"
        assert f"{edge}: {per_step:,} B" in text, text
        assert ("F0.0 F0.1 BW0.0" if rank == 0 else "F1.0 BW1.0 F1.1") in text, text


def _save_pp(root, p):
    init_mesh(pp=p)
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(pipeline_parallel("1f1b", 4, model=model))(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS["adamw"]())
    for b in BATCHES[:2]:
        state, _ = step(state, b)
    dsfn.checkpoint.save(f"{root}/pp{p}", state)
    g = step.gather(state)
    return {"params": g.params, "opt_state": g.opt_state, "step": g.step}


def _load_as(root, name, p):
    """Load into a fresh state at pp `p` (1: no pipeline) and return the logical state."""
    if p > 1:
        init_mesh(pp=p)
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    ts = [pipeline_parallel("1f1b", 4, model=model)] if p > 1 else []
    step = dsfn.compose(*ts)(train_step_for(apply_fn, lm_loss))
    like = step.init_state(params, OPTS["adamw"]())
    g = step.gather(dsfn.checkpoint.load(f"{root}/{name}", like=like, restore_rng=False))
    return {"params": g.params, "opt_state": g.opt_state, "step": g.step}


def test_a_pipeline_checkpoint_reloads_at_other_pipeline_sizes_bitwise(tmp_path):
    """Saved at pp 2 (each stage writes its own parameters, the tied embedding once), loaded
    at pp 1 (one process), pp 4 and pp 2 again; and a pp 4 checkpoint back at pp 2."""
    from dsfn.testing import assert_trees_equal
    saved = run_on_ranks(_save_pp, 2, str(tmp_path), 2, timeout=120)[0]
    for p in (1, 2, 4):
        for rank, got in enumerate(run_on_ranks(_load_as, p, str(tmp_path), "pp2", p, timeout=180)):
            assert_trees_equal(got, saved, msg=f"pp2 checkpoint loaded at pp {p}, rank {rank}")
    saved4 = run_on_ranks(_save_pp, 4, str(tmp_path), 4, timeout=180)[0]
    for rank, got in enumerate(run_on_ranks(_load_as, 2, str(tmp_path), "pp4", 2, timeout=120)):
        assert_trees_equal(got, saved4, msg=f"pp4 checkpoint loaded at pp 2, rank {rank}")


def _train_mp(outer_pp, pp):
    if pp:
        init_mesh(pp=2)
    model = make_tiny_causal_lm("llama", num_hidden_layers=4)
    apply_fn, params = dsfn.functionalize(model)
    ts = [mixed_precision()] + ([pipeline_parallel("1f1b", 4, model=model)] if pp else [accumulate(4)])
    step = dsfn.compose(*ts)(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS["sgd"]())
    losses = []
    for b in BATCHES:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses, step.gather(state).params


def test_mixed_precision_outside_runs_each_micro_batch_as_accumulate_does():
    """bf16 compute, fp32 master: the pipeline's micro-batches are accumulate(4)'s, each in bf16;
    every stage reports the last stage's loss (sent in fp32, whatever the loss's dtype)."""
    ref_losses, ref_params = _train_mp(None, False)
    for losses, params in run_on_ranks(_train_mp, 2, None, True, timeout=120):
        # the tied embedding's bf16 gradients are summed over the two stages, in another order than
        # autograd's: within one bf16 step (2^-8 relative) of the loss, and of the parameters
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2), (losses, ref_losses)
        assert_trees_close(params, ref_params, rtol=1e-2, atol=1e-3)

@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_record_timeline_times_each_action_of_the_ranks_schedule_in_order(schedule):
    """record_timeline=True: one record per action of this rank's schedule, in its order,
    start <= end and no two overlapping (one rank runs one action at a time); every action but
    the first stage's B (zbv) takes time, zbv's W included; explain states the busy time.
    Without the switch nothing is recorded."""
    def fn(record):
        init_mesh(pp=2)
        model = _model("gpt")
        apply_fn, params = dsfn.functionalize(model)
        pp = pipeline_parallel(schedule, 4, model=model, **({"record_timeline": True} if record else {}))
        step = dsfn.compose(pp)(train_step_for(apply_fn, lm_loss))
        state = step.init_state(params, OPTS["sgd"]())
        for b in BATCHES[:2]:
            state, _ = step(state, b)
        note = pp.explain_note()
        return pp.timeline, note, current_mesh().local_rank("pp")
    for records, note, me in run_on_ranks(fn, 2, True, timeout=120):
        expected = list(build_schedule(schedule, 2, 4)[me])
        assert [sl.action for sl in records] == expected
        assert [(sl.kind, sl.stage, sl.mb) for sl in records] == [(a.kind, a.stage, a.mb) for a in expected]
        assert all(sl.start <= sl.end for sl in records)
        assert all(x.end <= y.start for x, y in zip(records, records[1:]))
        # zbv's W runs the weight gradients now (split from B): real compute, as B's; the
        # first stage's B has nothing to compute (no stage waits for its input gradient)
        assert all(sl.end > sl.start for sl in records if not (sl.kind == Kind.B and sl.stage == 0))
        assert "measured (record_timeline) busy" in note
    for records, note, _ in run_on_ranks(fn, 2, False, timeout=120):
        assert records is None and "measured" not in note


def _save_pp_dp(root, stage=1):
    """pp 2 x dp 2 with ZeRO-`stage` outside (the optimizer state — at stage 3 the parameters
    too — a FlatShard of each stage's piece), saved through async_checkpoint at step 2."""
    from dsfn.transforms import async_checkpoint
    init_mesh(pp=2, dp=2)
    model = _model("qwen2")
    apply_fn, params = dsfn.functionalize(model)
    ck = async_checkpoint(f"{root}/ppdp", every=2)
    step = dsfn.compose(shard_zero(stage), ck, pipeline_parallel("1f1b", 2, model=model))(
        train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS["adamw"]())
    for b in BATCHES[:2]:
        state, _ = step(state, b)
    ck.wait()
    g = step.gather(state)
    return {"params": g.params, "opt_state": g.opt_state, "step": g.step}


def _load_dp(root, world, stage=1):
    """Load the pp2 x dp2 checkpoint into ZeRO-`stage` over dp `world` without a pipeline."""
    init_mesh(dp=world)
    model = _model("qwen2")
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(shard_zero(stage))(train_step_for(apply_fn, lm_loss))
    like = step.init_state(params, OPTS["adamw"]())
    g = step.gather(dsfn.checkpoint.load(f"{root}/ppdp", like=like, restore_rng=False))
    return {"params": g.params, "opt_state": g.opt_state, "step": g.step}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_pp_x_dp_zero_async_checkpoint_reloads_without_the_pipeline(tmp_path, stage):
    """Saved at pp 2 x dp 2 (ZeRO-1 or ZeRO-3 outside, async_checkpoint): reloads bitwise at dp 4
    and dp 2 with no pipeline (universal: the layout on disk is the logical tensors' slices)."""
    from dsfn.testing import assert_trees_equal
    saved = run_on_ranks(_save_pp_dp, 4, str(tmp_path), stage, timeout=240)[0]
    for world in (4, 2):
        for rank, got in enumerate(run_on_ranks(_load_dp, world, str(tmp_path), world, stage, timeout=240)):
            assert_trees_equal(got, saved, msg=f"pp2 x dp2 checkpoint loaded at dp {world}, rank {rank}")


def _overflow_on_stage_0(step_with_inf):
    """fp16 with loss_scale outside a pp-2 pipeline; at `step_with_inf` the first stage's
    gradients get an inf (injected after its backward): (skipped flags, scales, params changed)."""
    from unittest import mock

    from dsfn.transforms import loss_scale
    from dsfn.transforms.pipeline_parallel import PipelineParallel
    init_mesh(pp=2)
    model = _model("qwen2")
    apply_fn, params = dsfn.functionalize(model)
    step = dsfn.compose(mixed_precision(torch.float16), loss_scale(init_scale=2.0 ** 8),
                        pipeline_parallel("1f1b", 4, model=model))(train_step_for(apply_fn, lm_loss))
    orig = PipelineParallel.handle_value_and_grad
    calls = []

    def inject(self, *a, **k):
        value, grads = orig(self, *a, **k)
        calls.append(1)
        if len(calls) == step_with_inf and current_mesh().local_rank("pp") == 0:
            leaves = [g for g in dsfn.tree.leaves(grads, is_leaf=lambda x: isinstance(x, Placed)) if g.data.numel()]
            leaves[0].data.view(-1)[0] = float("inf")
        return value, grads
    state = step.init_state(params, OPTS["sgd"]())
    skipped, scales, changed = [], [], []
    with mock.patch.object(PipelineParallel, "handle_value_and_grad", inject):
        for b in BATCHES:
            before = step.gather(state).params
            state, metrics = step(state, b)
            after = step.gather(state).params
            skipped.append(float(metrics["skipped"]))
            scales.append(float(metrics["loss_scale"]))
            changed.append(any(not torch.equal(before[k], after[k]) for k in before))
    return skipped, scales, changed


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage():
    out = run_on_ranks(_overflow_on_stage_0, 2, 2, timeout=180)
    assert out[0] == out[1], "the stages disagree on the skip or the scale"
    skipped, scales, changed = out[0]
    assert skipped == [0.0, 1.0, 0.0] and changed == [True, False, True], out[0]
    # negative control: with no inf nothing is skipped
    assert run_on_ranks(_overflow_on_stage_0, 2, 99, timeout=180)[0][0] == [0.0, 0.0, 0.0]


def test_accumulate_outside_multiplies_the_micro_batches():
    """accumulate(2) around pipeline_parallel(m=2): two pipeline flushes of 2 micro-batches per
    step (4 in all, each 1/4 of the batch), equal to the single process; with ZeRO-3 over dp
    outside both too (its rounds are the 4 micro-batches' backwards)."""
    ref = _train("llama", "sgd")
    _check(run_on_ranks(_train, 2, "llama", "sgd", [accumulate(2)], {"pp": 2}, "1f1b", 2, timeout=120), ref, "sgd")
    _check(run_on_ranks(_train, 4, "llama", "sgd", [shard_zero(3, reduce_bucket_size=3000), accumulate(2)],
                        {"pp": 2, "dp": 2}, "1f1b", 2, timeout=240), ref, "sgd")
