"""Tensor parallelism (Megatron-style, `tensor_parallel("auto")`) on a small HF Llama.

    python benchmarks/tensor_parallel.py              # Llama 4 layers, d256, batch 8 x 128 (~1 min on 2 cores)
    python benchmarks/tensor_parallel.py --quick      # 2 layers, d128, seq 64, 3 steps (smoke test, < 30 s)
    python benchmarks/tensor_parallel.py --layers 8 --hidden 512 --steps 20 --json out.json

The model is `transformers.LlamaForCausalLM` from a `LlamaConfig` (random init, the same
seed on every rank; vocab 256, hidden 256, intermediate 688, 4 layers, 8 query / 4 kv
heads by default), trained with fp32 AdamW (lr 1e-3) on random token batches of the same
global size (8 x 128) in every layout. Every rank of a tp group gets the same batch
(batches come from one fixed seed on every rank); `shard_zero` splits the global batch
over dp. Layouts (each in fresh processes, `dsfn.launch.spawn`, fork, gloo, one
intra-op thread per rank):

| key           | ranks | stack                                              |
|---------------|-------|----------------------------------------------------|
| `tp1`         | 1     | `compose()` (no transforms): the baseline          |
| `tp2`         | 2     | `compose(tensor_parallel("auto", model=m))`        |
| `dp2xtp2-z1`  | 4     | `compose(shard_zero(1), tensor_parallel(...))`     |
| `dp2xtp2-z3`  | 4     | `compose(shard_zero(3), tensor_parallel(...))`     |
| `dp2-z3`      | 2     | `compose(shard_zero(3))` (for comparison)          |

Per layout:
- per-rank parameter bytes and total state bytes (params + optimizer state + step/rng
  scalars) of the placed state, from `step.explain(state, batch).leaves` (max over ranks);
- step time: median over --steps timed steps after --warmup untimed ones, barrier before
  each, a step's time is the slowest rank's; ratio against tp1 from the same run; and the
  CPU time of a step summed over its ranks (median; the work a layout spends per global
  batch, less sensitive than wall time to oversubscription and other load);
- communication per step, from `step.explain` (runtime counters, payload bytes: an
  all-reduce counts its tensor once, an all-gather its gathered output), split into
  forward / backward by a counter snapshot taken where the forward ends (in the loss);
- the final loss and the largest loss difference from tp1 over all steps (all layouts
  compute the same function on the same global batches).

tp-axis theory (activation A = b*T*H*4 bytes, b = rows per dp rank): Megatron does 2
all-reduces of A per block in forward (after o_proj and down_proj) and 2 in backward
(the gradients of the colwise inputs): 4*L*A per step. HF Llama has separate q/k/v and
gate/up Linears; they share one input copy, so each block's backward still all-reduces
2 input gradients (the script prints the per-block counts it measured). Outside the
blocks: the vocab-parallel embedding all-reduces A in forward,
the LM head (colwise, output gathered) all-gathers the logits b*T*V*4 in forward and
all-reduces its input gradient A in backward. dp-axis theory (ZeRO, Ψ = this tp rank's
parameter bytes, padded to a multiple of dp per tensor): stage 1 reduce-scatters Ψ and
all-gathers Ψ; stage 3 all-gathers 2Ψ (forward + backward) and reduce-scatters Ψ.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

import dsfn
import dsfn.launch
from dsfn.runtime import collectives as C
from _steps import add_llama_args, explained_step, finish_llama_args, llama_config, timed_steps
from dsfn.runtime import init_mesh
from dsfn.state.layout import FlatShard, Nested
from dsfn.transforms import compose, shard_zero, tensor_parallel

LAYOUTS = {          # key: (dp, tp, ZeRO stage or None)
    "tp1": (1, 1, None),
    "tp2": (1, 2, None),
    "dp2xtp2-z1": (2, 2, 1),
    "dp2xtp2-z3": (2, 2, 3),
    "dp2-z3": (2, 1, 3),
}
MiB = 2 ** 20


def _batches(a: dict, n: int) -> list[dict]:
    """The same global batches on every rank (tp groups must see identical batches)."""
    g = torch.Generator().manual_seed(a["seed"] + 1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _tp_local_shape(layout, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a parameter on this tp rank, before any dp (ZeRO) flattening."""
    if isinstance(layout, Nested):
        return tuple(layout.outer.shape)
    if isinstance(layout, FlatShard):
        return tuple(layout.shape)
    return local_shape


