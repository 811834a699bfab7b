"""`dsfn.ops.cross_entropy`: the vocabulary-tiled LM-head cross-entropy.

Both implementations (torch tiling; Triton kernels, run by Triton's CPU interpreter here,
compiled on CUDA with DSFN_TEST_DEVICE=cuda: see tests/ops/conftest.py) are checked
against `F.cross_entropy((hidden @ weight.T + bias).float(), labels, ...)` — loss and the
gradients of hidden, weight and bias — over drawn shapes (V not a multiple of the tile,
tiles wider than V, empty batches, ignored tokens, label smoothing, the three reductions,
a random upstream gradient):

- fp32: rtol 1e-5, atol 1e-5 (observed differences ~1e-6: summation order only).
- bf16: the reference is the fp32 computation on the same (bf16-exact) values; logits and
  dlogits are rounded to bf16 inside both implementations (as a bf16 `F.linear` head
  would), so errors are bf16 roundings: loss within rtol = atol = 2e-2, every gradient within
  2e-2 of its largest reference entry (max-norm).

Also: the forward saves no [N, V] tensor; resident peak of forward+backward (torch path,
N=2048, V=32768, D=64, whose fp32 logits are 256 MiB) is <= 1/4 of the materialised
version's and <= 3 tiles + the gradients + 8 MiB; Triton row offsets past 2**31 elements;
a zero hidden dim (D = 0); dispatch; bad input errors.
"""
import ctypes
import math
import os
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dsfn.errors import ConfigError, LeafTypeError, ShapeError
from dsfn.ops import cross_entropy as ce
from dsfn.ops.cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_torch,
    linear_cross_entropy_triton,
)
from dsfn.testing import run_on_ranks

MB = 1 << 20
# DSFN_TEST_DEVICE=cuda (tests/ops/conftest.py): fewer drawn cases, since each new kernel
# specialization compiles (a second or so); the interpreter compiles nothing
ON_CUDA = os.environ.get("DSFN_TEST_DEVICE", "cpu").strip().lower() == "cuda"


# ---------------------------------------------------------------------------------------
# agreement with F.cross_entropy

cases = st.fixed_dictionaries({
    "n": st.one_of(st.integers(0, 33), st.integers(60, 140)),
    "d": st.integers(1, 20),
    "v": st.integers(1, 67),
    "tile": st.integers(4, 80),
    "ignore_index": st.sampled_from([-100, -1, 0, 3]),
    "ignored": st.sampled_from([0.0, 0.3, 1.0]),
    "label_smoothing": st.sampled_from([0.0, 0.1]),
    "reduction": st.sampled_from(["mean", "sum", "none"]),
    "bias": st.booleans(),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "seed": st.integers(0, 2**16),
})


def _inputs(c, device="cpu"):
    g = torch.Generator().manual_seed(c["seed"])
    n, d, v = c["n"], c["d"], c["v"]
    h = torch.randn(n, d, generator=g).to(c["dtype"])
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(c["dtype"])
    b = torch.randn(v, generator=g).to(c["dtype"]) if c["bias"] else None
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < c["ignored"]] = c["ignore_index"]
    go = torch.randn(n, generator=g) if c["reduction"] == "none" else torch.tensor(1.7)
    return tuple(None if t is None else t.to(device) for t in (h, w, b, y, go))


def _loss_and_grads(fn, h, w, b, y, go, c, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    hh, ww, bb = leaves[0], leaves[1], leaves[2] if b is not None else None
    loss = fn(hh, ww, y, bb, ignore_index=c["ignore_index"], label_smoothing=c["label_smoothing"],
              reduction=c["reduction"], **kw)
    loss.backward(go)
    return [loss.detach()] + [t.grad for t in leaves]


def _reference(h, w, b, y, go, c):
    """F.cross_entropy on the materialised logits, in fp32 (inputs upcast exactly)."""
    def full(hh, ww, yy, bb, **kw):
        return F.cross_entropy(hh @ ww.T + (bb if bb is not None else 0.0), yy, **kw)
    return _loss_and_grads(full, h.float(), w.float(), None if b is None else b.float(), y, go, c)


def _check_against_reference(fn, c, device="cpu"):
    h, w, b, y, go = _inputs(c, device)
    got = _loss_and_grads(fn, h, w, b, y, go, c, vocab_tile=c["tile"])
    want = _reference(h, w, b, y, go, c)
    assert got[0].dtype == torch.float32 and got[0].device == h.device
    assert got[0].shape == want[0].shape
    names = ["loss", "grad hidden", "grad weight", "grad bias"]
    terms = _abs_term_scales(h, w, b, y, go, c)
    for name, a, r in zip(names, got, want):
        if c["dtype"] == torch.float32:
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert a.shape == r.shape and a.dtype == (torch.float32 if name == "loss" else c["dtype"])
            a = a.float()
            if name == "loss":
                torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2, equal_nan=True,
                                           msg=lambda m, name=name: f"{name}: {m}")
            elif r.numel():
                # bf16 rounding errors scale with the sum of |terms| of each gradient entry, which
                # cancellation can make far larger than the entry itself (e.g. d = 1, few tokens)
                err, scale = (a - r).abs().max().item(), max(r.abs().max().item(), terms[name])
                assert err <= 2e-2 * scale + 1e-6, f"{name}: max error {err:.3g}, scale {scale:.3g}"
    return got


