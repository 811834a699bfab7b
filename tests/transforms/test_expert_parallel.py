"""expert_parallel: experts sharded over ep, tokens dispatched with variable all-to-alls,
equal to the single process.

Equality: SGD-momentum, 3 steps; losses and the final logical state (params and momentum)
at rtol 1e-5 / atol 1e-6 (fp32: the combine sums a token's k expert outputs in another
order than the reference's loop over experts, and dp/ep average in another order).

Models: transformers' tiny Mixtral (`plan="auto"`: its `base_model_ep_plan`, with its
router balance loss) and `dsfn.testing.models.TinyMoE` (an explicit plan; a shared expert
that stays an ordinary parameter; a router bias to force skewed routing).

Negative controls (the test must fail when the feature breaks): a token sent to the wrong
expert, and the experts' gradients not made the mean over the ep ranks' tokens.
"""
from __future__ import annotations

import math

import pytest
import torch

import dsfn
from dsfn.engines import expert_dispatch
from dsfn.errors import ConfigError, MeshError, StackError
from dsfn.runtime import init_mesh
from dsfn.runtime.mesh import Mesh, on_virtual_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import TinyExperts, TinyMoE, make_tiny_causal_lm, moe_batches
from dsfn.testing.reference import mse_loss, run_steps, train_step_for
from dsfn.transforms import (accumulate, clip_grad_norm, compose, data_parallel, expert_parallel, loss_scale,
                             mixed_precision, offload, remat, sequence_parallel, shard_zero, tensor_parallel,
                             zenflow)

TOL = dict(rtol=1e-5, atol=1e-6)
PLAN = {"experts": "experts"}


# -- the tiny models' runs ------------------------------------------------------------------------

def _outer(name):
    return {"none": (), "dp": (data_parallel(),), "zero1": (shard_zero(1),), "zero2": (shard_zero(2),),
            "zero2_tp": (shard_zero(2),),       # with tensor_parallel('auto') inside expert_parallel
            "sp": (sequence_parallel(),), "sp_zero3": (sequence_parallel(), shard_zero(3)),
            "zero3": (shard_zero(3),),
            # HSDP: shards over groups of 2 dp ranks, copies across the groups
            "hsdp3": (shard_zero(3, shard_group=2),),
            # small leaves kept whole (all-reduced), the rest sharded: both paths of ZeRO-3
            "zero3_persist": (shard_zero(3, param_persistence_threshold=64),)}[name]


def train_toy(outer="none", mesh=None, ep=True, model_kw=None, cf=None, clip=None, sabotage=None, steps=3):
    if mesh:
        init_mesh(**mesh)
    if sabotage:
        _sabotage(sabotage)
    model = TinyMoE(**(model_kw or {}))
    apply_fn, params = dsfn.functionalize(model)
    inner = (clip_grad_norm(clip),) if clip else ()
    ts = (*_outer(outer), expert_parallel(PLAN, model=model, capacity_factor=cf), *inner) if ep else inner
    step = compose(*ts)(train_step_for(apply_fn, mse_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.1, momentum=0.9))
    losses, metrics = [], []
    for batch in moe_batches(steps, 8, 8, seed=3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
    full = step.gather(state)
    return losses, {"params": full.params, "opt_state": full.opt_state}, metrics


def _sabotage(kind):
    """Inject a bug into the dispatch (negative controls)."""
    run = expert_dispatch.ExpertDispatch.run
    if kind == "wrong_expert":      # every token's assignment goes to the next expert
        def wrong(self, module, forward, hidden, index, weights, *a, **k):
            return run(self, module, forward, hidden, (index + 1) % self.experts, weights, *a, **k)
        expert_dispatch.ExpertDispatch.run = wrong
    elif kind == "expert_grad_sum":  # the experts' gradients left the sum over the ep ranks' tokens
        apply = expert_dispatch._Exchange.apply
        expert_dispatch._Exchange.apply = lambda x, s, r, axis, scale: apply(x, s, r, axis, 1.0)


def _close(a, b):
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), **TOL)
    assert_trees_close(a[1], b[1], **TOL)


