"""pipeline_parallel with activation checkpointing inside its stages: `remat()` in the stack,
a Hugging Face model's own `gradient_checkpointing_enable()`, and a model whose own loop
checkpoints each layer's `__call__` (`checkpoint(layer, h)`: the layers' hooks, which steer
the forward to one stage, then run again in the recompute — the path Hugging Face took before
transformers 5). Every schedule at pp 2 equals the single process (SGD-momentum state at
fp32 tolerance, rtol 1e-5 / atol 1e-6 as tests/transforms/test_pipeline_parallel.py: the
micro-batches' sum reorders the reduction; bitwise equal to the same pipeline without the
checkpointing, since a recompute runs the same ops on the same values), AdamW by its losses
and parameters; the recompute happened (a counter on a sublayer of every layer sees two calls
per micro-batch per layer of this rank's stages, none of another rank's); nothing is left on
the model after a step, also when the step raises in a recompute.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dsfn
from dsfn.engines.pipeline.schedules import build_schedule
from dsfn.engines.pipeline.stages import StageHooks, StopForward, plan_stages, running_stage
from dsfn.functional import UnitEvents
from dsfn.errors import ConfigError, StackError
from dsfn.functional import in_backward
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import pipeline_parallel, remat

VOCAB = 101
BATCHES = token_batches(3, 8, 12, VOCAB, seed=1)
FP32 = dict(rtol=1e-5, atol=1e-6)
M = 4
LAYERS = 4
OPTS = {"sgd": lambda: dsfn.optim.sgd(0.1, momentum=0.9),
        "adamw": lambda: dsfn.optim.adamw(3e-3, eps=1e-4, weight_decay=0.1)}
_VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zbv": 2}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.ln(h))))


class LoopCheckpointed(nn.Module):
    """Embedding, 4 Blocks, norm, head; with `ckpt` its loop runs each block as
    `checkpoint(block, h, early_stop=False)`: the block's `__call__` is recomputed in backward
    whole, its hooks included (with early stop, torch ends the recompute once the saved tensors
    are back, before the block's forward hooks run); with `whole`, one checkpoint around the
    whole loop."""
    _no_split_modules = ["Block"]

    def __init__(self, ckpt: bool, whole: bool = False, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.ckpt, self.whole = ckpt, whole

    def _loop(self, h):
        for layer in self.layers:
            if self.ckpt and not self.whole:
                h = checkpoint(layer, h, use_reentrant=False, early_stop=False)
            else:
                h = layer(h)
        return h

    def forward(self, ids):
        h = self.embed(ids)
        h = checkpoint(self._loop, h, use_reentrant=False) if self.whole else self._loop(h)
        return self.head(self.norm(h))


def _model(kind):
    """kind: "llama" / "hf_ckpt" (a 4-layer Llama, its own checkpointing on), "loop" / "loop_ckpt"."""
    if kind.startswith("loop"):
        return LoopCheckpointed(ckpt=kind == "loop_ckpt")
    model = make_tiny_causal_lm("llama", num_hidden_layers=LAYERS)
    if kind == "hf_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _counted(model):
    """A sublayer of every layer (run in any recompute of the layer): its calls counted per layer."""
    layers = model.layers if isinstance(model, LoopCheckpointed) else model.model.layers
    counts = [0] * len(layers)
    handles = []
    for k, layer in enumerate(layers):
        sub = layer.fc1 if isinstance(model, LoopCheckpointed) else layer.mlp

        def pre(mod, args, k=k):
            counts[k] += 1
        handles.append(sub.register_forward_pre_hook(pre))
    return counts, handles


def _leftovers(model):
    """What a step could leave on the model: hooks (beyond the model's own: Hugging Face's
    checkpointing adds one to the embedding), instance forwards, a swapped layer list."""
    left = [f"{n}: {k}" for n, m in model.named_modules() for k, h in
            [*m._forward_hooks.items(), *m._forward_pre_hooks.items()]
            if getattr(h, "__module__", "").startswith("dsfn")]
    left += [f"{n}: forward" for n, m in model.named_modules() if "forward" in m.__dict__]
    layers = model.layers if isinstance(model, LoopCheckpointed) else model.model.layers
    if len(layers) != LAYERS:
        left.append(f"layer list of {len(layers)}")
    left += [f"global {k}" for k in ("_global_forward_hooks", "_global_forward_pre_hooks")
             if getattr(nn.modules.module, k)]
    return left


def _train(kind, opt="sgd", schedule=None, inner=(), outer=(), mesh=None):
    """3 steps: (losses, logical state, per-layer sublayer calls, leftovers on the model)."""
    if mesh:
        init_mesh(**mesh)
    model = _model(kind)
    apply_fn, params = dsfn.functionalize(model)
    ts = list(outer) + ([pipeline_parallel(schedule, M, model=model)] if schedule else []) + list(inner)
    step = dsfn.compose(*ts)(train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, OPTS[opt]())
    counts, handles = _counted(model)
    losses = []
    for b in BATCHES:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    for h in handles:
        h.remove()
    g = step.gather(state)
    return losses, {"params": g.params, "opt_state": g.opt_state}, counts, _leftovers(model)


def _layers_of_rank(schedule, rank, p=2):
    """The layers of `rank`'s stages (4 layers cut evenly into p * virtual stages)."""
    v = _VIRTUAL[schedule]
    per = LAYERS // (p * v)
    stages = {a.stage for a in build_schedule(schedule, p, M, v)[rank]}
    return {k for s in stages for k in range(s * per, (s + 1) * per)}


def _check(results, ref, opt, schedule, calls_per_microbatch):
    for rank, (losses, state, counts, left) in enumerate(results):
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref[0]), **FP32), (losses, ref[0])
        compared = state if opt == "sgd" else {"params": state["params"]}
        expected = ref[1] if opt == "sgd" else {"params": ref[1]["params"]}
        assert_trees_close(compared, expected, **FP32)
        mine = _layers_of_rank(schedule, rank)
        want = [calls_per_microbatch * M * len(BATCHES) if k in mine else 0 for k in range(LAYERS)]
        assert counts == want, f"rank {rank}: per-layer calls {counts}, expected {want} (forward + recompute)"
        assert left == [], f"rank {rank}: left on the model after the steps: {left}"