def _abs_term_scales(h, w, b, y, go, c):
    """{grad name: max over entries of the sum of |terms| that make it}: |dlogits| @ |W| for the
    hidden gradient, |dlogits|^T @ |h| for the weight's, sum |dlogits| for the bias'."""
    logits = (h.float() @ w.float().T + (b.float() if b is not None else 0.0)).detach().requires_grad_()
    F.cross_entropy(logits, y, ignore_index=c["ignore_index"], label_smoothing=c["label_smoothing"],
                    reduction=c["reduction"]).backward(go)
    dl = logits.grad.abs()

    def top(t):
        return t.max().item() if t.numel() else 0.0
    return {"grad hidden": top(dl @ w.float().abs()), "grad weight": top(dl.T @ h.float().abs()),
            "grad bias": top(dl.sum(0))}


@settings(max_examples=100, deadline=None)
@given(cases)
def test_torch_tiled_matches_cross_entropy(c):
    _check_against_reference(linear_cross_entropy_torch, c)


@settings(max_examples=25 if ON_CUDA else 60, deadline=None)
@example(c={"n": 1, "d": 1, "v": 51, "tile": 4, "ignore_index": -100, "ignored": 0.0, "label_smoothing": 0.0,
            "reduction": "mean", "bias": True, "dtype": torch.bfloat16, "seed": 0}, blocks=(64, 2048))
@given(cases, st.sampled_from([(64, 2048), (4, 16), (2, 4)]))
def test_triton_matches_cross_entropy(device, c, blocks):
    """blocks: the interpreter's largest (BLOCK_M, BLOCK_V); small ones make several
    programs per tile and several column blocks per row, with masked edges (on CUDA the
    launch configuration is fixed, so `blocks` changes nothing there)."""
    with mock.patch.object(ce, "_INTERP_BLOCKS", blocks):
        _check_against_reference(linear_cross_entropy_triton, c, device)


@pytest.mark.parametrize("fn", [linear_cross_entropy_torch, linear_cross_entropy_triton])
@pytest.mark.parametrize("n", [0, 5])
def test_empty_or_all_ignored_batch_is_torchs(device, fn, n):
    """mean over no valid token: nan loss and zero grads (torch's answer); sum: 0."""
    for reduction in ("mean", "sum"):
        c = {"ignore_index": -100, "label_smoothing": 0.1, "reduction": reduction}
        h, w, y = (torch.randn(n, 4).to(device), torch.randn(9, 4).to(device),
                   torch.full((n,), -100, device=device))
        loss, gh, gw = _loss_and_grads(fn, h, w, None, y, torch.tensor(1.0, device=device), c, vocab_tile=4)
        assert (loss.isnan() if reduction == "mean" else loss == 0), loss
        assert gh.shape == (n, 4) and torch.equal(gh, torch.zeros_like(gh))
        assert torch.equal(gw, torch.zeros_like(gw))


def test_leading_dims_and_auto_tile(device):
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 7, 8, generator=g).to(device), torch.randn(50, 8, generator=g).to(device)
    y = torch.randint(0, 50, (2, 7), generator=g).to(device)
    ref = F.cross_entropy((h @ w.T).reshape(-1, 50), y.reshape(-1), reduction="none").reshape(2, 7)
    for fn in (linear_cross_entropy_torch, linear_cross_entropy_triton):
        out = fn(h, w, y, reduction="none")          # vocab_tile=None: auto
        assert out.shape == (2, 7)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert ce._auto_tile(2048, 32768) == 8192 and ce._auto_tile(10, 300) == 300
    assert ce._auto_tile(1 << 22, 1 << 17) == 256