TOY_STACKS = {                       # name: (outer transforms, world, mesh)
    "ep2": ("none", 2, {"ep": 2}),
    "ep4": ("none", 4, {"ep": 4}),
    "dp2xep2": ("dp", 4, {"dp": 2, "ep": 2}),
    "zero1+ep2": ("zero1", 2, {"dp": 1, "ep": 2}),
    "zero3+ep2": ("zero3", 2, {"dp": 1, "ep": 2}),
    "zero3xdp2xep2": ("zero3", 4, {"dp": 2, "ep": 2}),
    "zero3_persistxdp2xep2": ("zero3_persist", 4, {"dp": 2, "ep": 2}),
    "hsdp3xdp4xep2": ("hsdp3", 8, {"dp": 4, "ep": 2}),
}


@pytest.mark.parametrize("stack", sorted(TOY_STACKS))
def test_dropless_equals_the_single_process(stack):
    outer, world, mesh = TOY_STACKS[stack]
    ref = train_toy(ep=False)
    for got in run_on_ranks(train_toy, world, outer, mesh, timeout=240):
        _close(got, ref)


@pytest.mark.parametrize("k,experts", [(1, 4), (2, 4), (8, 8)])
def test_top_k_routing_equals_the_single_process(k, experts):
    kw = dict(num_experts=experts, k=k)
    ref = train_toy(ep=False, model_kw=kw)
    for got in run_on_ranks(train_toy, 2, "none", {"ep": 2}, True, kw, timeout=240):
        _close(got, ref)


def test_skewed_routing_an_idle_expert_rank_and_a_rank_sending_everything_away():
    """Every token picks experts 0 and 1 (rank 0's): rank 1's experts receive nothing, rank 1's
    tokens all leave it; equal to the single process, and the load metrics say so."""
    kw = dict(router_bias=[8.0, 8.0, -8.0, -8.0])
    ref = train_toy(ep=False, model_kw=kw)
    for got in run_on_ranks(train_toy, 2, "none", {"ep": 2}, True, kw, timeout=240):
        _close(got, ref)
        m = got[2][0]
        assert m["ep_tokens_min"] == 0 and m["ep_load_imbalance"] == pytest.approx(2.0)
        assert m["ep_dropped_share"] == 0


def test_clip_grad_norm_counts_each_expert_once():
    ref = train_toy(ep=False, clip=0.05)
    for got in run_on_ranks(train_toy, 4, "dp", {"dp": 2, "ep": 2}, True, None, None, 0.05, timeout=240):
        _close(got, ref)


# -- capacity: the tokens over an expert's capacity are dropped, as a plain-torch reference drops them

def _dropping_forward(ranks, cf, min_capacity):
    """TinyExperts.forward with each rank's assignments over capacity dropped (weight 0),
    written independently of the engine: rank r holds tokens [r T/ranks, (r+1) T/ranks) of
    the flattened batch; each expert keeps its first C of them, first choices in token order,
    then second choices."""
    original = TinyExperts.forward

    def forward(self, hidden, index, weights):
        t, k = index.shape
        per = t // ranks
        keep = torch.zeros(t, k, dtype=torch.bool)
        for r in range(ranks):
            cap = max(min_capacity, math.ceil(cf * per * k / self.num_experts))
            used = [0] * self.num_experts
            for j in range(k):
                for tok in range(r * per, (r + 1) * per):
                    e = int(index[tok, j])
                    if used[e] < cap:
                        keep[tok, j] = True
                        used[e] += 1
        return original(self, hidden, index, weights * keep)
    return forward


@pytest.mark.parametrize("cf,world,mesh,outer", [(1.0, 2, {"ep": 2}, "none"), (0.5, 4, {"dp": 2, "ep": 2}, "dp")])
def test_capacity_factor_equals_a_reference_that_drops_the_same_tokens(cf, world, mesh, outer, monkeypatch):
    monkeypatch.setattr(TinyExperts, "forward", _dropping_forward(world, cf, 0))
    ref = train_toy(ep=False)
    monkeypatch.undo()
    for got in run_on_ranks(train_toy, world, outer, mesh, True, None, cf, timeout=240):
        _close(got, ref)
        assert got[2][0]["ep_dropped_share"] > 0          # the capacity did drop tokens
    dropless = train_toy(ep=False)
    assert not torch.allclose(torch.tensor(dropless[0]), torch.tensor(ref[0]), **TOL)


