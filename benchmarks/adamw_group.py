"""The grouped AdamW update against one launch per tensor, on the 1B Llama's parameter tensors.

    python benchmarks/adamw_group.py            # CUDA: the 1B model's 147 tensors (fp32 master, bf16 grads)
    python benchmarks/adamw_group.py --quick    # CPU (Triton's interpreter): a scaled-down model, a smoke test

Three ways to update the same tensors, timed in the same run (median of --repeats, after
warm-up, the device synchronised around each):
  per-tensor   `adamw_update` on each tensor: the kernel and its scalar set-up per tensor (dsfn before)
  grouped      `adamw_update_multi`: one launch for the group, the step's scalars made once
  torch fused  `torch._fused_adamw_` over the lists (torch.optim.AdamW(fused=True)'s kernel)
and the grouped update's share of copy bandwidth (bytes it moves / a device copy's rate on the
same bytes). Targets (issue 23): grouped >= 1.3x per-tensor, >= 85% of copy bandwidth.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def llama_shapes(hidden: int, inter: int, layers: int, vocab: int, kv_ratio: int = 2) -> list[tuple[int, ...]]:
    """The parameter shapes of an HF Llama (untied): 2 + 9 per layer + 1 tensors."""
    kv = hidden // kv_ratio
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                 (hidden, inter), (hidden,), (hidden,)]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,), (vocab, hidden)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("DSFN_KERNELS", "triton")
    import torch

    from dsfn.ops import adamw as A
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    shapes = llama_shapes(64, 176, 2, 256) if a.quick else llama_shapes(2048, 5632, 16, 32000)
    repeats = 2 if a.quick else a.repeats
    g = torch.Generator().manual_seed(0)
    P = [torch.randn(s, generator=g).to(dev) for s in shapes]
    M = [torch.zeros_like(p) for p in P]
    V = [torch.zeros_like(p) for p in P]
    G = [torch.randn(s, generator=g).to(dev, torch.bfloat16) for s in shapes]
    n = sum(p.numel() for p in P)
    kw = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    outs = [(p, m, v) for p, m, v in zip(P, M, V)]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn(1)
        ts = []
        for k in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn(k + 2)
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    per_tensor = timed(lambda t: [A.adamw_update(p, gr, m, v, step=t, out=o, **kw)
                                  for p, gr, m, v, o in zip(P, G, M, V, outs)])
    grouped = timed(lambda t: A.adamw_update_multi(P, G, M, V, step=t, out=outs, **kw))
    rows = [("per-tensor", per_tensor), ("grouped", grouped)]
    if dev.type == "cuda":
        Gf = [x.float() for x in G]
        steps = [torch.zeros((), device=dev) for _ in P]

        def fused(t):
            torch._foreach_add_(steps, 1.0)
            torch._fused_adamw_(P, Gf, M, V, [], steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.1,
                                eps=1e-8, amsgrad=False, maximize=False)
        rows.append(("torch fused (fp32 grads)", timed(fused)))
    print(f"{len(shapes)} tensors, {n / 1e6:.1f}M elements on {dev}; median of {repeats}")
    for name, t in rows:
        print(f"  {name:26s} {1e3 * t:9.3f} ms   per-tensor / this: {per_tensor / t:6.2f}x")
    ratio = per_tensor / grouped
    rc = 0
    if dev.type == "cuda":
        moved = n * (4 * 3 * 2 + 2)          # p, m, v read and written (fp32), bf16 grad read
        src = torch.empty(moved // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        copy = timed(lambda t: dst.copy_(src))      # moved bytes through the memory system, as a copy does
        frac = copy / grouped
        print(f"  copy of the same bytes      {1e3 * copy:9.3f} ms   grouped at {frac:.1%} of copy bandwidth")
        ok_bw = frac >= 0.85
        print(f"  {'PASS' if ok_bw else 'FAIL'} grouped AdamW at {frac:.1%} of copy bandwidth (target >= 85%)")
        ok = ratio >= 1.3
        print(f"  {'PASS' if ok else 'FAIL'} grouped update {ratio:.2f}x the per-tensor launches (target >= 1.3x)")
        rc = 0 if ok and ok_bw else 1
    else:
        print(f"  (CPU interpreter: a smoke test of the same code; the targets are measured on CUDA) ratio {ratio:.2f}x")
    return rc


if __name__ == "__main__":
    sys.exit(main())