def test_forward_saves_no_logits(device):
    """Every tensor kept for backward is at most [N, D] / [V, D] / [N]: no [N, V] logits."""
    n, d, v = 64, 8, 1000
    h = torch.randn(n, d, device=device, requires_grad=True)
    w = torch.randn(v, d, device=device, requires_grad=True)
    y = torch.randint(0, v, (n,), device=device)
    for fn in (linear_cross_entropy_torch, linear_cross_entropy_triton):
        saved = []

        def pack(t, saved=saved):
            saved.append(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(h, w, y, label_smoothing=0.1, vocab_tile=128)
        assert saved and max(t.numel() for t in saved) == v * d
        assert sum(t.numel() for t in saved) <= n * d + v * d + 2 * n + 1
        loss.backward()


@pytest.mark.parametrize("fn", [linear_cross_entropy_torch, linear_cross_entropy_triton, linear_cross_entropy])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_hidden_dim_is_torchs(device, fn, bias, reduction):
    """D = 0: hidden [5, 0], weight [7, 0]; the logits are all zero (the bias, with one), so
    the loss equals F.cross_entropy on materialised zero logits (log 7 per token without a
    bias) and the hidden/weight gradients are zero-sized; label smoothing and an ignored
    token included, tiles narrower than V."""
    g = torch.Generator().manual_seed(5)
    c = {"ignore_index": -100, "label_smoothing": 0.1, "reduction": reduction}
    h, w = torch.empty(5, 0, device=device), torch.empty(7, 0, device=device)
    b = torch.randn(7, generator=g).to(device) if bias else None
    y = torch.tensor([0, 6, 3, -100, 2], device=device)
    go = torch.randn(5, generator=g).to(device) if reduction == "none" else torch.tensor(1.3, device=device)
    got = _loss_and_grads(fn, h, w, b, y, go, c, vocab_tile=3)
    want = _reference(h, w, b, y, go, c)
    assert got[1].shape == (5, 0) and got[2].shape == (7, 0)
    for a, r in zip(got, want):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)
    if not bias and reduction == "mean":
        assert abs(float(got[0]) - math.log(7)) < 1e-6


# ---------------------------------------------------------------------------------------
# peak memory (torch path on CPU; the Triton path runs the same tiling)