def test_kept_assignments_keep_first_choices_first_and_the_first_tokens():
    index = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2]])      # 4 tokens, top-2, 3 experts
    kept = expert_dispatch.kept_assignments(index, 3, capacity=2)
    chosen = {(int(p) // 2, int(p) % 2) for p in kept}            # (token, slot)
    # expert 0: first choices of tokens 0, 1, 3 -> tokens 0 and 1 kept; token 2's second choice dropped
    # expert 1: token 2's first choice, then token 0's second (token 1's second is dropped)
    assert chosen == {(0, 0), (1, 0), (2, 0), (0, 1), (3, 1)}
    assert expert_dispatch.kept_assignments(index, 3, capacity=None).numel() == 8
    assert expert_dispatch.capacity_of(16, 2, 4, 1.25, 0) == 10 and expert_dispatch.capacity_of(4, 1, 8, 1.0, 4) == 4


# -- negative controls -----------------------------------------------------------------------------

@pytest.mark.parametrize("bug", ["wrong_expert", "expert_grad_sum"])
def test_negative_control_a_broken_dispatch_differs(bug):
    ref = train_toy(ep=False)
    got = run_on_ranks(train_toy, 2, "none", {"ep": 2}, True, None, None, None, bug, timeout=240)[0]
    assert not (torch.allclose(torch.tensor(got[0]), torch.tensor(ref[0]), **TOL)
                and all(torch.allclose(a, b, **TOL) for a, b in zip(dsfn.tree.leaves(got[1]),
                                                                     dsfn.tree.leaves(ref[1])))), bug


# -- a Hugging Face MoE model: plan="auto", its own loss and router balance loss -----------------

def train_mixtral(outer="none", mesh=None, ep=True, checkpointing=False, family="mixtral", impl=None):
    if mesh:
        init_mesh(**mesh)
    model = make_tiny_causal_lm(family, **({"experts_implementation": impl} if impl else {}))
    if checkpointing:      # the model's own gradient checkpointing: the dispatch runs again in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_fn, params = dsfn.functionalize(model)
    inner = (tensor_parallel("auto", model=model),) if outer.endswith("_tp") else ()
    ts = (*_outer(outer), expert_parallel("auto", model=model), *inner) if ep else ()

    def loss(apply_fn, params, batch):
        return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss
    step = compose(*ts)(train_step_for(apply_fn, loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 101, (4, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids.masked_fill(ids % 7 == 0, -100)})
    return run_steps(step, state, batches)


@pytest.mark.parametrize("outer,world,mesh", [("none", 2, {"ep": 2}), ("zero2", 4, {"dp": 2, "ep": 2}),
                                              ("zero3", 4, {"dp": 2, "ep": 2}),
                                              # Ulysses: each sp rank's tokens dispatched; the router
                                              # balance loss still the whole batch's
                                              ("sp", 4, {"sp": 2, "ep": 2}),
                                              ("sp_zero3", 8, {"dp": 2, "sp": 2, "ep": 2})])
def test_mixtral_auto_plan_equals_the_single_process(outer, world, mesh):
    pytest.importorskip("transformers")
    ref = train_mixtral(ep=False)
    for got in run_on_ranks(train_mixtral, world, outer, mesh, timeout=300):
        _close(got, ref)


@pytest.mark.parametrize("outer,world,mesh", [("none", 2, {"ep": 2}), ("zero3", 4, {"dp": 2, "ep": 2}),
                                              ("zero2_tp", 8, {"dp": 2, "ep": 2, "tp": 2})])
def test_qwen2_moe_with_shared_experts_auto_plan_equals_the_single_process(outer, world, mesh):
    """Qwen2-MoE: routed experts over ep, its gated shared expert an ordinary parameter."""
    pytest.importorskip("transformers")
    ref = train_mixtral(ep=False, family="qwen2_moe")
    for got in run_on_ranks(train_mixtral, world, outer, mesh, True, False, "qwen2_moe", timeout=300):
        _close(got, ref)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_mixtral_with_hf_grouped_experts_kernels_equals_the_single_process(impl):
    """HF's experts implementations (torch's grouped matmul, batched matmuls) run on each rank's
    experts: the dispatch hands them local ids, as the eager loop."""
    pytest.importorskip("transformers")
    ref = train_mixtral(ep=False)                          # the eager loop, one process
    for got in run_on_ranks(train_mixtral, 2, "none", {"ep": 2}, True, False, "mixtral", impl, timeout=300):
        _close(got, ref)


def test_mixtral_with_its_own_gradient_checkpointing_under_zero3_equals_the_single_process():
    pytest.importorskip("transformers")
    ref = train_mixtral(ep=False)
    for got in run_on_ranks(train_mixtral, 4, "zero3", {"dp": 2, "ep": 2}, True, True, timeout=300):
        _close(got, ref)


def test_experts_are_laid_out_over_ep_and_the_rest_is_whole():
    def placed():
        init_mesh(ep=2)
        model = TinyMoE()
        apply_fn, params = dsfn.functionalize(model)
        step = compose(expert_parallel(PLAN, model=model))(train_step_for(apply_fn, mse_loss))
        state = step.init_state(params, dsfn.optim.sgd(0.1, momentum=0.9))
        return {k: tuple(v.data.shape) if hasattr(v, "layout") else tuple(v.shape) for k, v in state.params.items()}
    shapes = run_on_ranks(placed, 2, timeout=120)[0]
    assert shapes["experts.w_in"] == (2, 12, 8) and shapes["experts.w_out"] == (2, 8, 12)
    assert shapes["shared.weight"] == (8, 8) and shapes["router.weight"] == (4, 8)


# -- bad input ------------------------------------------------------------------------------------

def test_bad_input_is_a_named_error():
    model = TinyMoE()
    with pytest.raises(ConfigError, match="capacity_factor"):
        expert_parallel(PLAN, model=model, capacity_factor=0)
    with pytest.raises(ConfigError, match="matches no module"):
        expert_parallel({"layers.*.experts": "experts"}, model=model)
    with pytest.raises(ConfigError, match="names no parameter"):
        expert_parallel({"experts": "experts", "experts.gate_up_proj": "grouped_gemm"}, model=model)
    with pytest.raises(ConfigError, match="no int attribute num_experts"):
        expert_parallel({"router": "experts"}, model=model)
    with pytest.raises(ConfigError, match="model="):
        expert_parallel("auto")
    with pytest.raises(ConfigError, match="declares no expert plan"):
        expert_parallel("auto", model=model)
    with pytest.raises(MeshError, match="multiply to"):
        Mesh({"ep": 3})
    apply_fn, params = dsfn.functionalize(model)
    step = compose(expert_parallel(PLAN, model=model))(train_step_for(apply_fn, mse_loss))
    with on_virtual_mesh(Mesh.virtual({"ep": 3})), pytest.raises(MeshError, match="4 experts do not divide over ep=3"):
        step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))


def test_stacks_not_built_yet_are_refused():
    model = TinyMoE()
    apply_fn, _ = dsfn.functionalize(model)
    f = train_step_for(apply_fn, mse_loss)
    with pytest.raises(StackError, match="outside expert_parallel"):
        compose(expert_parallel(PLAN, model=model), data_parallel())(f)
    with pytest.raises(StackError, match="zenflow"):
        compose(shard_zero(2), expert_parallel(PLAN, model=model), zenflow(topk_ratio=0.1))(f)
    # offload's overlapped host update would hear the buckets before their mean over ep
    with pytest.raises(StackError, match="hears reduced gradient buckets"):
        compose(shard_zero(2), expert_parallel(PLAN, model=model), offload("cpu", overlap=True))(f)
    with pytest.raises(StackError, match="tensor_parallel must be inside expert_parallel"):
        compose(tensor_parallel({"shared": "colwise"}, model=model), expert_parallel(PLAN, model=model))(f)


# -- checkpoints: the experts are saved as logical tensors, so any ep (or none) loads them --------

def _save_at_ep4(root):
    init_mesh(ep=4)
    model = TinyMoE()
    apply_fn, params = dsfn.functionalize(model)
    step = compose(expert_parallel(PLAN, model=model))(train_step_for(apply_fn, mse_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.1, momentum=0.9))
    for batch in moe_batches(3, 8, 8, seed=3)[:2]:
        state, _ = step(state, batch)
    dsfn.checkpoint.save(root, state)


def _resume(root, kind, mesh=None, model_kw=None):
    if mesh:
        init_mesh(**mesh)
    model = TinyMoE(**(model_kw or {}))
    apply_fn, params = dsfn.functionalize(model)
    ts = {"single": (), "ep2": (expert_parallel(PLAN, model=model),), "dp2": (data_parallel(),),
          "zero3xep2": (shard_zero(3), expert_parallel(PLAN, model=model))}[kind]
    step = compose(*ts)(train_step_for(apply_fn, mse_loss))
    state = dsfn.checkpoint.load(root, like=step.init_state(params, dsfn.optim.sgd(0.1, momentum=0.9)))
    state, m = step(state, moe_batches(3, 8, 8, seed=3)[2])
    full = step.gather(state)
    return [float(m["loss"])], {"params": full.params, "opt_state": full.opt_state}


def test_a_checkpoint_saved_at_ep4_resumes_at_ep2_ep1_dp2_and_zero3_dp2xep2_equal(tmp_path):
    root = str(tmp_path / "ck")
    run_on_ranks(_save_at_ep4, 4, root, timeout=120)
    ref = train_toy(ep=False)
    want = ([ref[0][2]], ref[1])
    _close(run_on_ranks(_resume, 1, root, "single", timeout=120)[0], want)
    for kind, mesh in (("ep2", {"ep": 2}), ("dp2", {"dp": 2}), ("zero3xep2", {"dp": 2, "ep": 2})):
        for got in run_on_ranks(_resume, math.prod(mesh.values()), root, kind, mesh, timeout=120):
            _close(got, want)


def test_a_checkpoint_with_another_expert_count_is_refused(tmp_path):
    root = str(tmp_path / "ck")
    run_on_ranks(_save_at_ep4, 4, root, timeout=120)
    with pytest.raises(Exception) as err:
        _resume(root, "single", model_kw=dict(num_experts=8))
    assert isinstance(err.value, dsfn.errors.DsfnError) and "experts.w_in" in str(err.value), err.value


def test_estimate_memory_holds_one_ep_share_of_the_experts():
    from dsfn.estimate import estimate_memory
    model = TinyMoE(num_experts=8)
    tx = dsfn.optim.sgd(0.1, momentum=0.9)
    whole = estimate_memory(model, [data_parallel()], 2, tx=tx)
    ep = estimate_memory(model, [data_parallel(), expert_parallel(PLAN, model=model)], 2, tx=tx)
    expert_bytes = sum(p.numel() * 4 for p in model.experts.parameters())
    assert whole.params - ep.params == expert_bytes // 2
    assert whole.optimizer - ep.optimizer == expert_bytes // 2         # momentum mirrors the params


# -- the training transforms a user stacks around (and inside) expert_parallel ---------------------

def _inner(name):
    """(transforms between ep and the outer data parallel, transforms inside ep, optimizer)."""
    sgd = dsfn.optim.sgd(0.1, momentum=0.9)
    return {
        "accumulate": ((accumulate(2),), (), sgd),
        "bf16": ((), (mixed_precision(torch.bfloat16),), sgd),
        "fp16+loss_scale": ((loss_scale(init_scale=2.0 ** 10),), (mixed_precision(torch.float16),), sgd),
        "remat_experts": ((), (remat(modules=["experts"]),), sgd),
        "muon": ((), (), dsfn.optim.muon(lr=0.02, adam_lr=1e-3)),
    }[name]


def train_composed(name, outer="none", mesh=None, ep=True):
    if mesh:
        init_mesh(**mesh)
    model = TinyMoE()
    apply_fn, params = dsfn.functionalize(model)
    between, inside, tx = _inner(name)
    ts = ((*_outer(outer), *between, expert_parallel(PLAN, model=model), *inside) if ep else (*between, *inside))
    step = compose(*ts)(train_step_for(apply_fn, mse_loss))
    return run_steps(step, step.init_state(params, tx), moe_batches(3, 8, 8, seed=3))


# fp32 stacks at the equality tolerance; half-precision compute: its reference runs the same
# mixed precision in one process, and the experts' matmuls see other row batches (bf16 rounding
# of the sums) — a tolerance of a few bf16 / fp16 ulps of the values, stated here
COMPOSED_TOL = {"bf16": dict(rtol=2e-2, atol=2e-2), "fp16+loss_scale": dict(rtol=5e-3, atol=5e-3),
                "muon": dict(rtol=1e-4, atol=1e-5)}


@pytest.mark.parametrize("name", ["accumulate", "bf16", "fp16+loss_scale", "remat_experts", "muon"])
@pytest.mark.parametrize("outer,world,mesh", [("zero2", 4, {"dp": 2, "ep": 2}), ("zero3", 4, {"dp": 2, "ep": 2})])
def test_training_transforms_compose_equal_to_the_single_process(name, outer, world, mesh):
    ref = train_composed(name, ep=False)
    tol = COMPOSED_TOL.get(name, TOL)
    for got in run_on_ranks(train_composed, world, name, outer, mesh, timeout=300):
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), **tol)
        assert_trees_close(got[1], ref[1], **tol)


