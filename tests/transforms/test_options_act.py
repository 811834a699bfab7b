"""Issue 31: an argument accepted at `compose` / `place` either changes what happens or raises a
ConfigError naming why it cannot apply here.

For a representative set of options (at least one per transform, and `compose(donate=)`),
each test runs the option against its default and asserts a difference one can observe (a
result, a layout, a counter or gauge, a file, a metric), or that the option is refused where
it cannot act. Options that are no-ops only on a degenerate mesh (bucket sizes at dp=1, a tp
plan at tp=1) or without a GPU (pin_memory) are real settings and are not refused; they are
exercised here where they act. `mixed_precision(reduce_dtype=)` is covered with its own fix
(tests/transforms/test_mixed_precision.py).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import dsfn
from dsfn import checkpoint as ck
from dsfn import tree
from dsfn.errors import ConfigError, DistributedError, DonatedStateError, ShapeError, StackError
from dsfn.runtime import collectives as C
from dsfn.runtime import counters, init_mesh
from dsfn.checkpoint.format import committed_steps
from dsfn.state.layout import DimShard, Offloaded, Placed, is_placed
from dsfn.state.master import MasterState
from dsfn.testing import run_on_ranks
from dsfn.transforms.loss_scale import LossScaleError
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import mse_loss_fp32, train_step_for
from dsfn.transforms import (accumulate, async_checkpoint, clip_grad_norm, compile_units, compose, data_parallel,
                             loss_scale, mixed_precision, offload, remat, sequence_parallel, shard_zero,
                             tensor_parallel, zenflow)

SIZES = [6, 10, 7, 4]
BATCHES = regression_batches(3, 4, 6, 4, seed=11)


def _train(stack, batches=BATCHES, tx=None, model=None, loss=mse_loss_fp32, donate=False):
    """(step, final physical state, metrics per step) of `stack` on the MLP (or `model`)."""
    model = model if model is not None else make_mlp(SIZES, 0)
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*stack, donate=donate)(train_step_for(apply_fn, loss))
    state = step.place(dsfn.TrainState.create(params, tx if tx is not None else dsfn.optim.adamw(lr=1e-2)))
    metrics = []
    for b in batches:
        state, m = step(state, b)
        metrics.append({k: float(v) for k, v in m.items()})
    return step, state, metrics


def _params(step, state):
    return step.gather(state).params


def _differ(a, b) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(tree.leaves(a), tree.leaves(b)))


# -- compose ------------------------------------------------------------------------------------------

def test_compose_donate_invalidates_the_input_state():
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
    for donate in (False, True):
        step = compose(accumulate(1), donate=donate)(train_step_for(apply_fn, mse_loss_fp32))
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
        new, _ = step(state, BATCHES[0])
        if donate:
            with pytest.raises(DonatedStateError):
                step(state, BATCHES[1])
        else:
            step(state, BATCHES[1])          # the input stays valid
    with pytest.raises(StackError, match="donate is True or False"):
        compose(donate="yes")


# -- accumulate, clip_grad_norm, loss_scale -----------------------------------------------------------------

def test_accumulate_n_splits_the_batch():
    calls = []

    def loss(apply_fn, params, batch):
        calls.append(batch["x"].shape[0])
        return mse_loss_fp32(apply_fn, params, batch)
    _train([accumulate(1)], BATCHES[:1], loss=loss)
    _train([accumulate(2)], BATCHES[:1], loss=loss)
    assert calls == [4, 2, 2]
    with pytest.raises(ShapeError, match="multiple of 3"):          # cannot apply: 4 rows
        _train([accumulate(3)], BATCHES[:1])


def test_clip_max_norm_changes_the_update():
    s1, st1, m1 = _train([clip_grad_norm(1e-3)])
    s2, st2, m2 = _train([clip_grad_norm(1e3)])
    assert m1[0]["grad_norm"] == m2[0]["grad_norm"] > 1e-3        # the same norm, clipped only in one
    assert _differ(_params(s1, st1), _params(s2, st2))


def test_loss_scale_options_change_the_scale_sequence():
    scales = lambda t: [m["loss_scale"] for m in _train([t], regression_batches(4, 4, 6, 4, seed=1))[2]]
    assert scales(loss_scale(init_scale=8.0))[0] == 8.0
    assert scales(loss_scale(init_scale=8.0, window=1)) == [8.0, 16.0, 32.0, 64.0]      # doubles every window
    assert scales(loss_scale(init_scale=8.0, window=2)) == [8.0, 8.0, 16.0, 16.0]
    assert scales(loss_scale(init_scale=8.0)) == [8.0] * 4
    assert scales(loss_scale(static=8.0)) == [8.0] * 4
    # overflow rules, on the pure update (DeepSpeed's DynamicLossScaler)
    over = lambda t, n: [float(ls.scale) for ls in _updates(t, [True] * n)]
    assert over(loss_scale(init_scale=8.0, hysteresis=1), 2) == [4.0, 2.0]
    assert over(loss_scale(init_scale=8.0, hysteresis=2), 2) == [8.0, 4.0]
    assert over(loss_scale(init_scale=8.0, hysteresis=1, min_scale=4.0), 1) == [4.0]
    with pytest.raises(LossScaleError):
        over(loss_scale(init_scale=8.0, hysteresis=1, min_scale=4.0), 2)
    refill = lambda c: int(_updates(loss_scale(hysteresis=3, consecutive_hysteresis=c), [True, False])[-1].hysteresis)
    assert (refill(True), refill(False)) == (3, 2)
    with pytest.raises(ConfigError, match="would do nothing"):         # cannot apply: a static scale
        loss_scale(static=8.0, window=1)


def _updates(t, overflows):
    ls, out = t.initial_state(), []
    for o in overflows:
        ls = t.updated(ls, o)
        out.append(ls)
    return out


# -- mixed_precision ------------------------------------------------------------------------------------------

class _WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)
        self.register_buffer("gain", torch.ones(4), persistent=False)
        self.seen: list[torch.dtype] = []

    def forward(self, x):
        self.seen.append(self.gain.dtype)
        return self.lin(x) * self.gain


def test_mixed_precision_options_change_dtypes():
    def placed(mp):
        step, state, _ = _train([mp], BATCHES[:1])
        return state
    st = placed(mixed_precision(torch.float16))
    assert {p.dtype for p in tree.leaves(st.params)} == {torch.float16}
    assert {p.dtype for p in tree.leaves(placed(mixed_precision(torch.bfloat16)).params)} == {torch.bfloat16}
    assert {m.dtype for m in tree.leaves(st.opt_state.master)} == {torch.float32}
    assert isinstance(st.opt_state, MasterState)
    with pytest.raises(ConfigError, match="parameters are float32"):   # cannot apply: no cast without a master
        placed(mixed_precision(torch.bfloat16, master_dtype=torch.bfloat16))
    seen = []

    def loss(apply_fn, params, batch):
        seen.append(batch["x"].dtype)
        return mse_loss_fp32(apply_fn, params, {**batch, "x": batch["x"].to(torch.bfloat16)})
    for cast in (True, False):
        _train([mixed_precision(torch.bfloat16, cast_inputs=cast)], BATCHES[:1], loss=loss)
    assert seen == [torch.bfloat16, torch.float32]
    for dtype in (None, torch.bfloat16):
        model = _WithConstant()
        _train([mixed_precision(torch.float32, buffer_dtype=dtype)], BATCHES[:1], model=model)
        assert model.seen == [dtype or torch.float32]


def test_cast_inputs_acts_when_param_and_master_dtype_are_the_same():
    """bf16 inputs reach fp32 weights as fp32 under mixed_precision(torch.float32) (cast_inputs
    acts when param and master dtype agree too); with cast_inputs=False they arrive as bf16."""
    seen = []

    def loss(apply_fn, params, batch):
        seen.append(batch["x"].dtype)
        return mse_loss_fp32(apply_fn, params, batch)
    half = [{"x": b["x"].to(torch.bfloat16), "y": b["y"]} for b in BATCHES[:1]]
    _train([mixed_precision(torch.float32)], half, loss=loss)
    assert seen == [torch.float32]
    with pytest.raises(RuntimeError):             # control: uncast, bf16 inputs meet fp32 weights
        _train([mixed_precision(torch.float32, cast_inputs=False)], half, loss=loss)
    assert seen == [torch.float32, torch.bfloat16]


# -- offload ------------------------------------------------------------------------------------------

def test_offload_options_change_where_and_how_the_update_runs(tmp_path, monkeypatch):
    from dsfn.ops import cpu_adam
    from dsfn.runtime import nvme
    step, state, _ = _train([offload("cpu")], BATCHES[:1])
    assert all(isinstance(x.layout, Offloaded) for x in tree.leaves(state.opt_state, is_leaf=is_placed)
               if isinstance(x, Placed))
    kernel = []
    real = cpu_adam.cpu_adamw_multi_
    monkeypatch.setattr(cpu_adam, "cpu_adamw_multi_", lambda *a, **k: (kernel.append(k.get("cores")), real(*a, **k))[1])
    _train([offload("cpu", host_kernel=False)], BATCHES[:1])
    assert kernel == []
    _train([offload("cpu")], BATCHES[:1])
    _train([offload("cpu", cores=0.5)], BATCHES[:1])
    assert kernel == [None, 0.5]
    released = []
    real_release = nvme.release
    monkeypatch.setattr(nvme, "release", lambda ts: (released.append(len(ts)) if ts else None, real_release(ts))[1])
    groups = {}
    for sub in (64 << 20, 64):
        released.clear()
        with offload("nvme", path=tmp_path / str(sub), subgroup_bytes=sub) as o:
            _train([o], BATCHES[:1])
            assert os.listdir(tmp_path / str(sub))         # the store's files live under path
        groups[sub] = len(released)
    assert groups[64] > groups[64 << 20] > 0               # smaller sub-groups: more written-and-released groups
    # refused where they cannot act
    with pytest.raises(ConfigError, match="subgroup_bytes"):
        offload("cpu", subgroup_bytes=64)
    # params=True acts on one rank too (ZeRO-Infinity on one device): the parameters live on the host
    _, placed, _ = _train([shard_zero(3), offload("cpu", params=True)], BATCHES[:1])
    leaves = tree.leaves(placed.params, is_leaf=is_placed)
    assert leaves and all(isinstance(x, Placed) and isinstance(x.layout, Offloaded) for x in leaves)
    with pytest.raises(ConfigError, match="overlap=True"):
        _train([accumulate(2), offload("cpu", overlap=True)], BATCHES[:1])


# -- remat --------------------------------------------------------------------------------------------

def test_remat_options_change_what_is_checkpointed_and_saved():
    def gauges(r):
        C.reset_gauges()
        _train([r], BATCHES[:1])
        return {k: C.gauge_max.get(k, 0) for k in ("remat.modules", "remat.policy_saved_bytes",
                                                   "remat.offloaded_bytes")}
    plain = gauges(remat())
    assert plain == {"remat.modules": 3, "remat.policy_saved_bytes": 0, "remat.offloaded_bytes": 0}
    assert gauges(remat(modules=["layers.0"]))["remat.modules"] == 1
    assert gauges(remat(policy="matmuls"))["remat.policy_saved_bytes"] > 0
    assert gauges(remat(offload="cpu"))["remat.offloaded_bytes"] > 0
    with pytest.raises(StackError, match="partition_activations"):       # cannot apply: no tensor_parallel
        compose(remat(partition_activations=True))


# -- zenflow ------------------------------------------------------------------------------------------

def test_zenflow_options_change_the_selection_and_the_host_update(monkeypatch):
    from dsfn.ops import cpu_adam

    def run(z, n=1):
        _, state, _ = _train([z], BATCHES[:n])
        return state.extra["zenflow"], state.opt_state
    picked = lambda zs: {n: int(s.sum()) for n, s in zs["selected"].items()}
    assert picked(run(zenflow(topk_ratio=0.5))[0]) == {"layers.0.weight": 3, "layers.1.weight": 5,
                                                       "layers.2.weight": 3}
    assert picked(run(zenflow(topk_ratio=0.2))[0]) == {"layers.0.weight": 1, "layers.1.weight": 2,
                                                       "layers.2.weight": 1}
    assert set(picked(run(zenflow(full_warm_up_rounds=5))[0]).values()) == {0}     # warm-up: no selection
    assert "pending" in run(zenflow(overlap=True))[0] and "pending" not in run(zenflow())[0]
    buffered = lambda u: float(sum(b.abs().sum() for b in tree.leaves(run(zenflow(update_interval=u))[1].buffer)))
    assert buffered(1) == 0 and buffered(2) > 0          # flushed after 1 update, still summing at 2
    kernel = []
    real = cpu_adam.cpu_adamw_multi_
    monkeypatch.setattr(cpu_adam, "cpu_adamw_multi_", lambda *a, **k: (kernel.append(1), real(*a, **k))[1])
    run(zenflow(update_interval=1, host_kernel=False))
    assert kernel == []
    run(zenflow(update_interval=1))
    assert kernel
    with pytest.raises(ConfigError, match="host_kernel=False"):      # cannot apply: offload decides
        compose(offload("cpu"), zenflow(host_kernel=False))


# -- async_checkpoint --------------------------------------------------------------------------------------

def test_async_checkpoint_options_change_what_is_written(tmp_path):
    def run(root, **kw):
        t = async_checkpoint(root, **kw)
        _, state, metrics = _train([t], regression_batches(4, 4, 6, 4, seed=2))
        t.wait()
        return metrics
    m = run(tmp_path / "a", every=2)
    assert committed_steps(str(tmp_path / "a")) == [2, 4]
    run(tmp_path / "b", every=1, keep=2)
    assert committed_steps(str(tmp_path / "b")) == [3, 4]
    assert "ckpt_cached_bytes" in m[1] and m[1]["ckpt_cached_bytes"] == 0     # auto: host tensors by reference
    assert run(tmp_path / "c", every=2, capture="copy")[1]["ckpt_cached_bytes"] > 0
    assert run(tmp_path / "d", every=2, capture="copy", host_cache_size=0)[1]["ckpt_cached_bytes"] == 0
    assert "ckpt_cached_bytes" not in run(tmp_path / "e", every=2, engine="sync")[1]
    run(tmp_path / "f", every=2, user_data=lambda s: {"at": int(s.step)})
    assert ck.read_manifest(str(tmp_path / "f")).user_data == {"at": 4}
    with pytest.raises(ConfigError, match="host_cache_size"):          # cannot apply: nothing is cached
        async_checkpoint(tmp_path, every=1, capture="reference", host_cache_size=1)
    with pytest.raises(ConfigError, match="timeout_s"):
        async_checkpoint(tmp_path, every=1, timeout_s=-1.0)


# -- compile_units ------------------------------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.lin = nn.Linear(a, b)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Blocks(nn.Module):
    """The MLP as blocks defined here (dynamo does not trace torch's own nn.Linear.forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Block(a, b) for a, b in zip(SIZES[:-1], SIZES[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_compile_units_options_pick_the_blocks_and_reach_torch_compile():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    for units, want in ((None, 3), (["layers.0"], 1)):
        graphs.clear()
        torch._dynamo.reset()              # the blocks' code is compiled afresh (no cache hit from the last run)
        with compile_units(units, backend=backend) as cu:
            _train([cu], BATCHES[:1], model=_Blocks())
            assert len(cu.compiled) == want
        assert len(graphs) >= want          # the keyword reached torch.compile: our backend compiled them
    with pytest.raises(ConfigError, match="matches no module"):
        _train([compile_units(["nope.*"], backend=backend)], BATCHES[:1], model=_Blocks())


# -- sequence_parallel ---------------------------------------------------------------------------------------

def test_sequence_parallel_label_options_act_in_one_process():
    seen = []

    def train_step(state, batch):
        seen.append(dict(batch))
        return state, {}
    state = dsfn.TrainState.create({"w": torch.zeros(1)}, dsfn.optim.sgd(lr=0.1))
    lab = torch.arange(8).reshape(2, 4)
    batch = {"input_ids": lab.clone(), "lab": lab}
    for sp in (sequence_parallel(), sequence_parallel(shift_labels=True, labels_key="lab", ignore_index=-7)):
        step = compose(sp)(train_step)
        step(step.place(state), batch)
    assert "shift_labels" not in seen[0]
    assert seen[1]["shift_labels"].tolist() == [[1, 2, 3, -7], [5, 6, 7, -7]]
    with pytest.raises(ConfigError, match="seq_length_is_variable=False"):   # cannot apply: variable lengths
        sequence_parallel(seq_length=4)


# -- two ranks: shard_zero, data_parallel, tensor_parallel ----------------------------------------------------

def _dp_rank():
    """Per config: layouts after place and the collectives / gauges of one step, on dp=2."""
    init_mesh()
    out = {}
    rows = []

    def loss(apply_fn, params, batch):
        rows.append(batch["x"].shape[0])
        return mse_loss_fp32(apply_fn, params, batch)
    configs = {
        "z1": lambda: shard_zero(1), "z3": lambda: shard_zero(3),
        "z3_persist": lambda: shard_zero(3, param_persistence_threshold=1000),
        "z3_pf0": lambda: shard_zero(3, prefetch=0), "z3_unit0": lambda: shard_zero(3, units=["layers.0"]),
        "z2": lambda: shard_zero(2), "z2_rs16": lambda: shard_zero(2, reduce_bucket_size=16),
        "z2_ag16": lambda: shard_zero(2, allgather_bucket_size=16),
        "z2_whole": lambda: shard_zero(2, split_batch=False),
        "dp": lambda: data_parallel(), "dp_tiny": lambda: data_parallel(bucket_mb=1e-5),
    }
    for name, make in configs.items():
        apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))
        step = compose(make())(train_step_for(apply_fn, loss))
        state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=1e-2)))
        kinds = {type(x.layout).__name__ if isinstance(x, Placed) else "whole"
                 for x in tree.leaves(state.params, is_leaf=is_placed)}
        opt_kinds = {type(x.layout).__name__ for x in tree.leaves(state.opt_state, is_leaf=is_placed)
                     if isinstance(x, Placed)}
        C.reset_gauges()
        counters.reset()
        rows.clear()
        step(state, regression_batches(1, 4, 6, 4, seed=3)[0])
        out[name] = dict(params=kinds, opt=opt_kinds, ag=counters.calls(None, "all_gather"),
                         rs=counters.calls(None, "reduce_scatter"), ar=counters.calls(None, "all_reduce"),
                         live=C.gauge_max.get("zero3.live_units"), rows=list(rows))
    return out


