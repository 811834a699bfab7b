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