# -- explain: the all-to-all bytes per layer and per step ------------------------------------------

def _explain_at_ep2():
    init_mesh(ep=2)
    model = TinyMoE(router_bias=[2.0, 0.0, 0.0, -2.0])      # uneven routing: the ranks' shares differ
    apply_fn, params = dsfn.functionalize(model)
    t = expert_parallel(PLAN, model=model)
    step = compose(t)(train_step_for(apply_fn, mse_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.1))
    ex = step.explain(state, moe_batches(1, 8, 8, seed=3)[0])
    calls, nbytes = ex.collectives[("ep", "all_to_all")]
    return nbytes, [(s, r, b) for _, s, r, b in t.last_dispatch.layers], str(ex)


def test_explain_counts_the_all_to_all_bytes_per_layer_as_the_closed_form():
    """At the counters: each rank sends 2 (S + R) x H x 4 bytes of rows per layer (S its rows,
    R what its experts received) and E int64 counts; over the ranks sum R = sum S, so the rows
    total 4 x tokens x k x H x 4 bytes (dropless): the closed form."""
    got = run_on_ranks(_explain_at_ep2, 2, timeout=120)
    tokens, k, hidden, experts = 8 * 8, 2, 8, 4
    rows_total = 0
    for nbytes, layers, text in got:
        (sent, received, row_bytes), = layers
        assert row_bytes == hidden * 4 and sent == tokens // 2 * k
        assert nbytes == 2 * (sent + received) * row_bytes + experts * 8
        assert "rows sent / received" in text and f"{sent} / {received} rows" in text
        rows_total += nbytes - experts * 8
    assert got[0][1][0][1] != got[1][1][0][1]          # the routing is uneven: the shares differ
    assert rows_total == 4 * tokens * k * hidden * 4


