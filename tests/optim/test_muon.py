"""dsfn.optim.muon: DeepSpeed's MuonWithAuxAdam as a GradientTransformation.

The reference below is written here from the published algorithm (Keller Jordan's Muon,
as vendored by DeepSpeed in `runtime/zero/muon/original_muon.py`): momentum lerp,
Nesterov lerp, the quintic Newton-Schulz on the Frobenius-normalised wide orientation,
`sqrt(max(1, rows/cols))` scaling, decoupled weight decay; the non-Muon parameters use
`torch.optim.AdamW`. It runs NS in fp32 and dsfn is asked for `ns_dtype=torch.float32`,
so the two agree to rtol 1e-5 (atol 1e-6 x the largest |param|: near-zero entries).

Tolerances stated where looser: low-precision NS vs fp32, relative Frobenius error of the
update: bf16 (the default on a bf16 GPU, both methods) < 0.15, fp16 (DeepSpeed's "gram"
dtype) < 0.03 (measured: bf16 0.025-0.05, "gram" the larger; fp16 ~0.005; DeepSpeed's own
test allows 0.40 against its fp32 reference); "gram" vs "standard" in fp32: 1e-4 abs on
updates of magnitude ~1, params after several steps rtol 1e-4. The default NS dtype is
per device (`ns_compute_dtype`): fp32 on CPU, so default CPU updates equal fp32 ones.
"""
from __future__ import annotations

import itertools
import sys
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dsfn
import dsfn.optim as O
from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.ops import dispatch
from dsfn.optim.muon import (
    gram_newton_schulz,
    muon_matrix_update,
    newton_schulz,
    ns_compute_dtype,
    orthogonalize,
)
from dsfn.testing.models import make_mlp, make_tiny_llama, regression_batches

SETTINGS = settings(deadline=None, max_examples=15, derandomize=True)
F32 = torch.float32
RTOL, ATOL_PER_UNIT = 1e-5, 1e-6
A, B, C = 3.4445, -4.7750, 2.0315


# ---------------------------------------------------------------------------------------
# reference (published algorithm), fp32, in-place like the original