def _rank_main(key: str, a: dict) -> dict:
    import transformers
    dp, tp, stage = LAYOUTS[key]
    init_mesh(dp=dp, tp=tp)
    torch.manual_seed(a["seed"])
    model = transformers.LlamaForCausalLM(llama_config(a, a["seq"]))
    apply_fn, params = dsfn.functionalize(model)
    mark: dict = {}

    def loss_fn(p, b):
        logits = apply_fn(p, b["input_ids"]).logits
        if mark.get("on"):
            mark["fwd"] = C.counters.snapshot()        # the forward's collectives end here
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1))

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tp_t = tensor_parallel("auto", model=model) if tp > 1 else None
    ts = ([shard_zero(stage)] if stage is not None else []) + ([tp_t] if tp_t is not None else [])
    step = compose(*ts)(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-3), seed=a["seed"])
    del params

    batches = _batches(a, a["warmup"] + a["steps"])
    state, times, cpu, losses = timed_steps(step, state, batches, a["warmup"])
    ex, comm = explained_step(step, state, batches[0], mark)

    param_bytes = opt_bytes = other_bytes = psi_dp = 0
    for path, layout, shape, dtype, nbytes in ex.leaves:
        if path.startswith("params."):
            param_bytes += nbytes
            n = math.prod(_tp_local_shape(layout, shape))
            psi_dp += -(-n // dp) * dp * (nbytes // max(1, math.prod(shape)))
        elif path.startswith("opt_state."):
            opt_bytes += nbytes
        else:
            other_bytes += nbytes
    info = {"key": key, "dp": dp, "tp": tp, "stage": stage, "times": times, "cpu": cpu, "losses": losses,
            "param_bytes": param_bytes, "opt_bytes": opt_bytes, "state_bytes": ex.state_bytes,
            "psi_dp": psi_dp, "comm": comm}
    info["stack"] = ex.stack
    return info


def _mib(b: float) -> str:
    return f"{b / MiB:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llama_args(ap)
    ap.add_argument("--batch", type=int, default=8, help="global batch rows (split over dp)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    ap.add_argument("--quick", action="store_true", help="2 layers, d128, seq 64, 1 warm-up + 3 steps")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t_start = time.perf_counter()
    if a.quick:
        a.layers, a.hidden, a.seq, a.warmup, a.steps = 2, 128, 64, 1, 3
    finish_llama_args(a)
    keys = [k.strip() for k in a.configs.split(",") if k.strip()]
    bad = [k for k in keys if k not in LAYOUTS]
    if bad:
        ap.error(f"unknown configs {bad}; choose from {list(LAYOUTS)}")
    args = {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch",
                                        "seq", "warmup", "steps", "seed")}
    L, B, T, H, V = a.layers, a.batch, a.seq, a.hidden, a.vocab
    import transformers
    n_params = sum(p.numel() for p in transformers.LlamaForCausalLM(llama_config(args, args["seq"])).parameters())
    print(f"LlamaForCausalLM: {n_params / 1e6:.2f}M params, {L} layers, hidden {H}, intermediate {a.intermediate}, "
          f"{a.heads} heads / {a.kv_heads} kv heads, vocab {V}; global batch {B} x {T}, fp32 AdamW; "
          f"{a.warmup} warm-up + {a.steps} timed steps; gloo, 1 thread per rank, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    res: dict = {}
    for key in keys:
        dp, tp, _ = LAYOUTS[key]
        per_rank = dsfn.launch.spawn(_rank_main, dp * tp, args=(key, args), timeout=1800)
        r0 = per_rank[0]
        slowest = [max(r["times"][i] for r in per_rank) for i in range(len(r0["times"]))]
        res[key] = {**r0, "ranks": dp * tp, "step_median_s": statistics.median(slowest), "step_min_s": min(slowest),
                    "step_s": slowest,
                    "cpu_median_s": statistics.median(sum(r["cpu"][i] for r in per_rank) for i in range(len(slowest))),
                    **{k: max(r[k] for r in per_rank) for k in ("param_bytes", "opt_bytes", "state_bytes")}}
        print(f"  {key:11s} {dp * tp} ranks  step {res[key]['step_median_s']:.3f}s  state "
              f"{res[key]['state_bytes'] / MiB:7.2f} MiB/rank  loss {r0['losses'][-1]:.4f}", flush=True)

    base = res.get("tp1")
    print("\nlayout       ranks  params MiB/rank  state MiB/rank  vs tp1  step s (median)  min s  vs tp1  "
          "CPU s (all ranks)  vs tp1  final loss  max |dloss| vs tp1")
    for key, r in res.items():
        vs_mem = r["state_bytes"] / base["state_bytes"] if base else float("nan")
        vs_t = r["step_median_s"] / base["step_median_s"] if base else float("nan")
        vs_c = r["cpu_median_s"] / base["cpu_median_s"] if base else float("nan")
        dl = max(abs(x - y) for x, y in zip(r["losses"], base["losses"])) if base else float("nan")
        print(f"{key:12s} {r['ranks']:5d} {r['param_bytes'] / MiB:16.3f} {r['state_bytes'] / MiB:15.3f} {vs_mem:7.3f} "
              f"{r['step_median_s']:16.3f} {r['step_min_s']:6.3f} {vs_t:7.2f} "
              f"{r['cpu_median_s']:18.3f} {vs_c:7.2f} {r['losses'][-1]:11.4f} {dl:18.2e}")

    print("\ntp-axis communication per step (payload bytes from the runtime counters, MiB; fwd/bwd split measured)")
    for key, r in res.items():
        if r["tp"] == 1:
            continue
        b = B // r["dp"]
        act = b * T * H * 4
        logits = b * T * (-(-V // r["tp"]) * r["tp"]) * 4
        ar = r["comm"].get("tp/all_reduce", {"calls": 0, "bytes": 0, "fwd_calls": 0, "fwd_bytes": 0})
        ag = r["comm"].get("tp/all_gather", {"calls": 0, "bytes": 0, "fwd_calls": 0, "fwd_bytes": 0})
        megatron = 4 * L * act
        outside = 2 * act                  # embedding all-reduce (fwd) + LM head input gradient (bwd)
        block = ar["bytes"] - outside
        fwd_c, bwd_c = ar["fwd_calls"], ar["calls"] - ar["fwd_calls"]
        per_f, per_b = (fwd_c - 1) / L, (bwd_c - 1) / L     # minus the embedding's (fwd) and LM head's (bwd)
        print(f"  {key} (b = {b} rows per dp rank, activation A = b*T*H*4 = {_mib(act)} MiB):")
        print(f"    all_reduce : {ar['calls']:3d} calls {_mib(ar['bytes']):>8s} MiB  (fwd {fwd_c} calls "
              f"{_mib(ar['fwd_bytes'])}, bwd {bwd_c} calls {_mib(ar['bytes'] - ar['fwd_bytes'])});  theory "
              f"(4L + 2) x A = {_mib(megatron + outside)}: ratio {ar['bytes'] / (megatron + outside):.3f}")
        print(f"    all_gather : {ag['calls']:3d} calls {_mib(ag['bytes']):>8s} MiB  (fwd {ag['fwd_calls']} calls "
              f"{_mib(ag['fwd_bytes'])});  theory: LM-head logits b*T*V*4 = {_mib(logits)}: ratio "
              f"{ag['bytes'] / logits:.3f}")
        print(f"    block all-reduces (all_reduce - 2A outside the blocks): {_mib(block)} MiB vs Megatron 4*L*A = "
              f"{_mib(megatron)} MiB: ratio {block / megatron:.3f}; per block {per_f:g} fwd + {per_b:g} bwd "
              "(Megatron 2 + 2)")
        res[key]["per_block"] = (per_f, per_b)
        res[key]["tp_theory"] = {"act": act, "megatron_block_bytes": megatron, "block_bytes": block,
                                 "logits_bytes": logits}

    zero = {k: r for k, r in res.items() if r["stage"] is not None}
    if zero:
        print("\ndp-axis communication per step (MiB; Ψ = this tp rank's parameter bytes, padded to dp per tensor)")
        for key, r in zero.items():
            psi = r["psi_dp"]
            want = ({"reduce_scatter": psi, "all_gather": psi} if r["stage"] in (1, 2)
                    else {"reduce_scatter": psi, "all_gather": 2 * psi})
            parts = []
            for op in ("reduce_scatter", "all_gather", "all_reduce"):
                c = r["comm"].get(f"dp/{op}")
                if c is None and op not in want:
                    continue
                got = c["bytes"] if c else 0
                th = f" (theory {want[op] / psi:.0f}Ψ, ratio {got / want[op]:.4f})" if op in want else " (metrics)"
                parts.append(f"{op} {_mib(got)}{th}")
            print(f"  {key}: Ψ = {_mib(psi)} MiB; " + "; ".join(parts))

    print("\nnotes:")
    print("  - payload bytes: an all-reduce counts its tensor once (a ring moves 2(n-1)/n of it per rank), an "
          "all-gather its gathered output.")
    print("  - tp terms outside Megatron's 4 all-reduces per block: the vocab-parallel embedding all-reduces A in "
          "forward; the LM head (colwise, output gathered) all-gathers the logits b*T*V*4 in forward and all-reduces "
          "its input gradient A in backward (its output's backward takes this rank's slice: no communication). "
          "Replicated parameters (the RMSNorm weights) need no tp gradient reduction.")
    if any(r.get("per_block", (2, 2))[1] > 2 for r in res.values()):
        print("  - more than 2 backward all-reduces per block: q/k/v (and gate/up) each all-reduce their own input "
              "gradient instead of one shared input copy (Megatron's fused qkv / gate_up do 2).")
    else:
        print("  - q/k/v (and gate/up) read one shared input copy, so their input gradients are summed locally and "
              "all-reduced once: 2 backward all-reduces per block, as Megatron's fused qkv / gate_up.")
    print("  - 2x2 layouts split the global batch over dp, so their tp traffic is per b = B/2 rows.")
    print("  - step times: every rank runs 1 intra-op thread; tp1 uses 1 core, 2-rank layouts both cores, and "
          "4-rank layouts oversubscribe a 2-core machine: their step times are not a speed claim (nor are any when the load printed above exceeds the CPU count). CPU s "
          "sums the ranks' process CPU time per step. At this size (and with gloo over loopback) communication and "
          "per-op overhead weigh more than on a real model.")
    print(f"total time {time.perf_counter() - t_start:.0f} s")
    if a.json:
        a.json.write_text(json.dumps({"args": args, "results": res}, indent=2, default=str))


if __name__ == "__main__":
    main()
