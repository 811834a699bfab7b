"""Communication to 1,024 nodes: flat ZeRO-3 vs HSDP/MiCS vs ZeRO++ hpZ vs ZeRO++ whole (hpZ + qwZ +
qgZ, modelled) (`dsfn.comm_model`).

Projected part: per-step inter-node bytes per node and modelled communication seconds for
Llama-2 7B and Llama-3 70B (bf16) on 1..1,024 nodes of 8 GPUs (NVLink 450 GB/s per
direction per GPU, a 400 Gb/s NIC per GPU); ratios to flat; an SVG plot (--out).
Measured part: a 2 nodes x 2 ranks gloo run of the three layouts on a small MLP, the
inter-node bytes per node `Step.explain` counted beside the model's, and the state
bytes per rank. Run: `python benchmarks/scale.py [--out /tmp/dsfn_scale.svg]`.
"""
from __future__ import annotations

import argparse
import math

import torch

import dsfn
from dsfn import comm_model as M
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.transforms import shard_zero

NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
SIZES = [64, 256, 256, 64]           # the measured MLP (tensors padded to multiples of 2 and 4)
KW = {"flat": {}, "hsdp": {"shard_group": "node"}, "hpz": {"hpz": "node"}}
QUOTED = ["ZeRO++ (Wang et al. 2023): 4x less cross-node communication volume, up to 2.16x throughput at 384 GPUs",
          "MiCS (Zhang et al. 2022): up to 2.89x throughput, 99.4% weak-scaling efficiency at 512 GPUs"]


ALL = M.LAYOUTS + M.QUANTIZED_LAYOUTS


def table(model: M.ModelSpec) -> dict:
    plans = M.projections(model, NODES, ALL)
    print(f"\n{model.name} ({model.params / 1e9:.2f}e9 params, bf16), per step: inter-node GB per node | "
          "modelled comm seconds")
    print(f"{'nodes':>6} " + " ".join(f"{lay:>20}" for lay in ALL) + f" {'hsdp/flat':>10} {'hpz/flat':>9}"
          f" {'zero++/flat':>11}")
    for n in NODES:
        cells = " ".join(f"{plans[n, lay].inter_bytes / 1e9:9.1f} GB {plans[n, lay].seconds:6.2f} s"
                         for lay in ALL)
        f = plans[n, "flat"]
        r = ("         -" if f.inter_bytes == 0 else f"{plans[n, 'hsdp'].inter_bytes / f.inter_bytes:10.3f}")
        r2 = ("        -" if f.inter_bytes == 0 else f"{plans[n, 'hpz'].inter_bytes / f.inter_bytes:9.3f}")
        r3 = ("          -" if f.inter_bytes == 0 else f"{plans[n, 'zeropp'].inter_bytes / f.inter_bytes:11.3f}")
        print(f"{n:6d} {cells} {r} {r2} {r3}")
    return plans


def svg(series: dict[str, list[tuple[int, float]]], path: str, title: str) -> None:
    """A log-x line plot, written by hand (no plotting library)."""
    W, H, pad = 640, 400, 60
    ymax = max(y for pts in series.values() for _, y in pts) * 1.1
    xs = lambda n: pad + (W - 2 * pad) * math.log2(n) / math.log2(NODES[-1])   # noqa: E731
    ys = lambda y: H - pad - (H - 2 * pad) * y / ymax                           # noqa: E731
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="black"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">nodes of 8 GPUs (log scale)</text>',
           f'<text x="15" y="{H / 2}" transform="rotate(-90 15 {H / 2})" text-anchor="middle">'
           'comm seconds per step</text>']
    for n in NODES:
        out.append(f'<text x="{xs(n):.1f}" y="{H - pad + 15}" text-anchor="middle">{n}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{pad - 5}" y="{ys(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
    for i, (name, pts) in enumerate(series.items()):
        c = colors[i % len(colors)]
        d = " ".join(f"{xs(n):.1f},{ys(y):.1f}" for n, y in pts)
        out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
        out.append(f'<text x="{W - pad - 110}" y="{pad + 16 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def _measured(layout: str):
    init_mesh()
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, 0))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(
            lambda p, b: torch.nn.functional.mse_loss(apply_fn(p, b["x"]), b["y"]))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(shard_zero(3, **KW[layout]))(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.adamw(lr=0.1)))
    ex = step.explain(state, regression_batches(1, 4, SIZES[0], SIZES[-1])[0])
    return ex.inter_bytes, ex.links, ex.state_bytes


