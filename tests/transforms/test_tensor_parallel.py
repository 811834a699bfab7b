"""tensor_parallel: every stack equals the single-process reference.

Tolerances: fp32 rtol 1e-5 on losses and the final logical state. The optimizer here is
SGD with momentum (state in opt_state): a rowwise layer's all-reduce adds partial
matmul sums in another order than one matmul, so gradients differ from the reference in
the last bits (~1e-6 relative, measured); Adam divides each gradient element by its own
magnitude, which turns those last-bit differences in elements whose gradient is near
`eps` into visible update differences — a property of Adam, not of the split, so Adam
runs are compared on losses only. bf16 compute: rtol 2e-2 on losses (bf16's 8-bit
mantissa); the fp32 masters and momentum within rtol 5e-2 / atol 1e-2 (bf16 gradients
summed in another order differ by a few bf16 ulps, ~1e-2 relative, measured; they feed
three momentum steps).
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import ConfigError, MeshError, RankFailure, StackError
from dsfn.models.gpt import GPT, GPTConfig, tp_plan
from dsfn.runtime import init_mesh
from dsfn.state.layout import DimShard, Nested, PackedDimShard, Placed, is_placed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import (
    accumulate,
    clip_grad_norm,
    compose,
    mixed_precision,
    shard_zero,
    tensor_parallel,
)
from dsfn.transforms.tensor_parallel import packed

pytest.importorskip("transformers")

VOCAB = 101          # odd: the vocab-parallel embedding and the gathered LM head pad at every tp


def make_hf(family: str, seed: int = 0, **over):
    """Small random-weight HF causal LMs (no download); 8 query / 4 kv heads: tp 2 and 4."""
    return make_tiny_causal_lm(family, seed, vocab_size=VOCAB, **over)


def make_gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=32))


BATCHES = token_batches(3, 4, 12, VOCAB, seed=1)


def _sgd():
    return dsfn.optim.sgd(lr=0.5, momentum=0.9)


def train(make_model, make_transforms, batches=BATCHES, make_tx=_sgd, mesh=None, inspect=None):
    """Train on this rank (mesh axes `mesh`); (losses, grad norms, logical state)."""
    if mesh:
        init_mesh(**mesh)
    model = make_model()
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*make_transforms(model))(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, make_tx(), seed=0))
    losses, norms = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m.get("grad_norm", float("nan"))))
    extra = inspect(state) if inspect else None
    logical = step.gather(state)
    out = {"params": logical.params, "opt_state": logical.opt_state}
    return losses, norms, out, extra


def check_against_reference(make_model, make_transforms, mesh, make_ref_transforms=lambda m: (),
                            make_tx=_sgd, rtol=1e-5, atol=1e-6, state_rtol=None, inspect=None):
    ref_losses, ref_norms, ref_state, _ = train(make_model, make_ref_transforms, make_tx=make_tx)
    world = 1
    for v in mesh.values():
        world *= v
    results = run_on_ranks(train, world, make_model, make_transforms, BATCHES, make_tx, mesh, inspect, timeout=180)
    for rank, (losses, norms, state, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        if any(n == n for n in ref_norms):
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=rtol, atol=atol)
        if state_rtol is not False:
            assert_trees_close(state, ref_state, rtol=state_rtol or rtol, atol=atol, msg=f"rank {rank} state")
    return results


# -- the HF auto plan -----------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_hf_auto_plan_equals_reference(family, tp):
    check_against_reference(lambda: make_hf(family), lambda m: (tensor_parallel("auto", model=m),), {"tp": tp})


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_tp_on_a_2x2_mesh_equals_reference(family, stage):
    def inspect(state):     # ZeRO shards the tp shards: Nested(tp layout, FlatShard over dp)
        return {p: type(x.layout.inner).__name__ for p, x in tree_placed(state.opt_state)
                if isinstance(x.layout, Nested)}
    results = check_against_reference(lambda: make_hf(family),
                                      lambda m: (shard_zero(stage), tensor_parallel("auto", model=m)),
                                      {"dp": 2, "tp": 2}, inspect=inspect)
    nested = results[0][3]
    assert any(v == "DimShard" for v in nested.values()), nested


def tree_placed(tree_):
    return [(p, x) for p, x in dsfn.tree.leaves_with_path(tree_, is_leaf=is_placed) if isinstance(x, Placed)]


def test_adam_losses_equal_reference_on_2x2_zero3():
    check_against_reference(lambda: make_hf("llama"), lambda m: (shard_zero(3), tensor_parallel("auto", model=m)),
                            {"dp": 2, "tp": 2}, make_tx=lambda: dsfn.optim.adamw(lr=1e-2), state_rtol=False)


def test_with_accumulate_and_clip_norm_counted_once_over_both_axes():
    # the clip threshold is below the gradient norm: the reported norm and the clipped update
    # both need the norm over dp x tp with every piece counted once
    check_against_reference(
        lambda: make_hf("llama"),
        lambda m: (shard_zero(2), tensor_parallel("auto", model=m), accumulate(2), clip_grad_norm(0.5)),
        {"dp": 2, "tp": 2}, make_ref_transforms=lambda m: (clip_grad_norm(0.5),))


def test_bf16_mixed_precision_within_stated_tolerance():
    # the gathered (logical) params are mixed precision's fp32 masters
    results = check_against_reference(
        lambda: make_hf("qwen2"),
        lambda m: (shard_zero(1), tensor_parallel("auto", model=m), mixed_precision(torch.bfloat16)),
        {"dp": 2, "tp": 2}, make_ref_transforms=lambda m: (mixed_precision(torch.bfloat16),), rtol=2e-2, atol=1e-2,
        state_rtol=5e-2)
    assert results[0][2]["params"]["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32


# -- a hand-built GPT with a fused qkv and a user plan ---------------------------------------------------

def test_gpt_fused_qkv_user_plan_equals_reference():
    def inspect(state):
        return {p: x.layout for p, x in tree_placed(state.params)}
    results = check_against_reference(make_gpt, lambda m: (tensor_parallel(tp_plan(), model=m),), {"tp": 2},
                                      inspect=inspect)
    layouts = results[0][3]
    qkv = layouts["blocks.0.attn.qkv.weight"]
    assert isinstance(qkv, PackedDimShard) and qkv.parts == (32, 32, 32)
    assert layouts["blocks.0.attn.proj.weight"] == DimShard("tp", 1, (32, 32))
    assert "blocks.0.attn.proj.bias" not in layouts         # rowwise bias: whole, added once


def test_gpt_fused_qkv_rank_holds_its_heads_of_each_part():
    def fn():
        init_mesh(tp=2)
        model = make_gpt()
        full = model.blocks[0].attn.qkv.weight.detach().clone()
        apply_fn, params = dsfn.functionalize(model)
        step = compose(tensor_parallel(tp_plan(), model=model))(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, _sgd()))
        return full, state.params["blocks.0.attn.qkv.weight"].data
    for r, (full, piece) in enumerate(run_on_ranks(fn, 2)):
        want = torch.cat([full[p * 32 + r * 16: p * 32 + (r + 1) * 16] for p in range(3)])
        assert torch.equal(piece, want)


# -- uneven splits: padding never reaches the loss, norms or the state --------------------------------

def test_uneven_vocab_and_mlp_padding_stays_zero_and_out_of_loss_and_norm():
    def inspect(state):
        pads = []
        for p, x in tree_placed(state.params):
            lay = x.layout
            if isinstance(lay, DimShard) and x.data.shape[lay.dim] * 4 != lay.shape[lay.dim]:
                pads.append((p, tuple(x.data.shape), lay.shape))
        # rank 3 holds the padded tail: its pad rows / cols must still be exactly zero
        emb = state.params["model.embed_tokens.weight"]
        r = dsfn.runtime.current_mesh().local_rank("tp")
        valid = max(0, min(emb.data.shape[0], VOCAB - r * emb.data.shape[0]))
        return pads, bool((emb.data[valid:] == 0).all())
    results = check_against_reference(
        lambda: make_hf("llama"), lambda m: (tensor_parallel("auto", model=m), clip_grad_norm(1e9)), {"tp": 4},
        make_ref_transforms=lambda m: (clip_grad_norm(1e9),), inspect=inspect)
    for _, _, state, (pads, emb_pad_zero) in results:
        assert pads, "the test model must need padding (vocab 101, intermediate 90 at tp=4)"
        assert emb_pad_zero
        assert state["params"]["model.embed_tokens.weight"].shape == (VOCAB, 64)


# -- consistency guard ----------------------------------------------------------------------------

def test_guard_fires_when_a_tp_group_gets_different_batches():
    def fn():
        init_mesh(tp=2)
        model = make_gpt()
        apply_fn, params = dsfn.functionalize(model)
        step = compose(tensor_parallel(tp_plan(), model=model))(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, _sgd()))
        batch = dict(BATCHES[0])
        if dsfn.runtime.current_mesh().local_rank("tp") == 1:
            batch["labels"] = batch["labels"].clone()
            batch["labels"][0, 0] = (batch["labels"][0, 0] + 1) % VOCAB
        step(state, batch)
    with pytest.raises(RankFailure, match=r"batch tensor 'labels' differs between the ranks of a tp group"):
        run_on_ranks(fn, 2)


def test_guard_passes_identical_batches_over_dp_splits():
    # 2 x 2: each dp rank gets other rows, but the two tp ranks of each group the same ones
    check_against_reference(make_gpt, lambda m: (shard_zero(0), tensor_parallel(tp_plan(), model=m)),
                            {"dp": 2, "tp": 2})


# -- bad plans fail early with a clear error ------------------------------------------------------------

def test_unknown_style_and_bad_arguments_fail_at_construction():
    with pytest.raises(ConfigError, match="'diagonal', which dsfn does not support"):
        tensor_parallel({"lm_head": "diagonal"}, model=make_gpt())
    with pytest.raises(ConfigError, match="pass model="):
        tensor_parallel("auto")
    with pytest.raises(ConfigError, match="only colwise styles"):
        packed("rowwise", 3)
    # issue 31: auto=False would be overridden by plan="auto" (accepted and ignored): refused
    with pytest.raises(ConfigError, match=r"tensor_parallel\('auto', auto=False\).*pass a plan dict"):
        tensor_parallel("auto", model=make_gpt(), auto=False)
    assert tensor_parallel("auto", model=make_gpt(), auto=True).auto
    with pytest.raises(StackError, match="must be outside tensor_parallel"):
        compose(tensor_parallel(tp_plan(), model=make_gpt()), shard_zero(1))


def test_bad_plans_fail_at_place():
    def fn(kind):
        init_mesh(tp=4 if kind == "heads" else 2)
        # 12 query / 3 kv heads: tp=4 neither divides the kv heads nor is a multiple of them
        model = (make_hf("llama", hidden_size=48, num_attention_heads=12, num_key_value_heads=3) if kind == "heads"
                 else make_gpt())
        plan = {"heads": "auto", "nothing": {"blocks.*.attn.nope": "colwise"},
                "type": {"blocks.*.ln1": "colwise"}, "parts": {"blocks.*.attn.qkv": packed("colwise", (10, 10, 10))},
                "noplan": "auto"}[kind]
        apply_fn, params = dsfn.functionalize(model)
        step = compose(tensor_parallel(plan, model=model))(train_step_for(apply_fn, lm_loss))
        step.place(dsfn.TrainState.create(params, _sgd()))
    cases = {"heads": (MeshError, r"tp=4 does not fit the attention heads .*\(12 query heads, 3 key/value heads\).*"
                                  r"valid tp degrees are \[1, 3, 6, 12\]"),
             "nothing": (ConfigError, "plan pattern 'blocks.\\*.attn.nope' matches no module"),
             "type": (ConfigError, "'blocks.0.ln1' is a LayerNorm; style 'colwise' applies to nn.Linear"),
             "parts": (ConfigError, r"parts sum to 30, but the Linear has 96 output features"),
             "noplan": (ConfigError, "GPT declares no tp plan")}   # frozen planned weights: tests/transforms/test_zero_frozen.py
    for kind, (err, pattern) in cases.items():
        with pytest.raises(RankFailure, match=pattern) as info:
            run_on_ranks(fn, 4 if kind == "heads" else 2, kind)
        assert err.__name__ in str(info.value)


def test_tied_weights_with_conflicting_styles_are_rejected():
    def fn():
        init_mesh(tp=2)
        model = make_gpt()
        plan = {**tp_plan(), "tok_emb": "embedding_colwise"}      # dim 1, but lm_head splits dim 0
        apply_fn, params = dsfn.functionalize(model)
        compose(tensor_parallel(plan, model=model))(train_step_for(apply_fn, lm_loss)).place(
            dsfn.TrainState.create(params, _sgd()))
    with pytest.raises(RankFailure, match="is shared by .* different layouts"):
        run_on_ranks(fn, 2)


def test_user_entries_override_the_hf_plan():
    def fn():
        init_mesh(tp=2)
        model = make_hf("llama")
        t = tensor_parallel({"lm_head": "replicate", "model.embed_tokens": "replicate"}, model=model, auto=True)
        styles = t.module_styles()
        return styles["lm_head"], styles["model.layers.0.mlp.down_proj"]
    assert run_on_ranks(fn, 2)[0] == ("replicate", "rowwise")


# -- communication: Megatron's count ----------------------------------------------------------------

def test_tp_collectives_per_step_match_megatron_count():
    """Per block: 2 all-reduces of the activation in forward (o_proj, down_proj) and 2 in
    backward (the attention and MLP inputs' gradients: q/k/v and gate/up share one); plus
    the vocab-parallel embedding's forward all-reduce, the LM head input's backward
    all-reduce, and the logits' all-gather."""
    layers, batch = 3, BATCHES[0]

    def fn():
        init_mesh(tp=2)
        model = make_hf("llama", num_hidden_layers=layers)
        apply_fn, params = dsfn.functionalize(model)
        step = compose(tensor_parallel("auto", model=model))(train_step_for(apply_fn, lm_loss))
        state = step.init_state(params, _sgd())
        state, _ = step(state, batch)             # the first step also runs the batch guard
        return step.explain(state, batch).collectives
    comm = run_on_ranks(fn, 2)[0]
    b, t = batch["input_ids"].shape
    activation = b * t * 64 * 4
    assert comm[("tp", "all_reduce")] == (4 * layers + 2, (4 * layers + 2) * activation)
    assert comm[("tp", "all_gather")] == (1, b * t * 2 * 51 * 4)      # vocab 101 -> 2 x 51 (padded) logits
    assert set(comm) == {("tp", "all_reduce"), ("tp", "all_gather")}


# -- property: any sizes, any tp, padding included --------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsfn.testing.models import make_mlp, regression_batches  # noqa: E402
from dsfn.testing.reference import mse_loss  # noqa: E402

MLP_PLAN = {"layers.0": "colwise", "layers.1": "rowwise", "layers.2": "colwise_rep"}


def _mlp_run(sizes, seed, tp, batches):
    if tp > 1:
        init_mesh(tp=tp)
    model = make_mlp(sizes, seed)
    apply_fn, params = dsfn.functionalize(model)
    ts = (tensor_parallel(MLP_PLAN, model=model), clip_grad_norm(1e9)) if tp > 1 else (clip_grad_norm(1e9),)
    step = compose(*ts)(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, _sgd()))
    losses, norms = [], []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    return losses, norms, dict(step.gather(state).params)


