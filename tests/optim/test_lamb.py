"""`dsfn.optim.lamb` equals DeepSpeed's FusedLamb: its pure-torch twin
(`deepspeed.ops.op_builder.npu.fused_lamb.NPUFusedLamb.lamb`, the kernel's rule written in
torch, run here on CPU) over several steps and option sets (tolerance fp32 rtol 1e-6: the
update's multiplications are ordered differently); the trust ratio is per tensor and of
the logical tensor under ZeRO-3 (world 2 equals one process); a `"type": "Lamb"` ds_config
builds it with FusedLamb's parameters. Negative control: without the trust ratio (all
ratios 1) the result differs from DeepSpeed's.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import assert_matches_reference

npu = pytest.importorskip("deepspeed.ops.op_builder.npu.fused_lamb")


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    params = [torch.randn(s, generator=g) for s in shapes]
    params.append(torch.zeros(3))                 # ||p|| = 0: the ratio is 1
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    return params, grads


def _deepspeed(params, grads, lr, betas, eps, wd, bias_correction, eps_inside_sqrt, max_coeff, min_coeff):
    ps = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for step, gs in enumerate(grads, start=1):
        for p, mk, vk, g in zip(ps, m, v, gs):
            npu.NPUFusedLamb.lamb(p, torch.tensor([]), mk, vk, g, lr, betas[0], betas[1], max_coeff, min_coeff, eps,
                                  1.0, step, 0 if eps_inside_sqrt else 1, bias_correction, wd)
    return ps


def _dsfn(params, grads, tx):
    tree = {f"p{k}": p.clone() for k, p in enumerate(params)}
    state = tx.init(tree)
    for gs in grads:
        updates, state = tx.update({f"p{k}": g for k, g in enumerate(gs)}, state, tree)
        tree = dsfn.optim.apply_updates(tree, updates)
    return [tree[f"p{k}"] for k in range(len(params))]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), wd=st.sampled_from([0.0, 0.01]), bias_correction=st.booleans(),
       eps_inside_sqrt=st.booleans(), coeffs=st.sampled_from([(10.0, 0.01), (0.5, 0.2)]))
def test_lamb_equals_deepspeeds_fused_lamb(seed, wd, bias_correction, eps_inside_sqrt, coeffs):
    params, grads = _tensors(seed)
    kw = dict(betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, bias_correction=bias_correction,
              eps_inside_sqrt=eps_inside_sqrt, max_coeff=coeffs[0], min_coeff=coeffs[1])
    ref = _deepspeed(params, grads, 1e-2, kw["betas"], kw["eps"], wd, bias_correction, eps_inside_sqrt, *coeffs)
    got = _dsfn(params, grads, dsfn.optim.lamb(1e-2, **kw))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_negative_control_without_the_trust_ratio_it_differs():
    params, grads = _tensors(0)
    ref = _deepspeed(params, grads, 1e-2, (0.9, 0.999), 1e-8, 0.0, True, False, 10.0, 0.01)
    unit = dsfn.optim.lamb(1e-2, max_coeff=1.0, min_coeff=1.0)        # every ratio clamped to 1
    got = _dsfn(params, grads, unit)
    assert any(not torch.allclose(a, b, rtol=1e-4) for a, b in zip(got, ref))


def test_lamb_under_zero3_at_two_ranks_equals_one_process():
    """The per-tensor norms are the logical tensors' (ZeRO-3 shards combined), else the ratio differs."""
    assert_matches_reference(lambda: [dsfn.transforms.shard_zero(3)], lambda: make_mlp([6, 10, 3]),
                             lambda: dsfn.optim.lamb(1e-2, weight_decay=0.01), regression_batches(3, 8, 6, 3), 2,
                             rtol=1e-5, atol=1e-6)


def test_a_lamb_ds_config_builds_fused_lambs_settings():
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
           "optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01, "max_coeff": 0.5,
                                                    "min_coeff": 0.2, "betas": [0.9, 0.99], "eps": 1e-6}}}
    ds = dsfn.from_ds_config(cfg, world_size=1)
    params, grads = _tensors(1)
    ref = _deepspeed(params, grads, 1e-2, (0.9, 0.99), 1e-6, 0.01, True, False, 0.5, 0.2)
    for a, b in zip(_dsfn(params, grads, ds.tx), ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(dsfn.errors.ConfigError, match="amsgrad"):
        dsfn.from_ds_config({**cfg, "optimizer": {"type": "Lamb", "params": {"amsgrad": True}}}, world_size=1)
