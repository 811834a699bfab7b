"""ZeRO++ quantized communication (qwZ, qgZ) on CPU gloo ranks laid out as 2 nodes x 2.

    python benchmarks/quantized_comm.py              # 300 training steps per run (~3-4 min)
    python benchmarks/quantized_comm.py --steps 60   # shorter

1. **Bytes per step** of the example GPT ("tiny") under flat ZeRO-3, hpZ, hpZ + qwZ and
   hpZ + qwZ + qgZ: the runtime's counters split by link (`dsfn.runtime.links`, what
   `Step.explain` prints): bytes crossing a node's boundary per node and node-local bytes per
   rank, as multiples of P(n-1)/n (P: the parameter bytes, n: dp ranks).
2. **Training**: the example GPT on the example corpus (the standard library's source), world
   4 (2 nodes x 2), global batch 16, AdamW 2e-3; runs: exact (hpZ), qwZ, qwZ + qgZ, and a
   negative control (qwZ with every rank dequantizing with its own scales instead of the
   gathered ones). The final eval loss (16 fixed held-out batches) relative to the exact
   run's (target: within 1%; the control: outside it); the curves in one PNG (`--png`).
3. **Quantize + dequantize throughput** of the torch path on CPU (int8, int4) against a plain
   copy of the same fp32 tensor, in GB/s of fp32 input.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import corpus  # noqa: E402

import dsfn  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.runtime import counters, init_mesh  # noqa: E402
from dsfn.testing import run_on_ranks  # noqa: E402
from dsfn.transforms import compose, shard_zero  # noqa: E402

LAYOUTS = {"flat": {}, "hpz": {"hpz": "node"}, "hpz+qwZ": {"hpz": "node", "quantize_weights": "int8"},
           "hpz+qwZ+qgZ": {"hpz": "node", "quantize_weights": "int8", "quantize_grads": "int4"}}
BATCH, LR = 16, 2e-3


def _broken_scales() -> None:
    """The negative control: every rank dequantizes the gathered codes with its own scales."""
    from dsfn.runtime import quantized as Q
    orig = Q._Dequantizing.wait

    def wait(self):
        if self._works is not None and self._scales is not None:
            own = self._inputs[1]
            for w in self._works:
                w.wait()
            self._works = [None]
            self._scales = own.repeat(self._n)
        return orig(self)
    Q._Dequantizing.wait = wait


def _run(kw: dict, steps: int, broken: bool, data: tuple) -> dict:
    torch.set_num_threads(1)
    init_mesh(dp=4)
    if broken:
        _broken_scales()
    train, val = data
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = compose(shard_zero(3, **kw))(train_step)
    state = step.init_state(params, dsfn.optim.adamw(LR, weight_decay=0.1))
    it = corpus.batches(train, BATCH, cfg.seq_len, seed=0)
    losses, per_step = [], None
    for i in range(steps):
        counters.reset()
        state, m = step(state, next(it))
        losses.append(float(m["loss"]))
        if i == 1:
            per_step = {f"{a}/{o}": (c.intra, c.inter) for (a, o), c in counters.snapshot().items()}
    full = step.gather(state)
    with torch.no_grad():         # the exact gathered parameters, on the plain model
        vit = corpus.batches(val, BATCH, cfg.seq_len, seed=123)
        ev = statistics.mean(float(gpt_loss(apply_fn(full.params, b["input_ids"]), b["labels"]))
                             for b, _ in zip(vit, range(16)))
    p_bytes = sum(v.numel() * v.element_size() for v in dsfn.tree.leaves(full.params))
    return {"losses": losses, "eval": ev, "per_step": per_step, "p_bytes": p_bytes}


def throughput() -> None:
    from dsfn.ops.quantize import dequantize_blockwise_torch, quantize_blockwise_torch
    x = torch.randn(16 * 2**20)
    gb = x.numel() * 4 / 1e9

    def timed(fn, reps=5):
        fn()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return statistics.median(t)
    copy = timed(lambda: x.clone())
    print(f"\n3. quantize + dequantize, torch path on CPU, {x.numel():,} fp32 elements ({gb:.3f} GB)")
    print(f"  plain copy: {gb / copy:6.2f} GB/s")
    for fmt, block in (("int8", 2048), ("int4", 64)):
        q = timed(lambda: quantize_blockwise_torch(x, block, fmt))
        c, s = quantize_blockwise_torch(x, block, fmt)
        d = timed(lambda: dequantize_blockwise_torch(c, s, block, fmt, numel=x.numel()))
        print(f"  {fmt} (block {block}): quantize {gb / q:6.2f} GB/s ({copy / q:.2f} x copy), dequantize "
              f"{gb / d:6.2f} GB/s ({copy / d:.2f} x copy)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--png", default="/tmp/dsfn_quantized_comm.png")
    ap.add_argument("--json", default=None)
    ap.add_argument("--grads-block", type=int, default=None, help="qgZ's quantize_grads_block (default: shard_zero's)")
    a = ap.parse_args()
    if a.grads_block is not None:
        LAYOUTS["hpz+qwZ+qgZ"]["quantize_grads_block"] = a.grads_block
    data = corpus.train_val_split(corpus.load_corpus(2_000_000))
    print("1. bytes per step (step 2, rank 0; counters by link), as multiples of P(n-1)/n, n = 2 nodes, P the fp32 "
          "parameter bytes (the issue's 3.0 for flat ZeRO-3)")
    runs = {}
    for name, kw in LAYOUTS.items():
        runs[name] = run_on_ranks(_run, 4, kw, 2 if name == "flat" else a.steps, False, data,
                                  ranks_per_node=2, timeout=3000)[0]
    unit = runs["flat"]["p_bytes"] / 2          # P (n - 1) / n at n = 2 nodes
    for name, r in runs.items():
        inter = sum(v[1] for v in r["per_step"].values())
        intra = sum(v[0] for v in r["per_step"].values())
        parts = ", ".join(f"{k} {v[1]:,}" for k, v in sorted(r["per_step"].items()) if v[1])
        print(f"  {name:12s} across nodes {inter:>10,} B/node = {inter / unit:.3f} | node-local {intra:>10,} B/rank "
              f"= {intra / unit:.3f}   ({parts})")
    print(f"\n2. training, {a.steps} steps, world 4 (2 nodes x 2), final eval loss vs exact (hpZ)")
    runs["broken scales"] = run_on_ranks(_run, 4, LAYOUTS["hpz+qwZ"], a.steps, True, data, ranks_per_node=2,
                                         timeout=3000)[0]
    exact = runs["hpz"]["eval"]
    for name in ("hpz", "hpz+qwZ", "hpz+qwZ+qgZ", "broken scales"):
        ev = runs[name]["eval"]
        rel = (ev - exact) / exact
        verdict = "" if name == "hpz" else ("within 1%" if abs(rel) <= 0.01 else "OUTSIDE 1%")
        print(f"  {name:14s} eval {ev:.4f} ({rel * 100:+.2f}%) {verdict}   last train loss {runs[name]['losses'][-1]:.4f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name in ("hpz", "hpz+qwZ", "hpz+qwZ+qgZ", "broken scales"):
            ax.plot(runs[name]["losses"], label=name, lw=1)
        ax.set_xlabel("step"), ax.set_ylabel("train loss"), ax.legend()
        ax.set_title("example GPT, 2 nodes x 2 gloo ranks: exact vs ZeRO++ quantized")
        fig.savefig(a.png, dpi=100, bbox_inches="tight")
        print(f"  curves: {a.png}")
    except ImportError:
        print("  (matplotlib not installed: no PNG)")
    if a.json:
        Path(a.json).write_text(json.dumps({k: {"eval": v["eval"], "losses": v["losses"]} for k, v in runs.items()}))
    throughput()


if __name__ == "__main__":
    main()