@settings(max_examples=8, deadline=None)
@given(hidden=st.integers(1, 9), out=st.integers(1, 5), tp=st.sampled_from([2, 3, 4]), seed=st.integers(0, 99))
def test_property_mlp_any_sizes_and_tp_equal_reference(hidden, out, tp, seed):
    """Sizes not divisible by tp (even smaller than tp: whole ranks of padding) train like
    the single process: losses, the global grad norm and the final parameters."""
    sizes = [4, hidden, hidden + 2, out]
    batches = regression_batches(2, 6, 4, out, seed=seed)
    ref = _mlp_run(sizes, seed, 1, batches)
    for losses, norms, params in run_on_ranks(_mlp_run, tp, sizes, seed, tp, batches):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref[1]), rtol=1e-5, atol=1e-6)
        assert_trees_close(params, ref[2], rtol=1e-5, atol=1e-6)


def _offloaded_layouts(state):
    from dsfn.state.layout import Offloaded
    return sorted({f"{type(x.layout).__name__}({type(x.layout.inner).__name__})"
                   for _, x in tree_placed(state.opt_state) if isinstance(x.layout, Offloaded)})


@pytest.mark.parametrize("mesh,device,opt", [({"tp": 2}, "cpu", "sgd"), ({"dp": 2, "tp": 2}, "cpu", "sgd"),
                                              ({"dp": 2, "tp": 2}, "nvme", "adamw")],
                         ids=["tp2-cpu-sgd", "dp2xtp2-cpu-sgd", "dp2xtp2-nvme-adamw"])