def _status(key):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _honest_allocator():
    """glibc: blocks over 128 KiB mmapped and unmapped when freed, free heap trimmed, so the
    resident high-water mark tracks live memory (the process may have inherited settings
    that keep freed memory)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)        # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 << 10)        # M_TRIM_THRESHOLD
    libc.malloc_trim(0)


def _peak_during(fn):
    """Resident high-water mark during fn() minus resident memory before it (a warm-up call first)."""
    fn()
    _honest_allocator()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                   # VmHWM := VmRSS
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


N_MEM, D_MEM, V_MEM = 2048, 64, 32768


def _measure_peaks():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N_MEM, D_MEM, generator=g).requires_grad_()
    w = (torch.randn(V_MEM, D_MEM, generator=g) / 8).requires_grad_()
    y = torch.randint(0, V_MEM, (N_MEM,), generator=g)

    def materialised():
        h.grad = w.grad = None
        F.cross_entropy(h @ w.T, y).backward()

    def tiled(tile):
        def run():
            h.grad = w.grad = None
            linear_cross_entropy_torch(h, w, y, vocab_tile=tile).backward()
        return run

    return {"materialised": _peak_during(materialised), "auto": _peak_during(tiled(None)),
            1024: _peak_during(tiled(1024))}


def test_tiled_peak_memory_is_a_fraction_of_materialised():
    (peaks,) = run_on_ranks(_measure_peaks, 1, timeout=120)
    logits = N_MEM * V_MEM * 4
    grads = (N_MEM + V_MEM) * D_MEM * 4
    print(f"\nforward+backward resident peak, N={N_MEM} D={D_MEM} V={V_MEM} (fp32 logits "
          f"{logits / MB:.0f} MiB): materialised {peaks['materialised'] / MB:.1f} MiB, tiled (auto "
          f"{ce._auto_tile(N_MEM, V_MEM)}) {peaks['auto'] / MB:.1f} MiB, tiled (1024) {peaks[1024] / MB:.1f} MiB")
    assert peaks["materialised"] >= 2 * logits          # the reference really holds the logits
    assert peaks["auto"] <= peaks["materialised"] / 4
    for tile, peak in ((ce._auto_tile(N_MEM, V_MEM), peaks["auto"]), (1024, peaks[1024])):
        bound = 3 * N_MEM * tile * 4 + grads + 8 * MB
        assert peak <= bound, f"tile {tile}: peak {peak / MB:.1f} MiB > {bound / MB:.1f} MiB"


# ---------------------------------------------------------------------------------------
# Triton index math past 2**31 elements


def _rows_past_2_31():
    """A bf16 logits tile whose row 2 starts past element 2**31 (a strided view of a large,
    mostly untouched allocation), through both tile kernels."""
    stride, t = (1 << 30) + 64, 40
    big = torch.empty(3 * stride, dtype=torch.bfloat16)       # virtual; only 3 x 40 touched
    z = big.as_strided((3, t), (stride, 1))
    vals = torch.randn(3, t, generator=torch.Generator().manual_seed(0)).bfloat16()
    z.copy_(vals)
    labels = torch.tensor([5, 39, -100])
    lse, tgt, sumz = torch.full((3,), float("-inf")), torch.zeros(3), torch.zeros(3)
    ce._fwd_tile_triton(z, labels, 0, lse, tgt, sumz, True)
    scale = torch.tensor([1.0, 2.0, 0.0])
    ce._bwd_tile_triton(z, labels, 0, lse, scale, 0.01, 0.9)
    want = ce._bwd_tile_torch(vals, labels, 0, lse, scale, 0.01, 0.9)
    zf = vals.float()
    return (lse - torch.logsumexp(zf, 1), tgt - torch.stack([zf[0, 5], zf[1, 39], zf.new_zeros(())]),
            sumz - zf.sum(1), z.float() - want.float())


def test_triton_int64_row_offsets():
    # In a child: int32 offsets would wrap to a negative address and crash the process.
    (diffs,) = run_on_ranks(_rows_past_2_31, 1, timeout=60)
    for name, diff, tol in zip(("lse", "target", "sum", "dlogits"), diffs, (1e-5, 0, 1e-4, 1.6e-2)):
        assert diff.abs().max().item() <= tol, f"{name}: {diff}"


# ---------------------------------------------------------------------------------------
# dispatch


def test_dispatch(monkeypatch, request):
    calls = []
    real = ce._fwd_tile_triton
    monkeypatch.setattr(ce, "_fwd_tile_triton", lambda *a: calls.append(1) or real(*a))
    h, w, y = torch.randn(3, 4), torch.randn(6, 4), torch.tensor([0, 5, 2])
    want = F.cross_entropy(h @ w.T, y)
    monkeypatch.setenv("DSFN_KERNELS", "auto")            # CPU: the torch reference
    torch.testing.assert_close(linear_cross_entropy(h, w, y), want)
    assert calls == []
    monkeypatch.setenv("DSFN_KERNELS", "triton")          # forced (interpreter on CPU)
    torch.testing.assert_close(linear_cross_entropy(h, w, y, vocab_tile=4), want)
    assert len(calls) == 2
    request.getfixturevalue("no_interpreter")             # cannot run: an error, no fallback
    with pytest.raises(ConfigError, match=r"cannot run on \['cpu'\]: CPU tensors need TRITON_INTERPRET=1"):
        linear_cross_entropy(h, w, y)
    monkeypatch.setenv("DSFN_KERNELS", "auto")
    with pytest.raises(ConfigError, match="cannot run"):
        linear_cross_entropy_triton(h, w, y)


# ---------------------------------------------------------------------------------------
# bad input

H, W, Y = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, -100])
BAD = [
    ("hidden 1-D", {"hidden": torch.randn(8)}, ShapeError, "hidden must be"),
    ("weight 3-D", {"weight": torch.randn(10, 8, 1)}, ShapeError, "weight must be"),
    ("mismatched D", {"weight": torch.randn(10, 7)}, ShapeError, "D=7"),
    ("labels shape", {"labels": torch.tensor([1, 2, 3])}, ShapeError, "labels shape"),
    ("bias shape", {"bias": torch.randn(9)}, ShapeError, "bias must be"),
    ("empty vocab", {"weight": torch.randn(0, 8)}, ShapeError, "V=0"),
    ("labels int32", {"labels": Y.int()}, LeafTypeError, "int64"),
    ("labels float", {"labels": Y.float()}, LeafTypeError, "int64"),
    ("hidden not a tensor", {"hidden": [[1.0] * 8] * 4}, LeafTypeError, "torch.Tensor"),
    ("integer hidden", {"hidden": torch.ones(4, 8, dtype=torch.long)}, LeafTypeError, "floating"),
    ("mixed dtypes", {"weight": W.double()}, LeafTypeError, "dtype"),
    ("label out of range", {"labels": torch.tensor([1, 2, 10, -100])}, ConfigError, "outside"),
    ("negative label", {"labels": torch.tensor([1, 2, -5, -100])}, ConfigError, "outside"),
    ("reduction", {"reduction": "avg"}, ConfigError, "reduction"),
    ("smoothing", {"label_smoothing": 1.5}, ConfigError, "label_smoothing"),
    ("tile", {"vocab_tile": 0}, ConfigError, "vocab_tile"),
    ("ignore_index", {"ignore_index": -100.0}, ConfigError, "ignore_index"),
]


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_cross_entropy_torch, linear_cross_entropy_triton])
@pytest.mark.parametrize("what,override,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(fn, what, override, exc, match):
    kw = {"hidden": H, "weight": W, "labels": Y} | override
    with pytest.raises(exc, match=match):
        fn(**kw)