def test_zero_and_data_parallel_options_change_layouts_and_collectives():
    for r in run_on_ranks(_dp_rank, 2, timeout=120):
        assert r["z1"]["params"] == {"whole"} and r["z1"]["opt"] == {"FlatShard"}
        assert r["z3"]["params"] == {"FlatShard"}
        assert r["z3_persist"]["params"] == {"whole"}              # small parameters stay whole
        assert (r["z3"]["live"], r["z3_pf0"]["live"]) == (2, 1)     # prefetch: the next unit gathered early
        assert r["z3_unit0"]["ag"] != r["z3"]["ag"]                 # units: other gather groups
        assert r["z2_rs16"]["rs"] > r["z2"]["rs"]                   # reduce_bucket_size: more buckets
        assert r["z2_ag16"]["ag"] > r["z2"]["ag"]                   # allgather_bucket_size: more buckets
        assert (r["z2"]["rows"], r["z2_whole"]["rows"]) == ([2], [4])   # split_batch
        assert r["dp_tiny"]["ar"] > r["dp"]["ar"]                   # bucket_mb: more buckets


def _tp_rank(check: bool):
    from dsfn.models.gpt import GPT, GPTConfig, tp_plan
    init_mesh(tp=2)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32))
    apply_fn, params = dsfn.functionalize(model)

    def loss(apply_fn, params, batch):
        logits = apply_fn(params, batch["input_ids"])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    step = compose(tensor_parallel(tp_plan(), model=model, check_batches=check))(train_step_for(apply_fn, loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1)))
    split = sorted({n for n, x in state.params.items() if isinstance(x, Placed) and isinstance(x.layout, DimShard)})
    from dsfn.runtime import rank
    batch = token_batches(1, 2, 8, 64, seed=rank())[0]        # a different batch on each tp rank
    try:
        step(state, batch)
        return split, None
    except DistributedError as e:
        return split, str(e)


def test_tensor_parallel_plan_and_check_batches_act():
    for check in (True, False):
        for split, err in run_on_ranks(_tp_rank, 2, check, timeout=120):
            assert "blocks.0.mlp.fc.weight" in split and "blocks.0.mlp.proj.weight" in split
            assert (err is not None) == check, err
    from dsfn.models.gpt import GPT, GPTConfig
    with pytest.raises(ConfigError, match="auto=False"):                 # cannot apply: plan='auto'
        tensor_parallel("auto", model=GPT(GPTConfig.preset("tiny")), auto=False)