def test_offload_under_tensor_parallel_equals_reference(mesh, device, opt, tmp_path):
    """The host optimizer updates this rank's tp piece (ZeRO's piece of it at dp2 x tp2): the
    run equals the single process (the state with SGD-momentum, the losses with AdamW, whose
    update turns reduction-order bits into visible differences near eps), and the tp pieces'
    state lives on the host."""
    from dsfn.transforms import offload
    path = str(tmp_path) if device == "nvme" else None
    zero = (shard_zero(1),) if "dp" in mesh else ()
    tx = {"sgd": _sgd, "adamw": lambda: dsfn.optim.adamw(1e-2)}[opt]
    results = check_against_reference(
        lambda: make_hf("llama"), lambda m: (*zero, tensor_parallel("auto", model=m), offload(device, path=path)),
        mesh, make_tx=tx, inspect=_offloaded_layouts, state_rtol=None if opt == "sgd" else False)
    kinds = results[0][3]
    inner = "Nested" if "dp" in mesh else "DimShard"
    assert any(k.endswith(f"({inner})") for k in kinds), kinds      # tp pieces offloaded, not only whole leaves


def test_zenflow_is_refused_with_the_reason():
    from dsfn.transforms import zenflow
    with pytest.raises(StackError, match="does not compose with zenflow: zenflow picks the top-k columns"):
        compose(tensor_parallel(tp_plan(), model=make_gpt()), zenflow())


