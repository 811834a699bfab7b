"""ZeRO stages 0-3 against DDP and PyTorch FSDP2 on the same GPT, data and AdamW.

    python benchmarks/zero.py                  # ~50M-parameter GPT, 2 gloo ranks (several minutes)
    python benchmarks/zero.py --quick          # tiny GPT, few steps (< 1 min)
    python benchmarks/zero.py --json out.json

Per configuration, in fresh processes (2 ranks, fork, one intra-op thread each):
- model-state bytes per rank: the local storages of parameters + gradients + optimizer
  state after a step (for dsfn the gradients are counted inside train_step, where they
  exist; between steps a dsfn state holds no gradients at all);
- peak RSS per rank (ru_maxrss, max over ranks);
- step time (median over the timed steps, the slowest rank's clock, barrier before each);
- for dsfn, the bytes each collective moved per step (runtime counters) against the
  theory: stages 1-2 reduce-scatter Ψ + all-gather Ψ, stage 3 + one more all-gather Ψ
  (in backward), with Ψ the padded parameter bytes; stage 0 all-reduces Ψ.
Targets (issue 3): model-state bytes of stage 3 <= FSDP2's; stage-3 step time <= 1.1x
FSDP2 and <= 1.3x DDP on this machine.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import corpus  # noqa: E402
import dsfn  # noqa: E402
import dsfn.launch  # noqa: E402
from dsfn import tree  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.runtime import counters  # noqa: E402
from dsfn.transforms import shard_zero  # noqa: E402
from _steps import global_mean, peer  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CONFIGS = ["ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3"]


def _batches(cfg: GPTConfig, global_batch: int, n: int, seed: int) -> list[dict]:
    data = corpus.load_corpus(max_bytes=2_000_000)
    it = corpus.batches(data, global_batch, cfg.seq_len, seed=seed)
    out = []
    for _ in range(n):
        b = next(it)
        out.append({k: v % cfg.vocab_size for k, v in b.items()})
    return out


def _local_bytes(ts) -> int:
    total = 0
    for t in ts:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        total += t.numel() * t.element_size()
    return total


def _rank_main(name: str, preset: str, micro: int, warmup: int, steps: int, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.preset(preset)
    batches = _batches(cfg, micro * world, warmup + steps, seed)
    torch.manual_seed(seed)
    model = GPT(cfg)
    times: list[float] = []
    info: dict = {"name": name}

    if name in ("ddp", "fsdp2"):
        net, opt = peer(name, model, HP)
        for i, b in enumerate(batches):
            rows = slice(rank * micro, (rank + 1) * micro)
            dist.barrier()
            t0 = time.perf_counter()
            loss = gpt_loss(net(b["input_ids"][rows]), b["labels"][rows])
            loss.backward()
            grad_bytes = _local_bytes(p.grad for p in net.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        state_bytes = _local_bytes(net.parameters()) + grad_bytes + _local_bytes(
            t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        info["loss"] = global_mean(loss)
    else:
        stage = int(name[-1])
        apply_fn, params = dsfn.functionalize(model, release=True)
        info["psi_padded_bytes"] = sum(-(-t.numel() // world) * world * 4 for t in params.values())
        seen = {}

        def train_step(state, batch):
            loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
                state.params, batch)
            seen["grad_bytes"] = sum(t.numel() * t.element_size() for t in tree.leaves(grads))
            return state.apply_gradients(grads), {"loss": loss}

        step = dsfn.compose(shard_zero(stage))(train_step)
        state = step.init_state(params, dsfn.optim.adamw(**HP), seed=seed)   # optimizer state born sharded
        del params
        for i, b in enumerate(batches):
            if i == warmup:
                counters.reset()
            dist.barrier()
            t0 = time.perf_counter()
            state, m = step(state, b)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        state_bytes = (sum(t.numel() * t.element_size() for t in tree.leaves(state.params))
                       + sum(t.numel() * t.element_size() for t in tree.leaves(state.opt_state) if t.dim() > 0)
                       + seen["grad_bytes"])
        info["loss"] = float(m["loss"])
        info["comm"] = {op: counters.bytes("dp", op) // steps
                        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}
    info["state_bytes"] = state_bytes
    info["step_s"] = times
    info["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="50m")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="tiny GPT, 1 warm-up + 3 steps")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.model, a.warmup, a.steps = "tiny", 1, 3
    world = 2
    cfg = GPTConfig.preset(a.model)
    print(f"GPT {a.model}: {cfg.num_params() / 1e6:.1f}M params, seq {cfg.seq_len}, micro-batch {a.micro_batch} "
          f"x {world} ranks (gloo, 1 thread each), AdamW fp32, {a.warmup} warm-up + {a.steps} timed steps")
    results = {}
    for name in a.configs.split(","):
        per_rank = dsfn.launch.spawn(_rank_main, world, args=(name, a.model, a.micro_batch, a.warmup, a.steps, a.seed),
                                     timeout=1800)
        r0 = per_rank[0]
        slowest = [max(r["step_s"][i] for r in per_rank) for i in range(len(r0["step_s"]))]
        results[name] = {**r0, "step_median_s": statistics.median(slowest), "step_min_s": min(slowest),
                         "maxrss_mb": max(r["maxrss_mb"] for r in per_rank),
                         "state_bytes": max(r["state_bytes"] for r in per_rank)}
        print(f"  {name:6s} step {results[name]['step_median_s']:.3f}s  state {results[name]['state_bytes'] / 2**20:8.1f} MiB"
              f"  peak RSS {results[name]['maxrss_mb']:8.1f} MiB  loss {r0['loss']:.4f}", flush=True)

    print("\nconfig   step(s)  vs DDP  vs FSDP2  model-state MiB  vs FSDP2  peak RSS MiB")
    base_ddp = results.get("ddp", {}).get("step_median_s")
    base_fsdp = results.get("fsdp2", {})
    for name, r in results.items():
        vs_ddp = r["step_median_s"] / base_ddp if base_ddp else float("nan")
        vs_f = r["step_median_s"] / base_fsdp["step_median_s"] if base_fsdp else float("nan")
        mem_f = r["state_bytes"] / base_fsdp["state_bytes"] if base_fsdp else float("nan")
        print(f"{name:7s} {r['step_median_s']:8.3f} {vs_ddp:7.2f} {vs_f:9.2f} {r['state_bytes'] / 2**20:16.1f} "
              f"{mem_f:9.2f} {r['maxrss_mb']:13.1f}")

    print("\ncommunication per step (bytes counted by the runtime; Ψ = padded fp32 parameter bytes)")
    for name, r in results.items():
        if "comm" not in r:
            continue
        psi = r["psi_padded_bytes"]
        c = r["comm"]
        expect = {"zero0": {"all_reduce": psi}, "zero1": {"reduce_scatter": psi, "all_gather": psi},
                  "zero2": {"reduce_scatter": psi, "all_gather": psi},
                  "zero3": {"reduce_scatter": psi, "all_gather": 2 * psi}}[name]
        moved = sum(v * (2 if op == "all_reduce" else 1) for op, v in c.items() if op != "broadcast") * (world - 1) / world
        theory = (2 if name != "zero3" else 3) * psi * (world - 1) / world
        parts = ", ".join(f"{op} {c[op] / psi:.3f}Ψ (theory {expect.get(op, 0) / psi:.0f}Ψ)" for op in
                          ("all_reduce", "reduce_scatter", "all_gather") if c[op] or op in expect)
        print(f"  {name}: {parts}; moved per rank {moved / psi:.3f}Ψ vs theory {theory / psi:.3f}Ψ "
              f"(the extra all-reduce bytes are the step's metrics)")

    if "zero3" in results and "fsdp2" in results and "ddp" in results:
        z3, f2, ddp = results["zero3"], results["fsdp2"], results["ddp"]
        checks = [("stage-3 model-state bytes <= FSDP2", z3["state_bytes"] <= f2["state_bytes"]),
                  ("stage-3 step <= 1.1x FSDP2", z3["step_median_s"] <= 1.1 * f2["step_median_s"]),
                  ("stage-3 step <= 1.3x DDP", z3["step_median_s"] <= 1.3 * ddp["step_median_s"])]
        print()
        for what, ok in checks:
            print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
