"""`dsfn.ops.tiled`: sequence-tiled compute (ALST's TiledMLP), its model helpers and tiled loss.

- forward, input gradient and parameter gradients equal the untiled function (fp32:
  forward to 1e-6, gradients to rtol 1e-5) over drawn shapes (T not a multiple of tiles,
  tiles > T, tiles 1..5), for a module, a TiledMLP and a closure with explicit params;
- dropout: backward replays each tile's forward RNG (equal to running the same tiles by
  hand from the same seed) and the caller's RNG stream is as after forward;
- parameter hooks (Tensor hooks, post-accumulate hooks, dsfn's data-parallel `_Tap`) fire
  once per backward with tiles=4;
- `tile_mlps` on `dsfn.models.gpt.GPT` and a tiny HF Llama: outputs and gradients equal the
  untiled model, parameter names unchanged, and `dsfn.functionalize` + `dsfn.value_and_grad`
  (also with `release=True`) equal the untiled model's;
- `tiled_loss` equals `F.cross_entropy(reduction="sum")` and the valid-token count;
- under ZeRO stages 2 and 3 on 2 ranks, a tiled GPT trains as the untiled single process
  (stage 3: gathered weights saved as shards and re-gathered for the recompute);
- memory: the bytes autograd holds (saved tensors, peak over forward and backward) for
  batch 1, seq 4096, hidden 256, MLP 4x are under a third of the untiled figure.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dsfn
from dsfn.errors import ConfigError, ShapeError
from dsfn.models.gpt import GPT, GPTConfig, gpt_loss
from dsfn.ops.tiled import (
    TiledMLP,
    sequence_tiled_compute,
    tile_mlps,
    tiled_loss,
    untile_mlps,
)
from dsfn.engines.data_parallel import _Tap


def make_mlp(d: int, ratio: int = 4, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, ratio * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(ratio * d, d))


def grads_of(fn, x: torch.Tensor, params: list[torch.Tensor], gy: torch.Tensor):
    x = x.detach().requires_grad_(True)
    y = fn(x)
    gs = torch.autograd.grad(y, [x, *params], gy)
    return y.detach(), gs


def assert_close_all(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------
# equality with the untiled function


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 19), d=st.integers(1, 8), tiles=st.integers(1, 5),
       kind=st.sampled_from(["module", "wrapper", "closure"]), seed=st.integers(0, 2**16))
def test_matches_untiled(b, t, d, tiles, kind, seed):
    mlp = make_mlp(d, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g)
    gy = torch.randn(b, t, d, generator=g)
    params = list(mlp.parameters())
    if kind == "module":
        def tiled(x): return sequence_tiled_compute(mlp, x, tiles)
    elif kind == "wrapper":
        tiled = TiledMLP(mlp, tiles)
    else:
        w1, b1, w2, b2 = params

        def per_token(h):
            return F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)

        def tiled(x): return sequence_tiled_compute(per_token, x, tiles, params=params)
    y_ref, g_ref = grads_of(mlp, x, params, gy)
    y, g_tiled = grads_of(tiled, x, params, gy)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    # a weight gradient is a sum over every token: tiles add per-tile partial sums, one
    # matmul adds them in another order; with up to 57 tokens of O(1) terms that moves a
    # result by a few 1e-6 (2.1e-6 measured, seed 14549), so atol 1e-5 here
    assert_close_all(g_tiled, g_ref, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims_and_no_grad(dim):
    mlp = make_mlp(4)
    x = torch.randn(7, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(sequence_tiled_compute(mlp, x, 3, dim=dim), mlp(x), rtol=0, atol=1e-6)
    y_ref, g_ref = grads_of(mlp, x, list(mlp.parameters()), torch.ones(7, 5, 4))
    y, g = grads_of(lambda x: sequence_tiled_compute(mlp, x, 3, dim=dim), x, list(mlp.parameters()),
                    torch.ones(7, 5, 4))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    assert_close_all(g, g_ref)


def test_param_grads_without_input_grad_and_bf16():
    mlp = make_mlp(8)
    x = torch.randn(2, 9, 8)                 # x does not require grad: only parameter gradients
    ref = torch.autograd.grad(mlp(x).square().sum(), list(mlp.parameters()))
    got = torch.autograd.grad(sequence_tiled_compute(mlp, x, 4).square().sum(), list(mlp.parameters()))
    assert_close_all(got, ref)
    mb = copy.deepcopy(mlp).to(torch.bfloat16)          # bf16: accumulated in fp32 across tiles
    xb = x.to(torch.bfloat16)
    ref = torch.autograd.grad(mb(xb).float().sum(), list(mb.parameters()))
    got = torch.autograd.grad(sequence_tiled_compute(mb, xb, 4).float().sum(), list(mb.parameters()))
    for a, r in zip(got, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), r.float(), rtol=2e-2, atol=2e-2 * r.abs().max().item())


def test_recompute_replays_autocast():
    mlp = make_mlp(16)
    x = torch.randn(2, 9, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ref, y = mlp(x), sequence_tiled_compute(mlp, x, 3)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    g_ref = torch.autograd.grad(y_ref.float().sum(), [x, *mlp.parameters()])
    g = torch.autograd.grad(y.float().sum(), [x, *mlp.parameters()])
    for a, r in zip(g, g_ref):               # bf16 products summed over tiles: bf16 rounding apart
        assert a.dtype == r.dtype == torch.float32
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2 * r.abs().max().item())


# ---------------------------------------------------------------------------------------
# dropout: the recompute replays each tile's RNG


def test_dropout_replays_forward_rng():
    mlp = make_mlp(6, dropout=0.5, seed=1).train()
    x = torch.randn(2, 11, 6)
    gy = torch.randn(2, 11, 6)
    params = list(mlp.parameters())
    tiles = 4

    torch.manual_seed(123)
    y, g = grads_of(lambda x: sequence_tiled_compute(mlp, x, tiles), x, params, gy)
    after_tiled = torch.rand(4)

    # by hand: the same tiles, in order, from the same seed, with autograd storing everything
    torch.manual_seed(123)
    y_ref, g_ref = grads_of(lambda x: torch.cat([mlp(c) for c in x.tensor_split(tiles, dim=1)], dim=1),
                            x, params, gy)
    after_manual = torch.rand(4)

    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    assert_close_all(g, g_ref)
    with torch.no_grad():
        assert not torch.allclose(y, mlp.eval()(x))          # dropout did drop
    torch.testing.assert_close(after_tiled, after_manual, rtol=0, atol=0)   # backward left the stream alone


# ---------------------------------------------------------------------------------------
# parameter hooks fire once per backward


def test_param_hooks_fire_once():
    mlp = make_mlp(4)
    x = torch.randn(2, 12, 4, requires_grad=True)
    counts = {"hook": 0, "post": 0}
    w = mlp[0].weight
    w.register_hook(lambda g: counts.__setitem__("hook", counts["hook"] + 1))
    w.register_post_accumulate_grad_hook(lambda p: counts.__setitem__("post", counts["post"] + 1))
    TiledMLP(mlp, 4)(x).sum().backward()
    assert counts == {"hook": 1, "post": 1}

    # dsfn's way: functional_call with parameters that went through data-parallel taps
    sink_calls: dict[str, int] = {}

    def sink(key, grad):
        sink_calls[key] = sink_calls.get(key, 0) + 1

    params = {n: p.detach().requires_grad_(True) for n, p in mlp.named_parameters()}
    tapped = {n: _Tap.apply(p, sink, n) for n, p in params.items()}
    hook_calls = {n: 0 for n in tapped}
    for n, t in tapped.items():
        t.register_hook(lambda g, n=n: hook_calls.__setitem__(n, hook_calls[n] + 1))
    y = torch.func.functional_call(mlp, tapped, (x,), {})
    y_tiled = torch.func.functional_call(TiledMLP(mlp, 4), {f"mlp.{n}": t for n, t in tapped.items()}, (x,), {})
    torch.testing.assert_close(y_tiled, y, rtol=0, atol=1e-6)
    y_tiled.sum().backward()
    assert sink_calls == {n: 1 for n in tapped}
    assert hook_calls == {n: 1 for n in tapped}


# ---------------------------------------------------------------------------------------
# tile_mlps on real models


def _grad_dict(model, loss):
    names = [n for n, _ in model.named_parameters()]
    gs = torch.autograd.grad(loss, [p for _, p in model.named_parameters()])
    return dict(zip(names, gs))


def _gpt():
    return GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=16), seed=3)


def _check_tiled_model(ref, tiled, batch, loss_fn, n_expected):
    names = tile_mlps(tiled, 3)
    assert len(names) == n_expected and all(n.endswith("mlp") for n in names)
    assert [n for n, _ in tiled.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert list(tiled.state_dict()) == list(ref.state_dict())
    l_ref, l_tiled = loss_fn(ref, batch), loss_fn(tiled, batch)
    torch.testing.assert_close(l_tiled, l_ref, rtol=1e-5, atol=1e-6)
    g_ref, g_tiled = _grad_dict(ref, l_ref), _grad_dict(tiled, l_tiled)
    assert g_ref.keys() == g_tiled.keys()
    for n in g_ref:
        torch.testing.assert_close(g_tiled[n], g_ref[n], rtol=1e-5, atol=1e-6, msg=n)

    # the way dsfn trains: functionalize + value_and_grad (params swapped in per call)
    for release in (False, True):
        m_ref, m_tiled = copy.deepcopy(ref), copy.deepcopy(tiled)   # the tiled forward survives deepcopy
        assert m_tiled.get_submodule(names[0]).forward.module is m_tiled.get_submodule(names[0])
        outs = []
        for m in (m_ref, m_tiled):
            apply_fn, params = dsfn.functionalize(m, release=release)
            params = {k: v.clone() * 1.01 for k, v in params.items()}     # new tensors, as after a step

            def loss(p, b, apply_fn=apply_fn):
                return loss_fn(lambda **kw: apply_fn(p, **kw), b)
            outs.append(dsfn.value_and_grad(loss)(params, batch))
        (v_ref, gr), (v_t, gt) = outs
        torch.testing.assert_close(v_t, v_ref, rtol=1e-5, atol=1e-6)
        assert gr.keys() == gt.keys()
        for n in gr:
            torch.testing.assert_close(gt[n], gr[n], rtol=1e-5, atol=1e-6, msg=n)

    assert untile_mlps(tiled) == names
    assert "forward" not in tiled.get_submodule(names[0]).__dict__


def test_tile_mlps_gpt():
    ref = _gpt()
    ids = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}

    def loss_fn(model, b):
        return gpt_loss(model(input_ids=b["input_ids"]), b["labels"])
    _check_tiled_model(ref, copy.deepcopy(ref), batch, loss_fn, n_expected=2)


def test_tile_mlps_hf_llama():
    pytest.importorskip("transformers")
    from dsfn.testing.models import make_tiny_llama
    ref = make_tiny_llama(seed=0)
    ids = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def loss_fn(model, b):
        return model(input_ids=b["input_ids"], labels=b["labels"]).loss
    _check_tiled_model(ref, copy.deepcopy(ref), batch, loss_fn, n_expected=3)


def test_tile_mlps_retile_and_errors():
    m = _gpt()
    assert tile_mlps(m, 2) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert tile_mlps(m, 5) == ["blocks.0.mlp", "blocks.1.mlp"]      # re-tiles, does not nest
    assert m.blocks[0].mlp.forward.tiles == 5 and m.blocks[0].mlp.forward.previous is None
    assert tile_mlps(m, 2, names=("nothing",)) == []
    with pytest.raises(ConfigError):
        tile_mlps(m, 0)
    with pytest.raises(ConfigError):
        sequence_tiled_compute(make_mlp(2), torch.randn(1, 3, 2), 0)
    with pytest.raises(ShapeError):          # not per-token: the output loses the sequence dim
        sequence_tiled_compute(lambda t: t.sum(1, keepdim=True), torch.randn(1, 5, 2, requires_grad=True), 2)
    with pytest.raises(ShapeError):
        sequence_tiled_compute(make_mlp(2), torch.randn(1, 3, 2), 2, dim=3)


# ---------------------------------------------------------------------------------------
# tiled_loss


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 17), d=st.integers(1, 8), v=st.integers(2, 40),
       tiles=st.integers(1, 5), seed=st.integers(0, 2**16), flat=st.booleans())
def test_tiled_loss_matches_cross_entropy(b, t, d, v, tiles, seed, flat):
    g = torch.Generator().manual_seed(seed)
    shape = (b * t,) if flat else (b, t)
    hidden = torch.randn(*shape, d, generator=g, requires_grad=True)
    weight = torch.randn(v, d, generator=g, requires_grad=True)
    labels = torch.randint(0, v, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.3] = -100
    total, count = tiled_loss(hidden, weight, labels, tiles)
    ref = F.cross_entropy((hidden @ weight.T).float().reshape(-1, v), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)
    assert count.item() == int((labels != -100).sum()) and count.dtype == torch.int64
    g_got = torch.autograd.grad(total * 0.7, [hidden, weight])
    g_ref = torch.autograd.grad(ref * 0.7, [hidden, weight])
    assert_close_all(g_got, g_ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# memory


class _Held:
    """A saved tensor, counted while autograd holds it."""
    live = 0
    peak = 0

    def __init__(self, t):
        self.t, self.n = t, t.numel() * t.element_size()
        _Held.live += self.n
        _Held.peak = max(_Held.peak, _Held.live)

    def __del__(self):
        _Held.live -= self.n


def _saved_bytes(fn, x, params):
    """(bytes autograd saved in forward, peak bytes held over forward + backward)."""
    _Held.live = _Held.peak = 0
    with torch.autograd.graph.saved_tensors_hooks(_Held, lambda h: h.t):
        x = x.detach().requires_grad_(True)
        y = fn(x)
        after_forward = _Held.live
        torch.autograd.grad(y.sum(), [x, *params])
        del y
    return after_forward, _Held.peak


def test_tiling_cuts_saved_activation_memory():
    mlp = make_mlp(256, seed=0)
    x = torch.randn(1, 4096, 256)
    params = list(mlp.parameters())
    fwd_untiled, peak_untiled = _saved_bytes(mlp, x, params)
    fwd_tiled, peak_tiled = _saved_bytes(lambda x: sequence_tiled_compute(mlp, x, 8), x, params)
    mib = 1 << 20
    print(f"\nsaved for backward after forward: untiled {fwd_untiled / mib:.1f} MiB, tiles=8 {fwd_tiled / mib:.1f} MiB; "
          f"peak held over fwd+bwd: untiled {peak_untiled / mib:.1f} MiB, tiles=8 {peak_tiled / mib:.1f} MiB")
    x_bytes = x.numel() * 4
    param_bytes = sum(p.numel() * 4 for p in params)
    assert fwd_tiled <= x_bytes + param_bytes                  # x (and the parameters) only
    assert fwd_untiled >= x_bytes + 2 * 4096 * 1024 * 4        # the [T, 4H] intermediates (fc out, GELU out)
    assert fwd_tiled < fwd_untiled / 3
    assert peak_tiled < peak_untiled / 3


# ---------------------------------------------------------------------------------------
# under ZeRO (2 ranks): gathered weights saved as shards, gradients reduced once


def _gpt_tiled_on_ranks():
    """Untiled for the single-process reference, tiled on the ZeRO ranks."""
    m = GPT(GPTConfig.preset("tiny", n_layer=2))
    if torch.distributed.is_initialized():
        assert tile_mlps(m, 3) == ["blocks.0.mlp", "blocks.1.mlp"]
    return m


@pytest.mark.parametrize("stage", [2, 3])
def test_tiled_gpt_under_zero_equals_untiled_reference(stage):
    from dsfn.testing.models import token_batches
    from dsfn.testing.reference import assert_matches_reference, lm_loss
    from dsfn.transforms import shard_zero
    # SGD: linear in the gradients (Adam turns fp32 rounding of the ~0 key-bias gradients into lr-sized steps)
    assert_matches_reference(lambda: [shard_zero(stage, param_persistence_threshold=0)], _gpt_tiled_on_ranks,
                             lambda: dsfn.optim.sgd(lr=0.1), token_batches(2, 2, 13, 256, seed=3), 2,
                             loss_fn=lm_loss, rtol=1e-5, atol=1e-6)