def test_replicated_style_sums_partial_gradients_of_per_head_norms():
    """Qwen3's q_norm / k_norm see only this rank's heads: their gradients are partial, and
    the `replicated` style (HF's replicated_with_grad_allreduce) sums them over tp. Planned
    as `replicate` instead (no sum), training leaves the reference — the sum is needed."""
    override = {"model.layers.*.self_attn.q_norm": "replicate", "model.layers.*.self_attn.k_norm": "replicate"}
    with pytest.raises(AssertionError, match="losses|state"):
        check_against_reference(lambda: make_hf("qwen3"),
                                lambda m: (tensor_parallel(override, model=m, auto=True),), {"tp": 2})


def _tiled_llama():
    model = make_hf("llama")
    dsfn.ops.tile_mlps(model, 3)          # the MLP is recomputed in backward, tp collectives included
    return model


def test_tiled_mlps_under_tp_equal_reference():
    check_against_reference(_tiled_llama, lambda m: (shard_zero(3), tensor_parallel("auto", model=m)),
                            {"dp": 2, "tp": 2})


def test_batch_fingerprint_is_computed_where_the_batch_lives():
    """The first-step batch check hashes each batch tensor on its own device (a CPU `arange`
    times CUDA bytes failed every tp > 1 GPU run at step 1); `meta` stands in for CUDA here."""
    from dsfn.transforms.tensor_parallel import batch_fingerprint
    meta = batch_fingerprint(torch.empty(3, 5, dtype=torch.int64, device="meta"))
    assert meta.device.type == "meta" and meta.shape == (7,)
    ids = torch.arange(15).reshape(3, 5)
    fp = batch_fingerprint(ids)
    assert fp[:3].tolist() == [15, 3, 5] and int(fp[5]) == int(ids.view(torch.uint8).long().sum())
    assert not torch.equal(fp, batch_fingerprint(ids.flip(1)))      # the weighted sum sees the order


