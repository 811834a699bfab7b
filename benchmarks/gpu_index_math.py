"""Index math past 2**31 elements on the GPU: fused AdamW, RMSNorm and tiled cross-entropy.

    python benchmarks/gpu_index_math.py              # CUDA: ~45 GB of GPU memory, under a minute
    python benchmarks/gpu_index_math.py --small      # any device: the same checks at small sizes

An int32 offset (`pid * BLOCK`, `row * stride`) wraps past 2**31 elements and addresses
memory 2**32 elements away. Each check runs the op once on tensors larger than 2**31
elements and compares *slices* with the torch reference computed on those slices alone
(every op here is row- or element-wise in what is compared): the start, the slice that
straddles 2**31, and the end.

- AdamW: p, g, m, v of n = 2**31 + 2**22 fp32 elements, updated in place (out=);
- RMSNorm: x [rows, 4096] bf16 with rows * 4096 > 2**31, forward and grad of x;
- cross-entropy: an LM head weight [V, 8192] bf16 with V * 8192 > 2**31 (labels in its
  last rows), per-token losses and the head's gradient rows past 2**31 elements.

Prints one PASS/FAIL line per check; exit status 0 when all pass. `tests/ops/test_index_math.py`
checks the same offsets on CPU through Triton's interpreter; this is the compiled kernels' turn.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dsfn.ops.adamw import adamw_update, adamw_update_torch  # noqa: E402
from dsfn.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from dsfn.ops.rmsnorm import rms_norm, rms_norm_torch  # noqa: E402

TWO31 = 2**31


def _windows(n: int, w: int) -> list[tuple[int, int]]:
    """[start, end) of the first, the 2**31-straddling (or middle) and the last w elements."""
    mid = min(TWO31, n // 2)
    return [(0, w), (max(0, mid - w // 2), min(n, mid + w // 2)), (n - w, n)]


def _report(name: str, ok: bool, detail: str) -> bool:
    print(f"  {name:14s} {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
    return ok


def check_adamw(n: int, device: str) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(n, generator=g, device=device)
    grad = torch.randn(n, generator=g, device=device)
    m = torch.randn(n, generator=g, device=device) * 0.1
    v = torch.rand(n, generator=g, device=device) * 0.01
    wins = _windows(n, 1 << 20)
    before = [(p[a:b].clone(), grad[a:b].clone(), m[a:b].clone(), v[a:b].clone()) for a, b in wins]
    kw = dict(lr=1e-3, step=3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    adamw_update(p, grad, m, v, out=(p, m, v), **kw)        # in place: 4 buffers of n, not 7
    worst = 0.0
    for (a, b), (p0, g0, m0, v0) in zip(wins, before):
        ref = adamw_update_torch(p0, g0, m0, v0, **kw)
        for got, want in ((p[a:b], ref.param), (m[a:b], ref.exp_avg), (v[a:b], ref.exp_avg_sq)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            worst = max(worst, float((got - want).abs().max()))
    return _report("adamw", True, f"n = {n:,} fp32 ({n / TWO31:.3f} x 2**31), windows {wins}, max |diff| {worst:.1e}")


def check_rmsnorm(rows: int, d: int, device: str) -> bool:
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, d, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
    y = rms_norm(x, w)
    y.backward(torch.ones_like(y))
    worst = 0.0
    k = max(1, min(rows // 4, (1 << 20) // d))         # rows per window
    mid = min(TWO31 // d, rows // 2)                      # the row holding element 2**31
    for a, b in [(0, k), (mid - k, mid + k), (rows - k, rows)]:
        xs = x.detach()[a:b].clone().requires_grad_()
        ys = rms_norm_torch(xs, w)
        ys.backward(torch.ones_like(ys))
        torch.testing.assert_close(y.detach()[a:b], ys.detach(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(x.grad[a:b], xs.grad, rtol=2e-2, atol=2e-2)
        worst = max(worst, float((y.detach()[a:b].float() - ys.detach().float()).abs().max()))
    return _report("rmsnorm", True, f"x [{rows:,}, {d}] bf16 = {rows * d:,} elements, max |diff| {worst:.1e}")


def check_cross_entropy(n: int, v: int, d: int, device: str) -> bool:
    g = torch.Generator(device=device).manual_seed(2)
    h = (torch.randn(n, d, generator=g, device=device) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, generator=g, device=device) * d ** -0.5).to(torch.bfloat16).requires_grad_()
    # half the labels in the head's last rows: their weight rows start past 2**31 elements
    y = torch.randint(0, v, (n,), generator=g, device=device)
    y[::2] = v - 1 - torch.arange(0, n, 2, device=device) % 64
    loss = linear_cross_entropy(h, w, y, reduction="none")
    loss.sum().backward()
    logits = h.detach().float() @ w.detach().float().T                      # [n, v] fp32: n is small
    ref_loss = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    torch.testing.assert_close(loss.detach().float(), ref_loss, rtol=2e-2, atol=2e-2)
    # the head's gradient on its last rows (past 2**31 elements), against the same slice's reference
    tail = slice(v - 64, v)
    probs = torch.softmax(logits, dim=-1)
    probs[torch.arange(n, device=device), y] -= 1
    ref_gw = probs[:, tail].T @ h.detach().float()
    torch.testing.assert_close(w.grad[tail].float(), ref_gw, rtol=5e-2, atol=5e-2)
    err = float((loss.detach().float() - ref_loss).abs().max())
    return _report("cross_entropy", True, f"head [{v:,}, {d}] bf16 = {v * d:,} elements, N={n}, "
                                         f"max |loss diff| {err:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="small sizes, any device (a dry run of the checks)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    a = ap.parse_args()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not a.small and device != "cuda":
        print("gpu_index_math: the full sizes need a CUDA device (about 45 GB); use --small elsewhere")
        return 2
    print(f"== index math past 2**31 elements on {device}{' (small sizes)' if a.small else ''}", flush=True)
    ok, t0 = True, time.perf_counter()
    checks = [
        ("adamw", lambda: check_adamw(3 << 20 if a.small else TWO31 + (1 << 22), device)),
        ("rmsnorm", lambda: check_rmsnorm(1024 if a.small else TWO31 // 4096 + 1024, 64 if a.small else 4096,
                                          device)),
        ("cross_entropy", lambda: check_cross_entropy(8 if a.small else 256, 512 if a.small else (1 << 18) + 64,
                                                      32 if a.small else 8192, device)),
    ]
    for name, check in checks:
        try:
            ok = check() and ok
        except (AssertionError, RuntimeError) as e:        # a wrapped offset, or out of memory
            ok = _report(name, False, f"{type(e).__name__}: {e}"[:400]) and ok
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"== index math: {'all PASS' if ok else 'FAIL'} in {time.perf_counter() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