def measured() -> None:
    spec = M.ModelSpec("mlp", tuple(((SIZES[i] * SIZES[i + 1], True), (SIZES[i + 1], False))
                                    for i in range(len(SIZES) - 1)))
    P = spec.params * 4
    n = 2
    print(f"\nmeasured: 2 nodes x 2 ranks (gloo), MLP {SIZES}, P = {spec.params} params x 4 B = {P} B; "
          "inter-node bytes per node per step (Step.explain) | the model's")
    got = {}
    for lay in M.LAYOUTS:
        inter, links, state_bytes = run_on_ranks(_measured, 4, lay, ranks_per_node=2, timeout=120)[0]
        plan = M.step_comm(spec, lay, M.Cluster(2, gpus_per_node=2), elem_bytes=4, reduce_bucket=4e6)
        got[lay] = (inter, state_bytes)
        gathers = [v for (a, o), v in links.items() if o == "all_gather"]
        local = sum(g[0] for g in gathers if g[1] == 0) / max(1e-9, sum(g[0] for g in gathers))
        print(f"  {lay:5s} {inter:10,.0f} B | {plan.inter_bytes:10,.0f} B   ({inter / (P * (n - 1) / n):.2f} "
              f"P(n-1)/n; all-gathers node-local: {100 * local:.0f}% of their intra bytes; "
              f"state {state_bytes:,} B/rank)")
    flat = got["flat"][0]
    print(f"  HSDP/flat inter-node bytes: {got['hsdp'][0] / flat:.3f}   hpZ/flat: {got['hpz'][0] / flat:.3f}   "
          "(targets: flat ~3, HSDP and hpZ <= 2 P(n-1)/n, ratio <= 0.667)")
    print(f"  state per rank HSDP (groups of 2) / flat ZeRO-3 (4): {got['hsdp'][1] / got['flat'][1]:.3f} "
          f"(2 ranks share what 4 did); HSDP / replicated (params + Adam mu, nu = 3P bytes): "
          f"{got['hsdp'][1] / (3 * P):.4f} (1/k = 0.5, padding and the step count aside)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/dsfn_scale.svg")
    args = ap.parse_args()
    print(f"links: {M.NVLINK_H100.name}, latency {M.NVLINK_H100.latency * 1e6:.0f} us; "
          f"{M.NIC_400G.name}, latency {M.NIC_400G.latency * 1e6:.0f} us")
    table(M.LLAMA_7B)
    plans = table(M.LLAMA_70B)
    tp = {n: M.step_comm(M.LLAMA_70B, "hsdp", M.Cluster(n), tp=8) for n in NODES}
    f, h, z, q = (plans[128, lay] for lay in ALL)
    print(f"\n70B on 128 nodes x 8: comm seconds per step flat {f.seconds:.2f}, HSDP {h.seconds:.2f} "
          f"({h.seconds / f.seconds:.2f}x), hpZ {z.seconds:.2f} ({z.seconds / f.seconds:.2f}x), ZeRO++ (hpZ + qwZ "
          f"+ qgZ) {q.seconds:.2f} ({q.seconds / f.seconds:.2f}x); "
          f"HSDP with tp=8 in the node {tp[128].seconds:.2f} (inter {tp[128].inter_bytes / 1e9:.1f} GB/node)")
    print("published, for context (not reproduced here):")
    for q in QUOTED:
        print(f"  {q}")
    series = {lay: [(n, plans[n, lay].seconds) for n in NODES] for lay in ALL}
    series["hsdp + tp8"] = [(n, tp[n].seconds) for n in NODES]
    svg(series, args.out, "Llama-3 70B, bf16: modelled comm seconds per step")
    print(f"plot: {args.out}")
    measured()


if __name__ == "__main__":
    main()