def ref_zeropower(G: torch.Tensor, steps: int) -> torch.Tensor:
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        M = X @ X.mT
        P = B * M + C * M @ M
        X = A * X + P @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def ref_muon_update(grad, mom, beta, ns_steps, nesterov):
    mom.lerp_(grad, 1 - beta)
    update = grad.lerp_(mom, beta) if nesterov else mom
    if update.ndim == 4:
        update = update.view(len(update), -1)
    update = ref_zeropower(update, ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


class RefMuonWithAuxAdam:
    """Muon on `muon_names`, torch.optim.AdamW on the rest; lrs may change per step."""

    def __init__(self, params, muon_names, *, beta, nesterov, ns_steps, wd, adam_betas, adam_eps, adam_wd):
        self.p = {n: x.clone() for n, x in params.items()}
        self.muon_names = [n for n in params if n in muon_names]
        self.mom = {n: torch.zeros_like(self.p[n]) for n in self.muon_names}
        self.adam_params = {n: torch.nn.Parameter(x.clone()) for n, x in params.items() if n not in muon_names}
        self.adam = (torch.optim.AdamW(list(self.adam_params.values()), lr=1.0, betas=adam_betas, eps=adam_eps,
                                       weight_decay=adam_wd, foreach=False) if self.adam_params else None)
        self.beta, self.nesterov, self.ns_steps, self.wd = beta, nesterov, ns_steps, wd

    def step(self, grads, muon_lr, adam_lr):
        for n in self.muon_names:
            u = ref_muon_update(grads[n].clone(), self.mom[n], self.beta, self.ns_steps, self.nesterov)
            self.p[n].mul_(1 - muon_lr * self.wd)
            self.p[n].add_(u.reshape(self.p[n].shape), alpha=-muon_lr)
        if self.adam is not None:
            for n, q in self.adam_params.items():
                q.grad = grads[n].clone()
            self.adam.param_groups[0]["lr"] = adam_lr
            self.adam.step()
            for n, q in self.adam_params.items():
                self.p[n] = q.detach().clone()


def assert_close_params(got: dict, ref: dict, scale: float, rtol=RTOL):
    for n, want in ref.items():
        torch.testing.assert_close(got[n], want, rtol=rtol, atol=ATOL_PER_UNIT * scale, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------------------------------
# strategies

side = st.integers(1, 9)
matrix_shape = st.one_of(
    side.map(lambda n: (n, n)),                                             # square
    st.tuples(side, side).map(lambda t: (t[0] + t[1], t[1])),               # tall
    st.tuples(side, side).map(lambda t: (t[0], t[0] + t[1])),               # wide
    st.tuples(st.integers(1, 3), side, side),                               # 3-D: batched NS
    st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),  # conv
)
vector_shape = st.one_of(side.map(lambda n: (n,)), st.just(()))
mixed_shapes = st.lists(st.one_of(matrix_shape, matrix_shape, vector_shape), min_size=1, max_size=5).filter(
    lambda ss: any(len(s) >= 2 for s in ss))


def make_params(shapes, gen, names=None):
    names = names or [f"blocks.{i}.w" for i in range(len(shapes))]
    return {n: torch.randn(s, generator=gen) for n, s in zip(names, shapes)}


def run_both(params, tx, ref, steps, gen, lrs):
    state = tx.init(params)
    p = params
    for k in range(steps):
        grads = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
        updates, state = tx.update(grads, state, p)
        p = O.apply_updates(p, updates)
        ref.step(grads, *lrs(k))
    return p, state


# ---------------------------------------------------------------------------------------
# equality with the reference


@SETTINGS
@given(shapes=mixed_shapes, seed=st.integers(0, 2**16), steps=st.integers(2, 4),
       lr=st.sampled_from([0.02, 0.1]), adam_lr=st.sampled_from([1e-3, 3e-2]),
       beta=st.sampled_from([0.0, 0.9, 0.95]), nesterov=st.booleans(), wd=st.sampled_from([0.0, 0.1]),
       ns_steps=st.integers(1, 6), embed=st.booleans())
def test_matches_reference_fp32(shapes, seed, steps, lr, adam_lr, beta, nesterov, wd, ns_steps, embed):
    gen = torch.Generator().manual_seed(seed)
    names = [f"blocks.{i}.w" for i in range(len(shapes))]
    if embed:
        names[0] = "embed.weight"            # a matrix named embed goes to AdamW
    params = make_params(shapes, gen, names)
    muon_names = {n for n, x in params.items() if x.dim() >= 2 and "embed" not in n}
    if not muon_names:
        params["blocks.extra.w"] = torch.randn(3, 5, generator=gen)
        muon_names = {"blocks.extra.w"}
    tx = O.muon(muon_lr=lr, adam_lr=adam_lr, momentum=beta, nesterov=nesterov, weight_decay=wd, ns_steps=ns_steps,
                ns_method="standard", ns_dtype=F32)
    assert set(tx.split(params)["muon"]) == muon_names
    ref = RefMuonWithAuxAdam(params, muon_names, beta=beta, nesterov=nesterov, ns_steps=ns_steps, wd=wd,
                             adam_betas=(0.9, 0.95), adam_eps=1e-10, adam_wd=wd)
    p, state = run_both(params, tx, ref, steps, gen, lambda k: (lr, adam_lr))
    scale = max([1.0] + [float(x.abs().max()) for x in ref.p.values() if x.numel()])
    assert_close_params(p, ref.p, scale)
    for n in muon_names:                      # momentum buffers: the param's shape, the reference's values
        torch.testing.assert_close(state.momentum[n], ref.mom[n], rtol=RTOL, atol=1e-6)


def test_apply_fast_path_equals_update():
    gen = torch.Generator().manual_seed(3)
    params = make_params([(6, 4), (4,), (3, 8)], gen)
    tx = O.muon(lr=0.05, weight_decay=0.1, ns_dtype=F32)
    s1 = s2 = tx.init(params)
    p1 = p2 = params
    for _ in range(3):
        g = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
        u, s1 = tx.update(g, s1, p1)
        p1 = O.apply_updates(p1, u)
        p2, s2 = O.base.step(tx, g, s2, p2)
    assert_close_params(p1, p2, 1.0, rtol=1e-6)


def test_low_precision_close_to_fp32():
    gen = torch.Generator().manual_seed(0)
    for shape in [(16, 16), (8, 40), (40, 8), (3, 24), (24, 3)]:
        g = torch.randn(shape, generator=gen)
        ref = orthogonalize(g, ns_method="standard", ns_dtype=F32)
        for method in ("standard", "gram"):
            for dtype, tol in ((torch.bfloat16, 0.15), (torch.float16, 0.03)):
                out = orthogonalize(g, ns_method=method, ns_dtype=dtype)
                assert out.dtype == g.dtype
                err = float((out - ref).norm() / ref.norm())
                assert err < tol, (shape, method, dtype, err)
                assert not torch.equal(out, ref)             # it really ran in low precision


def test_default_ns_dtype_follows_the_device(monkeypatch):
    """ns_dtype=None: bf16 on a CUDA device with native bf16 (capability >= 8.0), fp32 on an
    older GPU and on CPU; and orthogonalize really runs in the device's choice."""
    monkeypatch.setattr(torch.version, "hip", None)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    assert ns_compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    cap["v"] = (7, 5)                                                    # Turing: no bf16 arithmetic
    assert ns_compute_dtype(torch.device("cuda", 0)) == F32
    assert ns_compute_dtype("cpu") == F32 and ns_compute_dtype("meta") == F32
    g = torch.randn(8, 40, generator=torch.Generator().manual_seed(3))
    for method in ("standard", "gram"):
        auto = orthogonalize(g, ns_method=method)
        assert torch.equal(auto, orthogonalize(g, ns_method=method, ns_dtype=F32))          # CPU: fp32
        bf16 = orthogonalize(g, ns_method=method, ns_dtype=torch.bfloat16)
        with monkeypatch.context() as m:                     # a device that does bf16: the default follows
            m.setattr(dispatch, "device_supports_bf16", lambda device: True)
            assert torch.equal(orthogonalize(g, ns_method=method), bf16)
        assert not torch.equal(bf16, auto)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_fp16_ns_survives_a_large_finite_gradient(method):
    # normalised before the cast (DeepSpeed's order): a loss-scaled fp32 gradient past fp16's
    # 65504 must not become inf -> nan; NS is scale-free, so the update is the unscaled one's
    g = torch.randn(8, 40, generator=torch.Generator().manual_seed(4))
    big = g * 1e6
    assert float(big.abs().max()) > torch.finfo(torch.float16).max
    out = orthogonalize(big, ns_method=method, ns_dtype=torch.float16)
    assert torch.isfinite(out).all()
    ref = orthogonalize(g, ns_method=method, ns_dtype=F32)
    assert float((out - ref).norm() / ref.norm()) < 0.03


# ---------------------------------------------------------------------------------------
# which params get Muon


def _llama_params():
    _, params = dsfn.functionalize(make_tiny_llama(tie_word_embeddings=False))
    return params


def test_split_rule_on_hf_llama():
    params = _llama_params()
    split = O.muon_split(params)
    assert "model.embed_tokens.weight" in split["adam"] and "lm_head.weight" in split["adam"]
    assert "model.norm.weight" in split["adam"] and "model.layers.0.input_layernorm.weight" in split["adam"]
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj"):
        assert f"model.layers.1.{n}.weight" in split["muon"]
    expect = {n for n, x in params.items() if x.dim() >= 2 and "embed" not in n and "lm_head" not in n}
    assert set(split["muon"]) == expect and set(split["adam"]) == set(params) - expect
    assert split["heads"] == {}
    tx = O.muon()
    assert tx.split(params) == split
    state = tx.init(params)
    # state layout: momentum mirrors each Muon param; adam mu/nu mirror each AdamW param
    assert {p: tuple(x.shape) for p, x in tree.leaves_with_path(state.momentum)} == \
        {n: tuple(params[n].shape) for n in expect}
    assert {p for p, _ in tree.leaves_with_path(state.adam.mu)} == set(params) - expect
    assert {p for p, _ in tree.leaves_with_path(state.adam.nu)} == set(params) - expect
    assert state.use_muon == tuple(n in expect for n in sorted(params))


def test_mask_overrides_the_rule():
    params = _llama_params()
    def only_embed_and_mlp(path, x):
        return path == "model.embed_tokens.weight" or ".mlp." in path
    split = O.muon_split(params, mask=only_embed_and_mlp)
    assert "model.embed_tokens.weight" in split["muon"]
    assert "model.layers.0.self_attn.q_proj.weight" in split["adam"]
    tree_mask = {n: n in split["muon"] for n in params}
    tx = O.muon(mask=tree_mask)
    assert tx.split(params)["muon"] == split["muon"]
    assert O.muon(mask=only_embed_and_mlp).init(params).use_muon == tuple(tree_mask[n] for n in sorted(params))
    with pytest.raises(ConfigError,
                       match=r"selects 'model.layers.0.input_layernorm.weight' of shape \(64,\).*ndim >= 2"):
        O.muon(mask=lambda p, x: "norm" in p).init(params)
    with pytest.raises(ConfigError, match="structure of params"):
        O.muon(mask={"a": True}).init(params)


def _run_lrs(muon_kw, lrs):
    """dsfn with `muon_kw` vs the reference driven with per-step (muon_lr, adam_lr)."""
    gen = torch.Generator().manual_seed(11)
    params = make_params([(5, 7), (7,), (7, 3)], gen, ["blocks.0.w", "blocks.0.b", "lm_head.weight"])
    tx = O.muon(ns_method="standard", ns_dtype=F32, **muon_kw)
    ref = RefMuonWithAuxAdam(params, {"blocks.0.w"}, beta=0.95, nesterov=True, ns_steps=5, wd=0.0,
                             adam_betas=(0.9, 0.95), adam_eps=1e-10, adam_wd=0.0)
    p, state = run_both(params, tx, ref, 4, gen, lrs)
    assert_close_params(p, ref.p, 1.0 + max(float(x.abs().max()) for x in ref.p.values()))
    return state


def test_lr_overrides_defaults_and_schedules():
    # DeepSpeed: no lr at all -> class defaults 0.02 (Muon) / 3e-4 (AdamW)
    st_ = _run_lrs({}, lambda k: (0.02, 3e-4))
    assert float(O.current_lr(st_)) == 0.02 and float(st_.adam.lr) == 3e-4
    # the config lr feeds both groups; muon_lr / adam_lr override it
    _run_lrs({"lr": 0.05}, lambda k: (0.05, 0.05))
    _run_lrs({"lr": 0.05, "adam_lr": 1e-3}, lambda k: (0.05, 1e-3))
    _run_lrs({"lr": 0.05, "muon_lr": 0.01}, lambda k: (0.01, 0.05))
    # schedules, one per group, called with the count of updates already made
    warm = O.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=0.04, warmup_num_steps=3, warmup_type="linear")
    lin = O.linear(1e-2, 1e-3, steps=3)
    st_ = _run_lrs({"muon_lr": warm, "adam_lr": lin}, lambda k: (warm(k), lin(k)))
    assert float(st_.lr) == warm(3) and float(st_.adam.lr) == lin(3)
    assert int(st_.count) == 4