_REFS: dict = {}


def _ref(kind, opt="sgd"):
    if (kind, opt) not in _REFS:
        _REFS[(kind, opt)] = _train(kind, opt)
    return _REFS[(kind, opt)]


CASES = {"remat": ("llama", dict(inner=(remat(),))),
         "hf_ckpt": ("hf_ckpt", {}),
         "loop_ckpt": ("loop_ckpt", {})}
REF_OF = {"remat": "llama", "hf_ckpt": "llama", "loop_ckpt": "loop"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zbv"])
@pytest.mark.parametrize("case", ["remat", "hf_ckpt", "loop_ckpt"])
def test_every_schedule_with_checkpointed_layers_equals_the_single_process(schedule, case):
    """The reference runs the model without checkpointing (one forward per layer per step)."""
    kind, kw = CASES[case]
    ref = _ref(REF_OF[case])
    assert ref[2] == [len(BATCHES)] * LAYERS            # the counter's control: one call per step
    out = run_on_ranks(_train, 2, kind, "sgd", schedule, mesh={"pp": 2}, timeout=180, **kw)
    _check(out, ref, "sgd", schedule, calls_per_microbatch=2)


def test_the_recompute_is_exact_and_adamw_trains_alike():
    """Bitwise: the checkpointed pipeline's SGD-momentum state equals the same pipeline's without
    checkpointing (the recompute runs the same ops on the same inputs); AdamW at fp32 tolerance."""
    plain = run_on_ranks(_train, 2, "llama", "sgd", "1f1b", mesh={"pp": 2}, timeout=180)
    _check(plain, _ref("llama"), "sgd", "1f1b", calls_per_microbatch=1)
    for kind, kw in (("hf_ckpt", {}), ("llama", dict(inner=(remat(),)))):
        ckpt = run_on_ranks(_train, 2, kind, "sgd", "1f1b", mesh={"pp": 2}, timeout=180, **kw)
        for (l1, s1, _, _), (l2, s2, _, _) in zip(ckpt, plain):
            assert l1 == l2
            assert_trees_close(s1, s2, rtol=0, atol=0)
    for kind, kw in (("hf_ckpt", {}), ("llama", dict(inner=(remat(),)))):
        out = run_on_ranks(_train, 2, kind, "adamw", "interleaved", mesh={"pp": 2}, timeout=180, **kw)
        _check(out, _ref("llama", "adamw"), "adamw", "interleaved", calls_per_microbatch=2)


def test_remat_outside_the_pipeline_composes_too():
    """compose(remat(), pipeline_parallel(...)): remat's checkpointed forwards are installed
    first, the stage's steering inside them; the same training."""
    out = run_on_ranks(_train, 2, "llama", "sgd", "1f1b", outer=(remat(),), mesh={"pp": 2}, timeout=180)
    _check(out, _ref("llama"), "sgd", "1f1b", calls_per_microbatch=2)


def test_nothing_is_left_on_the_model_when_a_step_raises_in_a_recompute():
    """Rank 0 fails in its first recompute (B 0.0, after its gradient came), rank 1 in its
    second (B 1.1, after micro-batch 1 came): no rank waits on the other. The step's hooks,
    the layer list, remat's forwards and the bound parameters are all undone."""
    def fn():
        init_mesh(pp=2)
        rank = torch.distributed.get_rank()
        model = _model("hf_ckpt")
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(pipeline_parallel("1f1b", M, model=model), remat(modules=["model.layers.*.mlp"]))(
            train_step_for(apply_fn, lm_loss))
        state = step.init_state(params, OPTS["sgd"]())
        seen = [0]

        def fail(mod, args):
            if in_backward():
                seen[0] += 1
                if seen[0] == rank + 1:
                    raise RuntimeError("injected failure in a recompute")
        first = 0 if rank == 0 else LAYERS // 2
        handle = model.model.layers[first].self_attn.register_forward_pre_hook(fail)
        try:
            step(state, BATCHES[0])
            error = "no error"
        except RuntimeError as e:
            error = str(e)
        handle.remove()
        bound = [n for n, p in model.named_parameters() if not isinstance(p, nn.Parameter)]
        return error, _leftovers(model), bound
    for error, left, bound in run_on_ranks(fn, 2, timeout=180):
        assert "injected failure" in error
        assert left == [] and bound == [], (left, bound)


# ---------------------------------------------------------------------------------------------
# the stage hooks themselves (one process)
# ---------------------------------------------------------------------------------------------

class _Stages:
    """The stage verbs heard through the layer events, as pipeline_parallel's "run_unit"
    handler hears them (the engine alone, without the transform)."""

    def __init__(self, hooks):
        self.hooks = hooks

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase == "pre":
            value = self.hooks.before(module, *value) or value
        else:
            self.hooks.after(module, value)
        return call_next(module, phase, value, recompute)


def _heard(plan):
    """A StageHooks of `plan` and the installer that brings it its layers' events."""
    hooks = StageHooks(plan)
    return hooks, UnitEvents(hooks.units(), [_Stages(hooks).handle_run_unit])


def test_stage_hooks_take_the_named_microbatch_input_and_never_stop_a_recompute():
    model = LoopCheckpointed(ckpt=False)
    plan = plan_stages(model, [n for n, _ in model.named_parameters()], 2)
    x = torch.randn(2, 3, 32)
    h_a, h_b = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    first1, last0 = model.layers[2], model.layers[1]
    hooks, events = _heard(plan)
    with events:
        with hooks.running(1, h_a, recompute=True):
            assert torch.equal(first1(x), first1.forward(h_a))        # takes the named h_in, not x
        with hooks.running(1, h_b, recompute=True):
            assert torch.equal(first1(x), first1.forward(h_b))
        with hooks.running(0, None):
            with pytest.raises(StopForward):                         # a forward stops after the stage
                last0(x)
        with hooks.running(0, None, recompute=True):
            assert torch.equal(last0(x), last0.forward(x))           # a recompute returns its output
        assert torch.equal(first1(x), first1.forward(x))             # nothing running: no steering
        with hooks.running(1, h_a, recompute=True), \
                pytest.raises(ConfigError, match=r"layer 0 of layers \(stage 0\) ran in a recompute in backward "
                                                 r"of stage 1"):
            model.layers[0](x)                                        # another stage's layer in a recompute
    assert _leftovers(model) == []


def test_remat_of_a_module_holding_the_layers_is_a_named_error():
    """A StackError when the stack is made (every rank alike, before any transfer), either
    order; a working order and patterns compose (the control). Without model= (pp 1 only), the
    forward's check refuses it: a ConfigError, nothing left behind."""
    model = _model("llama")
    apply_fn, params = dsfn.functionalize(model)
    step_fn = train_step_for(apply_fn, lm_loss)
    for holder in (["model"], ["*"], ["model.layers"]):
        for order in ((pipeline_parallel("1f1b", M, model=model), remat(modules=holder)),
                      (remat(modules=holder), pipeline_parallel("1f1b", M, model=model))):
            fix = r"holds the layers model\.layers .*remat\(modules=\['model\.layers\.\*'\]\)"
            with pytest.raises(StackError, match=fix):
                dsfn.compose(*order)(step_fn)
    dsfn.compose(pipeline_parallel("1f1b", M, model=model), remat(modules=["model.layers.*"]))(step_fn)
    dsfn.compose(remat(modules=["model.layers.*.mlp"]), pipeline_parallel("1f1b", M, model=model))(step_fn)

    def fn():
        init_mesh(pp=1)
        model = _model("llama")
        apply_fn, params = dsfn.functionalize(model)
        step = dsfn.compose(pipeline_parallel("gpipe", 2), remat(modules=["model"]))(
            train_step_for(apply_fn, lm_loss))
        try:
            step(step.init_state(params, OPTS["sgd"]()), BATCHES[0])
        except ConfigError as e:
            return str(e), _leftovers(model)
        return "no error", _leftovers(model)
    error, left = run_on_ranks(fn, 1, timeout=120)[0]
    assert "remat checkpoints 'model'" in error and "remat(modules=['model.layers.*'])" in error, error
    assert left == []


def test_a_checkpoint_around_the_whole_layer_loop_is_a_named_error_in_its_recompute():
    """The recompute of a checkpoint around the loop runs the whole list (the stage's cut is
    gone): on stage 1 it would fill layers 2-3's saved tensors with layers 0-1's (same shapes;
    the checkpoint cannot tell) — a ConfigError instead."""
    model = LoopCheckpointed(ckpt=False, whole=True)
    plan = plan_stages(model, [n for n, _ in model.named_parameters()], 2)
    ids = BATCHES[0]["input_ids"][:2]
    h_in = torch.randn(2, ids.shape[1], 32, requires_grad=True)
    hooks, events = _heard(plan)
    with events:
        with running_stage(plan, 1, h_in, hooks):
            loss = model(ids).sum()
        with hooks.running(1, h_in, recompute=True), \
                pytest.raises(ConfigError, match=r"layer 0 of layers \(stage 0\) ran in a recompute"):
            loss.backward()
    assert _leftovers(model) == []


# ---------------------------------------------------------------------------------------------
# estimate_memory: what a stage holds when its layers are recomputed
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["remat", "hf_ckpt", "remat_offload"])
def test_estimate_models_recomputed_layers_as_their_inputs_plus_one_rematerialised_layer(how):
    """1F1B at pp 2, 4 micro-batches of 2 rows x 12 tokens, a 4-layer Llama (hidden 64, vocab
    101, fp32): rank r holds p - r micro-batches; a recomputed layer keeps its input (b·s·h
    values; none with offload="cpu"), and the backward adds one layer's 17·b·s·h at a time."""
    from dsfn.estimate import ACT_VALUES_PER_LAYER, estimate_memory
    with torch.device("meta"):
        model = _model("hf_ckpt" if how == "hf_ckpt" else "llama")
        bare = _model("llama")
    inner = [remat(offload="cpu" if how == "remat_offload" else None)] if how.startswith("remat") else []
    stack = [pipeline_parallel("1f1b", M, model=model), *inner]
    bare_pipe = pipeline_parallel("1f1b", M, model=bare)
    tokens, h, vocab, b = 2 * 12, 64, VOCAB, 4
    layer = ACT_VALUES_PER_LAYER * tokens * h
    kept = 0 if how == "remat_offload" else tokens * h

    def est(model, stack, r):
        return estimate_memory(model, stack, 2, pp=2, pp_rank=r, batch=(8, 12), tx=OPTS["sgd"]())
    for r in (0, 1):
        ours, plain = est(model, stack, r), est(bare, [bare_pipe], r)
        ends = tokens * h if r == 0 else tokens * vocab             # the embedding's output / the logits
        assert ours.microbatch_activations == (2 * kept + ends) * b
        assert ours.activations == (2 - r) * (2 * kept + ends) * b + layer * b
        assert plain.activations == (2 - r) * (2 * layer + ends) * b       # the control: no recompute
        assert "recomputed in backward" in ours.activation_note and "recomputed" not in plain.activation_note
        # a selective policy is not modelled: counted as without remat, and said
        sel = est(bare, [bare_pipe, remat(policy="matmuls")], r)
        assert sel.activations == plain.activations and "not modelled" in sel.activation_note