# -- export: the model's own safetensors layout, from a live ep x ZeRO-3 state ------------------

def _train_and_export(out):
    init_mesh(dp=2, ep=2)
    model = make_tiny_causal_lm("mixtral")
    apply_fn, params = dsfn.functionalize(model)

    def loss(apply_fn, params, batch):
        return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss
    step = compose(shard_zero(3), expert_parallel("auto", model=model))(train_step_for(apply_fn, loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 101, (4, 16), generator=g)
        state, _ = step(state, {"input_ids": ids, "labels": ids.masked_fill(ids % 7 == 0, -100)})
    return dsfn.checkpoint.export_state(state, out)


def test_export_from_ep_x_zero3_is_the_models_own_state_dict_equal_to_the_single_process(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    ref = train_mixtral(ep=False)[1]["params"]
    written = run_on_ranks(_train_and_export, 4, str(tmp_path / "hf"), timeout=300)
    sd = load_file(written[0])
    model = make_tiny_causal_lm("mixtral")
    model.load_state_dict(sd, strict=True)            # HF's names and shapes: whole [E, ...] experts
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    assert_trees_close({k: sd[k] for k in ref}, dict(ref), **TOL)


def test_estimate_memory_models_the_dispatched_rows_as_explain_measures_them_on_average():
    """3 x tokens x k x H x 4 bytes per MoE layer held for backward: the sent rows, the received
    ones and the experts' outputs; measured per rank by `explain` (its R follows the routing),
    their mean over the ep ranks is the estimate (sum R = sum S)."""
    from dsfn.estimate import estimate_memory
    got = run_on_ranks(_explain_at_ep2, 2, timeout=120)
    held = [sum((s + 2 * r) * b for s, r, b in layers) for _, layers, _ in got]
    est = estimate_memory(TinyMoE(), [expert_parallel(PLAN, model=TinyMoE())], 2, tx=dsfn.optim.sgd(0.1),
                          batch=(8, 8))
    assert est.dispatched == sum(held) / 2 and held[0] != held[1]
    assert "dispatched" in str(est) and "3 x 64 rows" in str(est)


# -- aux-loss-free balancing (DeepSeek-V3's router bias) -------------------------------------------

RATE = 0.05


def _ds3_batches():
    g = torch.Generator().manual_seed(2)
    return [{"input_ids": torch.randint(0, 101, (4, 16), generator=g)} for _ in range(3)]


def _ds3_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def train_ds3(mesh=None, outer="none"):
    """DeepSeek-V3 under expert_parallel(bias_update_rate=RATE)."""
    if mesh:
        init_mesh(**mesh)
    model = make_tiny_causal_lm("deepseek_v3")
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*_outer(outer), expert_parallel("auto", model=model, bias_update_rate=RATE))(
        train_step_for(apply_fn, _ds3_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9), buffers=apply_fn.buffers)
    losses = []
    for batch in _ds3_batches():
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    full = step.gather(state)
    return losses, {"params": full.params, "buffers": full.buffers}


def _ds3_reference():
    """The same training in one process with the bias update written out in plain torch: each
    router's chosen experts counted by a forward hook, b += rate * sign(mean - count)."""
    model = make_tiny_causal_lm("deepseek_v3")
    apply_fn, params = dsfn.functionalize(model)
    counts = {}

    def hook(name):
        def count(module, args, out):
            counts[name] = counts.get(name, 0) + torch.bincount(out[2].reshape(-1), minlength=4).double()
        return count
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(hook(name))
    step = compose()(train_step_for(apply_fn, _ds3_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9), buffers=apply_fn.buffers)
    losses = []
    for batch in _ds3_batches():
        counts.clear()
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        buffers = dict(state.buffers)
        for name, c in counts.items():
            key = f"{name}.e_score_correction_bias"
            buffers[key] = buffers[key] + RATE * torch.sign(c.mean() - c).float()
        state = state.replace(buffers=buffers)
    full = step.gather(state)
    return losses, {"params": full.params, "buffers": full.buffers}


@pytest.mark.parametrize("outer,world,mesh", [("none", 1, {"ep": 1}), ("none", 2, {"ep": 2}),
                                              ("zero3", 4, {"dp": 2, "ep": 2})])
def test_aux_loss_free_bias_equals_a_plain_torch_reference(outer, world, mesh):
    pytest.importorskip("transformers")
    ref = _ds3_reference()
    assert any(b.abs().sum() > 0 for k, b in ref[1]["buffers"].items() if k.endswith("e_score_correction_bias"))
    got = run_on_ranks(train_ds3, world, mesh, outer, timeout=300)
    for losses, state in got:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), **TOL)
        assert_trees_close(state, ref[1], **TOL)


def test_aux_loss_free_bias_needs_a_router_bias_and_the_states_buffers():
    model = TinyMoE()
    with pytest.raises(ConfigError, match="no \\[4\\] buffer named 'e_score_correction_bias'"):
        expert_parallel(PLAN, model=model, bias_update_rate=0.001)
    with pytest.raises(ConfigError, match="bias_update_rate=-1"):
        expert_parallel(PLAN, model=model, bias_update_rate=-1)