# ---------------------------------------------------------------------------------------
# gram NS, per-head NS, orthogonality


@SETTINGS
@given(shape=matrix_shape, seed=st.integers(0, 2**16))
def test_gram_agrees_with_standard(shape, seed):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    for steps in (1, 2, 3, 5, 7):
        a = orthogonalize(g, ns_steps=steps, ns_method="standard", ns_dtype=F32)
        b = orthogonalize(g, ns_steps=steps, ns_method="gram", ns_dtype=F32)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


def test_gram_optimizer_states_agree_with_standard():
    gen = torch.Generator().manual_seed(5)
    params = make_params([(6, 20), (20, 6), (8, 8), (4,)], gen)
    grads = [{n: torch.randn(x.shape, generator=gen) for n, x in params.items()} for _ in range(4)]
    out = {}
    for method in ("standard", "gram"):
        tx = O.muon(lr=0.02, ns_method=method, ns_dtype=F32)
        s, p = tx.init(params), params
        for g in grads:
            p, s = O.base.step(tx, g, s, p)
        out[method] = (p, s)
    assert_close_params(out["gram"][0], out["standard"][0], 1.0, rtol=1e-4)
    for n in ("blocks.0.w", "blocks.1.w", "blocks.2.w"):
        torch.testing.assert_close(out["gram"][1].momentum[n], out["standard"][1].momentum[n], rtol=1e-4, atol=1e-5)


