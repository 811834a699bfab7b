"""Checkpoints of tensor-parallel states: any tp x dp x ZeRO layout loads any other.

Matrix: tp in {1, 2, 4} x dp in {1, 2} (ZeRO stages varied over the dp=2 layouts, so
Nested(DimShard/tp, FlatShard/dp) pieces are saved and loaded), every saved checkpoint
loaded into every layout: the logical state (params, Adam moments, step) is bitwise the
one that was saved. The export of a tp=2 checkpoint loads in `transformers` and gives
the logits of the trained logical parameters.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_equal
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import async_checkpoint, compose, shard_zero, tensor_parallel

transformers = pytest.importorskip("transformers")

# (tp, dp, ZeRO stage or None)
LAYOUTS = [(1, 1, None), (2, 1, None), (4, 1, None), (1, 2, 3), (2, 2, 1), (4, 2, 3)]
BATCHES = token_batches(2, 4, 8, 101, seed=3)


def _model():
    return make_tiny_causal_lm("qwen2")       # untied head, q/k/v biases: every style's layout is saved


def _step_for(model, tp, dp, zero, extra=()):
    apply_fn, params = dsfn.functionalize(model)
    ts = ([shard_zero(zero)] if zero is not None else []) + ([tensor_parallel("auto", model=model)] if tp > 1 else [])
    return compose(*ts, *extra)(train_step_for(apply_fn, lm_loss)), params


def _logical(step, state) -> dict:
    s = step.gather(state)
    return {"params": s.params, "opt_state": s.opt_state, "step": s.step}


def _save(root, tp, dp, zero):
    init_mesh(dp=dp, tp=tp)
    model = _model()
    step, params = _step_for(model, tp, dp, zero)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    for b in BATCHES:
        state, _ = step(state, b)
    dsfn.checkpoint.save(f"{root}/{tp}x{dp}z{zero}", state)
    return _logical(step, state)


def _load_all(root, tp, dp, zero):
    init_mesh(dp=dp, tp=tp)
    model = _model()
    step, params = _step_for(model, tp, dp, zero)
    like = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    out = {}
    for stp, sdp, sz in LAYOUTS:
        loaded = dsfn.checkpoint.load(f"{root}/{stp}x{sdp}z{sz}", like=like, restore_rng=False)
        out[(stp, sdp, sz)] = _logical(step, loaded)
    return out


def test_tp_dp_checkpoint_matrix_loads_bitwise(tmp_path):
    saved = {}
    for tp, dp, zero in LAYOUTS:
        saved[(tp, dp, zero)] = run_on_ranks(_save, tp * dp, str(tmp_path), tp, dp, zero, timeout=180)[0]
    for tp, dp, zero in LAYOUTS:
        results = run_on_ranks(_load_all, tp * dp, str(tmp_path), tp, dp, zero, timeout=180)
        for rank, got in enumerate(results):
            for src, logical in got.items():
                assert_trees_equal(logical, saved[src], msg=f"saved at tp,dp,zero={src}, loaded at "
                                                            f"{(tp, dp, zero)} on rank {rank}")
    # a tp=4 manifest describes the tp pieces (partition dim, logical shape, packed parts)
    m = dsfn.checkpoint.read_manifest(tmp_path / "4x2z3")
    q = m.leaves["params.model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [64, 64]
    assert q["layout"]["type"] == "Nested" and q["layout"]["inner"] == {"type": "DimShard", "axis": "tp", "dim": 0,
                                                                        "shape": [64, 64]}
    o = m.leaves["params.model.layers.0.self_attn.o_proj.weight"]["layout"]
    assert o["inner"]["dim"] == 1


def _train_async_and_export(root):
    init_mesh(dp=2, tp=2)
    model = _model()
    ckpt = async_checkpoint(f"{root}/ckpt", every=2)
    step, params = _step_for(model, 2, 2, 1, extra=(ckpt,))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    for b in BATCHES:
        state, _ = step(state, b)
    ckpt.wait()
    return _logical(step, state)


def test_async_checkpoint_of_2x2_exports_a_model_transformers_loads_with_the_same_logits(tmp_path):
    final = run_on_ranks(_train_async_and_export, 4, str(tmp_path), timeout=180)[0]
    out = tmp_path / "hf"
    model = _model()
    dsfn.checkpoint.export(tmp_path / "ckpt", out, format="hf", config=model.config)
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(out)
    # the trained logical parameters, put into a fresh model by hand
    reference = _model()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(final["params"][name])
    ids = BATCHES[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    # and the checkpoint holds the last state, bitwise
    like_step, params = _step_for(_model(), 1, 1, None)
    like = like_step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    loaded = dsfn.checkpoint.load(tmp_path / "ckpt", like=like, restore_rng=False)
    assert_trees_equal(_logical(like_step, loaded), final)


def _save_hybrid(root):
    """tp 2 x dp 4 on 2 nodes of 4 ranks, ZeRO-3 sharded over each node's 2 dp ranks: leaves
    are Nested(DimShard/tp, FlatShard/dp_shard) pieces, saved as "layout" slices whose
    coordinates include the split axes."""
    init_mesh(dp=4, tp=2)
    model = _model()
    apply_fn, params = dsfn.functionalize(model)
    step = compose(shard_zero(3, shard_group="node"), tensor_parallel("auto", model=model))(
        train_step_for(apply_fn, lm_loss))
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    for b in BATCHES:
        state, _ = step(state, b)
    dsfn.checkpoint.save(f"{root}/hybrid_tp", state)
    return _logical(step, state)


def _load_into(root, name, tp, dp, zero, group=None):
    init_mesh(dp=dp, tp=tp)
    model = _model()
    apply_fn, params = dsfn.functionalize(model)
    ts = [shard_zero(zero, shard_group=group)] if zero is not None else []
    ts += [tensor_parallel("auto", model=model)] if tp > 1 else []
    step = compose(*ts)(train_step_for(apply_fn, lm_loss))
    like = step.init_state(params, dsfn.optim.adamw(lr=1e-2))
    return _logical(step, dsfn.checkpoint.load(f"{root}/{name}", like=like, restore_rng=False))


def test_a_hybrid_tp_checkpoint_loads_into_flat_layouts_and_back(tmp_path):
    saved = run_on_ranks(_save_hybrid, 8, str(tmp_path), timeout=240, ranks_per_node=4)[0]
    m = dsfn.checkpoint.read_manifest(tmp_path / "hybrid_tp")
    assert m.raw["mesh"]["dp_shard"] == 2 and m.raw["mesh"]["dp_replicate"] == 2
    for tp, dp, zero in [(2, 2, 3), (1, 1, None)]:
        for rank, got in enumerate(run_on_ranks(_load_into, tp * dp, str(tmp_path), "hybrid_tp", tp, dp, zero,
                                                timeout=180)):
            assert_trees_equal(got, saved, msg=f"hybrid tp2 x dp4 loaded at tp,dp,zero={(tp, dp, zero)}, rank {rank}")
    # and a flat checkpoint into the hybrid layout
    flat = run_on_ranks(_save, 4, str(tmp_path), 2, 2, 1, timeout=180)[0]
    for rank, got in enumerate(run_on_ranks(_load_into, 8, str(tmp_path), "2x2z1", 2, 4, 3, "node", timeout=240,
                                            ranks_per_node=4)):
        assert_trees_equal(got, flat, msg=f"flat tp2 x dp2 loaded into hybrid tp2 x dp4, rank {rank}")