def test_hf_plan_entries_for_modules_the_model_lacks_are_passed_over_but_a_users_are_not():
    """Qwen2-MoE's HF tp plan names a dense MLP (`layers.*.mlp.gate_proj`) that a model whose
    every layer is sparse lacks: passed over, as transformers does; the same pattern written
    by the user is an error, and so is an HF plan none of whose entries fit (a wrapper)."""
    pytest.importorskip("transformers")
    from dsfn.testing.models import make_tiny_causal_lm
    from dsfn.runtime.mesh import Mesh, on_virtual_mesh
    from dsfn.transforms import tensor_parallel
    model = make_tiny_causal_lm("qwen2_moe")
    with on_virtual_mesh(Mesh.virtual({"tp": 2})):
        styles = tensor_parallel("auto", model=model).module_styles()
        assert "model.layers.0.self_attn.q_proj" in styles and not any(".mlp." in n for n in styles)
        with pytest.raises(ConfigError, match="'model.layers.\\*.mlp.gate_proj' matches no module"):
            tensor_parallel({"model.layers.*.mlp.gate_proj": "colwise"}, model=model).module_styles()


def _tp_step_peak(layers: int, with_remat: bool) -> int:
    """The allocation high-water mark of one tp2 step (after a first) on a tiny Llama."""
    from dsfn.testing.alloc import allocation_peak
    from dsfn.transforms import remat
    init_mesh(tp=2)
    model = make_hf("llama", num_hidden_layers=layers)
    apply_fn, params = dsfn.functionalize(model)
    stack = [tensor_parallel("auto", model=model)] + ([remat()] if with_remat else [])
    step = compose(*stack, donate=True)(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, _sgd(), seed=0))
    batch = token_batches(1, 8, 64, VOCAB, seed=2)[0]
    state, _ = step(state, batch)
    holder = [state]

    def one():
        holder[0], _ = step(holder[0], batch)
    return allocation_peak(one)[1]


def test_remat_under_tp_frees_each_layer_after_its_backward():
    """Under tp, q/k/v (and gate/up) share one gradient-summing copy of their input, cached for
    the forward. The cache must not keep a layer's inputs (and the graph behind them) past the
    next layer: under remat that held every recomputed layer's norm inputs until the end of
    backward, and remat saved a fifth of the memory instead of most of it. Measured: without
    remat the peak grows by a layer's activations per layer; with remat by little more than
    the layer's input."""
    full = [run_on_ranks(_tp_step_peak, 2, n, False, timeout=120)[0] for n in (2, 6)]
    kept = [run_on_ranks(_tp_step_peak, 2, n, True, timeout=120)[0] for n in (2, 6)]
    per_layer_full = (full[1] - full[0]) / 4
    per_layer_remat = (kept[1] - kept[0]) / 4
    assert per_layer_remat < 0.35 * per_layer_full, (per_layer_remat, per_layer_full)