class _MatmulShapes(TorchDispatchMode):
    """The operand shapes of every matrix product dispatched while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def _check_gram_path(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """orthogonalize(ns_method="gram") on a wide [n, m] matrix iterates on R = X Xᵀ (n x n): X
    itself (the long side m) enters 4 products — R at the start and at the restart, Q X at the
    restart and at the end — where the standard iteration has 2 per step (X Xᵀ and B X)."""
    n, m = g.shape
    with _MatmulShapes() as mode:
        out = orthogonalize(g, ns_steps=steps, ns_method="gram", ns_dtype=F32)
    long_side = [s for s in mode.shapes if m in s[0] + s[1]]
    assert len(long_side) == 4, f"the gram path multiplied through X {len(long_side)} times: {mode.shapes}"
    assert all(a[-2:] == b[-2:] == (n, n) for a, b in mode.shapes if (a, b) not in long_side), mode.shapes
    return out


def test_gram_kernel_iterates_on_the_gram_matrix():
    """The Gram path really iterates on X Xᵀ (counted: products through the long side), and
    gives the standard iteration's result. Negative control: "gram" dispatched to the
    standard kernel (the bug this catches) multiplies through X 2 x 5 times and fails it."""
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    b = _check_gram_path(g)
    assert torch.equal(b, gram_newton_schulz(g, 5, F32))          # orthogonalize's gram path is this kernel
    torch.testing.assert_close(newton_schulz(g, 5, F32), b, rtol=0, atol=1e-4)
    with mock.patch.object(sys.modules["dsfn.optim.muon"], "gram_newton_schulz", newton_schulz):
        with pytest.raises(AssertionError, match="multiplied through X 10 times"):
            _check_gram_path(g)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_per_head_equals_blockwise_by_hand(method):
    heads, hd, d_in = 4, 6, 10
    gen = torch.Generator().manual_seed(2)
    params = {"attn.q_proj.weight": torch.randn(heads * hd, d_in, generator=gen),
              "attn.o_proj.weight": torch.randn(d_in, heads * hd, generator=gen)}
    g = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
    tx = O.muon(lr=1.0, momentum=0.0, nesterov=False, num_heads=heads, ns_method=method, ns_dtype=F32)
    assert tx.split(params)["heads"] == {"attn.q_proj.weight": heads}      # o_proj: heads are on dim 1
    u, _ = tx.update(g, tx.init(params), params)
    # by hand: each head's [hd, d_in] block separately, scaled by its own shape
    q = g["attn.q_proj.weight"]
    blocks = [ref_zeropower(q[h * hd:(h + 1) * hd], 5) * max(1, hd / d_in) ** 0.5 for h in range(heads)]
    torch.testing.assert_close(-u["attn.q_proj.weight"], torch.cat(blocks), rtol=1e-5, atol=1e-4)
    whole = ref_zeropower(q, 5) * max(1, q.size(0) / q.size(1)) ** 0.5
    assert (whole - torch.cat(blocks)).abs().max() > 1e-2            # per-head is not whole-matrix NS
    torch.testing.assert_close(-u["attn.o_proj.weight"], ref_zeropower(g["attn.o_proj.weight"], 5),
                               rtol=1e-5, atol=1e-4)


def test_per_head_on_llama_gqa():
    params = _llama_params()                                       # 4 heads, 2 kv heads, head_dim 16
    split = O.muon_split(params, num_heads=4, num_kv_heads=2)
    assert split["heads"]["model.layers.0.self_attn.q_proj.weight"] == 4
    assert split["heads"]["model.layers.2.self_attn.v_proj.weight"] == 2
    assert not any("o_proj" in n or "mlp" in n for n in split["heads"])
    with pytest.raises(ConfigError, match="num_kv_heads"):          # k/v would be cut into heads of 8
        O.muon(num_heads=4).init(params)
    with pytest.raises(ConfigError, match="does not split into 5 heads"):
        O.muon(num_heads=5).init(params)
    with pytest.raises(ConfigError, match="no Muon parameter is an attention projection"):
        O.muon(num_heads=2).init({"mlp.up.weight": torch.randn(4, 4)})
    # callable form: free choice of names
    split = O.muon_split(params, num_heads=lambda p, x: 2 if p.endswith("o_proj.weight") else None)
    assert set(split["heads"]) == {f"model.layers.{i}.self_attn.o_proj.weight" for i in range(3)}


@settings(deadline=None, max_examples=12, derandomize=True)
@given(rows=st.integers(1, 24), cols=st.integers(1, 24), seed=st.integers(0, 2**16),
       method=st.sampled_from(["standard", "gram"]))
def test_orthogonality_band(rows, cols, seed, method):
    # singular values log-uniform in [1e-3, 1]: after NS (fp32, 12 steps) they all lie in the
    # quintic's attracting band [0.6818, 1.2024] (the "~[0.7, 1.2]" of the published method)
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = 10.0 ** (-3 * torch.rand(k, generator=gen, dtype=torch.float64))
    G = (U * s) @ V.T
    out = orthogonalize(G.float(), ns_steps=12, ns_method=method, ns_dtype=F32)
    sv = torch.linalg.svdvals(out.double() / max(1, rows / cols) ** 0.5)
    assert sv.min() > 0.68 - 1e-3 and sv.max() < 1.2024 + 1e-3, sv
    # and the singular vectors are G's: out ~ U f(s) Vᵀ
    torch.testing.assert_close(U.T @ out.double() @ V, torch.diag(U.T @ out.double() @ V).diag(), rtol=0,
                               atol=1e-3)


# ---------------------------------------------------------------------------------------
# the pure per-matrix function (for the ZeRO integration), purity


def test_muon_matrix_update_is_the_transform_step():
    gen = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(5, 9, generator=gen), "b": torch.randn(9, generator=gen)}
    tx = O.muon(lr=0.1, weight_decay=0.0, ns_dtype=F32)
    state = tx.init(params)
    for _ in range(2):
        g = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
        upd, new_m = muon_matrix_update(state.momentum["w"], g["w"], momentum=0.95, nesterov=True, ns_steps=5,
                                        ns_method="gram", ns_dtype=F32)
        new_p, new_state = O.base.step(tx, g, state, params)
        assert upd.shape == params["w"].shape and new_m.shape == params["w"].shape
        torch.testing.assert_close(new_state.momentum["w"], new_m, rtol=0, atol=0)
        torch.testing.assert_close(new_p["w"], torch.add(params["w"], upd, alpha=-0.1), rtol=0, atol=0)
        params, state = new_p, new_state


def test_update_is_pure():
    gen = torch.Generator().manual_seed(6)
    params = make_params([(4, 6), (6,)], gen)
    grads = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
    tx = O.muon(lr=0.1, weight_decay=0.1)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)               # non-zero momentum
    snap = [x.clone() for x in tree.leaves((grads, state, params))]
    tx.update(grads, state, params)
    O.base.step(tx, grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(snap, tree.leaves((grads, state, params))))


def test_tensor_lr_equals_float_lr():
    gen = torch.Generator().manual_seed(8)
    params = make_params([(5, 3), (3,)], gen)
    grads = [{n: torch.randn(x.shape, generator=gen) for n, x in params.items()} for _ in range(2)]
    out = []
    for lr in (0.05, torch.tensor(0.05, dtype=torch.float64)):
        tx = O.muon(lr=lr, weight_decay=0.1, ns_dtype=F32)
        s, p = tx.init(params), params
        for g in grads:
            p, s = O.base.step(tx, g, s, p)
        out.append(p)
    assert_close_params(out[1], out[0], 1.0, rtol=1e-6)


def test_zero_gradient_gives_no_nan():
    params = {"w": torch.randn(4, 3)}
    tx = O.muon(lr=0.1)
    p, _ = O.base.step(tx, {"w": torch.zeros(4, 3)}, tx.init(params), params)
    assert torch.equal(p["w"], params["w"])


# ---------------------------------------------------------------------------------------
# end to end


def test_compose_train_step_loss_decreases():
    apply_fn, params = dsfn.functionalize(make_mlp([6, 32, 32, 3], seed=0))
    batch = regression_batches(1, 32, 6, 3, seed=0)[0]

    def train_step(state, b):
        loss, grads = dsfn.value_and_grad(
            lambda p: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = dsfn.compose()(train_step)
    state = step.init_state(params, O.muon(lr=0.02, adam_lr=1e-2))
    assert isinstance(state.opt_state, O.MuonState)
    losses = []
    for _ in range(20):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert float(m["lr"]) == 0.02                              # the Muon lr is the reported one
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------------------------------
# bad input


def test_only_1d_params_is_an_error_unless_allowed():
    params = {"norm.weight": torch.randn(5), "bias": torch.randn(5), "embed.weight": torch.randn(4, 5)}
    with pytest.raises(ConfigError, match=r"no parameter qualifies for Muon.*all 3 params would be trained by the "
                                          r"auxiliary AdamW.*dsfn.optim.adamw.*allow_no_muon=True"):
        O.muon().init(params)
    tx = O.muon(adam_lr=1e-2, allow_no_muon=True)
    gen = torch.Generator().manual_seed(0)
    g = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
    with pytest.warns(UserWarning, match=r"all 3 params go to the auxiliary AdamW"):
        state = tx.init(params)
    got, _ = O.base.step(tx, g, state, params)
    want, _ = O.base.step(O.adamw(1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0), g,
                          O.adamw(1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0).init(params), params)
    assert all(torch.equal(got[n], want[n]) for n in params)          # exactly dsfn's adamw


def test_literally_only_1d_params():
    """Only vectors (norms, biases): a ConfigError by default; with allow_no_muon=True a
    warning that names the params and says all of them go to the AdamW, which then trains
    them exactly as dsfn's adamw."""
    params = {"norm.weight": torch.randn(6), "blocks.0.bias": torch.randn(4)}
    with pytest.raises(ConfigError, match=r"no parameter qualifies for Muon.*all 2 params would be trained by "
                                          r"the auxiliary AdamW: blocks\.0\.bias\(4,\), norm\.weight\(6,\)"
                                          r".*allow_no_muon=True"):
        O.muon().init(params)
    tx = O.muon(adam_lr=1e-2, weight_decay=0.1, allow_no_muon=True)
    with pytest.warns(UserWarning, match=r"allow_no_muon=True.*all 2 params go to the auxiliary AdamW.*Muon updates "
                                         r"nothing: blocks\.0\.bias\(4,\), norm\.weight\(6,\)"):
        state = tx.init(params)
    assert tree.leaves(state.momentum) == [] and not any(state.use_muon)
    adamw = O.adamw(1e-2, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    a_state, p, q = adamw.init(params), params, params
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g = {n: torch.randn(x.shape, generator=gen) for n, x in params.items()}
        p, state = O.base.step(tx, g, state, p)
        q, a_state = O.base.step(adamw, g, a_state, q)
    assert all(torch.equal(p[n], q[n]) for n in params) and not torch.equal(p["norm.weight"], params["norm.weight"])


@pytest.mark.parametrize("kwargs, match", [
    ({"ns_steps": 0}, r"ns_steps.*>= 1"),
    ({"ns_steps": 2.5}, r"ns_steps.*integer"),
    ({"momentum": 1.0}, r"momentum.*\[0, 1\)"),
    ({"momentum": -0.1}, r"momentum.*\[0, 1\)"),
    ({"ns_method": "svd"}, r"ns_method.*'gram'.*'standard'"),
    ({"ns_dtype": torch.int32}, r"ns_dtype.*floating"),
    ({"lr": -1.0}, r"learning rate.*>= 0|>= 0"),
    ({"adam_betas": (0.9,)}, r"two coefficients"),
    ({"weight_decay": -0.1}, r"weight_decay"),
    ({"num_kv_heads": 2}, r"num_kv_heads.*int num_heads"),
    ({"num_heads": 0}, r"num_heads.*>= 1"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        O.muon(**kwargs)


def test_bad_grads():
    params = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    tx = O.muon()
    state = tx.init(params)
    with pytest.raises(LeafTypeError, match=r"grad of 'w' has dtype torch.bfloat16 but the param has torch.float32"):
        tx.update({"w": torch.randn(4, 3, dtype=torch.bfloat16), "b": torch.randn(3)}, state, params)
    with pytest.raises(LeafTypeError, match=r"grad of 'w' has shape \(12,\)"):
        tx.update({"w": torch.randn(12), "b": torch.randn(3)}, state, params)
    with pytest.raises(LeafTypeError, match="needs params"):
        tx.update({"w": torch.randn(4, 3), "b": torch.randn(3)}, state)
    with pytest.raises(LeafTypeError, match="state was made for 2 params"):
        tx.update({"w": torch.randn(4, 3)}, state, {"w": params["w"]})
    with pytest.raises(LeafTypeError, match="whole matrix"):
        muon_matrix_update(torch.zeros(12), torch.randn(4, 3))
