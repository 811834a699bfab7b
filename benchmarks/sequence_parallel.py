"""Sequence parallelism (DeepSpeed Ulysses, `sequence_parallel()`) on a small HF Llama.

    python benchmarks/sequence_parallel.py            # Llama 4 layers, d256, cap 128 MiB/rank: memory, gqa, time
    python benchmarks/sequence_parallel.py --parts alst --sp 1,2    # tile_mlps + remat (long sequences: slow)
    python benchmarks/sequence_parallel.py --quick    # 2 layers, cap 64 MiB, step times at seq 1024 (~1 min)
    python benchmarks/sequence_parallel.py --cap-mib 256 --tiles 16 --parts memory --json out.json

The model is `transformers.LlamaForCausalLM` from a `LlamaConfig` (random init, the same
seed on every rank; vocab 256, hidden 256, intermediate 688, 4 layers, 8 query / 4 kv
heads by default), fp32 AdamW (lr 1e-3), batch 1, random tokens (one fixed seed: every
rank gets the same global batch; `sequence_parallel` gives rank r tokens
[r*T/sp, (r+1)*T/sp)). Ranks are fresh processes (`dsfn.launch.spawn`, fork, gloo, one
intra-op thread per rank); sp=1 is `compose()` (no transforms) in a 1-rank spawn.

Parts (`--parts`, default all):

1. `memory`: the longest sequence whose training step stays under `--cap-mib` per rank, at
   each sp; `tiled` does the same with `dsfn.ops.tile_mlps(model, --tiles)` (every Llama
   MLP runs tile by tile over the sequence and is recomputed in backward). Memory of a
   step = peak resident growth of the rank process during a training step: fresh ranks
   per (sp, seq) probe build the model and state and run one warm-up step on sp*64
   tokens; then, for each of `--mem-steps` (2) steps at the probed length, the high-water
   mark is reset (`echo 5 > /proc/self/clear_refs`), VmRSS read, the step run, and VmHWM
   read: a step's memory is VmHWM - VmRSS, a probe's the max over its steps and ranks.
   To make RSS track live tensors, the ranks run with glibc's mmap threshold fixed at
   64 KiB and trim threshold 128 KiB (`mallopt`, set after the Step is built, in place of
   dsfn's `tune_host_allocator`, which keeps freed memory in the process on purpose):
   every block of >= 64 KiB is mapped on allocation and unmapped on free. Consecutive
   steps at one length still alternate by up to ~10 MiB, hence the max over two; so
   measured, repeated probes agree within ~+-2 MiB (with dsfn's allocator settings, up
   to +-30 MiB, and the heap grows from step to step).
   Search: from sp*512 tokens, extrapolate the measured peaks linearly
   (at most doubling per probe) until a probe exceeds the cap, then bisect the bracket
   [fits, exceeds] on multiples of sp*64, choosing the split point on the line through
   the two probes whose peaks are nearest the cap (plain halving if the bracket stops
   halving), until the bracket is one multiple wide. Above a floor (the optimizer update:
   gradients + new parameters + new moments, 4-5x the parameter bytes) the peak is close
   to linear in the length (the CPU sdpa kernel is a flash kernel: no [T, T] scores), so
   this takes ~4-6 probes per line.
   `remat` does it with `remat()` (every decoder layer checkpointed), `alst` with both
   `tile_mlps` and `remat()` (DeepSpeed ALST's recipe, less its offload), and `gqa` with
   the untiled model given `--gqa-kv-heads` (2) key/value heads: at sp=4 Ulysses
   replicates them (x2, `kv_replication`). Each memory table prints the sp=2 and sp=4
   lengths against sp=1's with the targets (>= 1.8x, >= 3.5x).
2. `time`: median step time (slowest rank, barrier before each step, `--warmup` untimed
   steps then `--steps` timed) at the same global tokens (`--time-seq`, batch 1) for each
   sp, ratio vs sp=1, and the summed process CPU time of the ranks; the losses of all sp
   are compared with sp=1's (the same function of the same batch).
3. communication: from the time part's ranks, `step.explain(state, batch).collectives`
   (runtime counters: an all-to-all counts the tensor this rank sends), split into
   forward / backward by a counter snapshot taken where the forward ends (in the loss).
   Ulysses theory per attention layer, per rank: forward all-to-alls q and out
   (B*T/sp*H*d*4 bytes each) and k and v (B*T/sp*Hkv*f*d*4 each, f the kv replication
   factor sp / gcd(Hkv, sp)); backward the same 4 (their adjoints): 8 calls,
   2*(2H + 2Hkv*f)*d*4*B*T/sp bytes per layer per step.

The `alst` part at sp=4 probes sequences of ~20K+ tokens (minutes per probe on 2 cores):
`--parts memory,gqa,time` (default set below) stays near 5 minutes on 2 idle cores.
"""
from __future__ import annotations

import argparse
import ctypes
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
import torch.distributed as dist

import dsfn
import dsfn.launch
import dsfn.ops
from dsfn.runtime import collectives as C
from _steps import add_llama_args, explained_step, finish_llama_args, llama_config, timed_steps
from dsfn.runtime import init_mesh
from dsfn.transforms import compose, sequence_parallel

MiB = 2 ** 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3        # glibc mallopt parameters
PARTS = ("memory", "tiled", "remat", "alst", "gqa", "time")


# --------------------------------------------------------------------------- the model and step


def _batch(a: dict, seq: int, seed_offset: int = 1) -> dict:
    """One global batch [batch, seq] (the same on every rank: the transform slices it)."""
    g = torch.Generator().manual_seed(a["seed"] + seed_offset)
    ids = torch.randint(0, a["vocab"], (a["batch"], seq + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _build(sp: int, seq: int, tiles: int, a: dict, mark: dict | None = None):
    import transformers
    init_mesh(sp=sp)
    torch.manual_seed(a["seed"])
    model = transformers.LlamaForCausalLM(llama_config(a, seq))
    if a.get("remat"):
        model.config.use_cache = False      # remat runs the layers without a cache anyway (and would warn)
    if tiles:
        dsfn.ops.tile_mlps(model, tiles)
    apply_fn, params = dsfn.functionalize(model)

    def loss_fn(p, b):
        logits = apply_fn(p, b["input_ids"]).logits
        if mark is not None and mark.get("on"):
            mark["fwd"] = C.counters.snapshot()        # the forward's collectives end here
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                                 ignore_index=-100)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    from dsfn.transforms import remat
    stack = ([sequence_parallel()] if sp > 1 else []) + ([remat()] if a.get("remat") else [])
    step = compose(*stack)(train_step)
    state = step.init_state(params, dsfn.optim.adamw(lr=1e-3), seed=a["seed"])
    return step, state


# --------------------------------------------------------------------------- part 1: memory

MEMORY_PARTS = ("memory", "tiled", "remat", "alst", "gqa")


def _kv_factor(kv_heads: int, sp: int) -> int:
    """Ulysses' key/value replication at `sp` (dsfn.transforms.sequence_parallel.kv_replication)."""
    return sp // math.gcd(kv_heads, sp)



def _vm() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rank_mem(sp: int, seq: int, tiles: int, a: dict) -> dict:
    step, state = _build(sp, seq, tiles, a)
    # RSS tracks live tensors: every block >= 64 KiB is mmapped and returned on free
    # (replaces dsfn's tune_host_allocator, which the Step applied, for this measurement)
    libc = ctypes.CDLL("libc.so.6")
    tuned = libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) == 1
    warm = _batch(a, sp * 64, seed_offset=2)
    state, _ = step(state, warm)                     # one-off allocations (lazy init, buffers) happen here
    batch = _batch(a, seq)
    peaks, rss, hwm_before, times, reset = [], [], [], [], True
    for _ in range(a["mem_steps"]):                  # consecutive steps alternate by up to ~10 MiB: take the max
        dist.barrier()
        reset = _reset_hwm() and reset
        before = _vm()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        times.append(time.perf_counter() - t0)
        after = _vm()
        peaks.append(after["VmHWM"] - before["VmRSS"])
        rss.append(before["VmRSS"])
        hwm_before.append(before["VmHWM"])
    return {"peak": max(peaks), "peaks": peaks, "rss": rss[0], "hwm_before": hwm_before, "hwm_reset": reset,
            "mallopt": tuned, "step_s": max(times), "loss": float(m["loss"])}


def _search(sp: int, tiles: int, a: dict, log) -> dict:
    """Longest multiple of sp*64 tokens whose step peak (max over ranks) is <= the cap."""
    cap, unit = a["cap_mib"] * MiB, sp * 64
    peaks: dict[int, int] = {}
    probes: list[dict] = []

    def probe(seq: int) -> int:
        t0 = time.perf_counter()
        per_rank = dsfn.launch.spawn(_rank_mem, sp, args=(sp, seq, tiles, a), timeout=1800)
        peak = max(r["peak"] for r in per_rank)
        peaks[seq] = peak
        probes.append({"seq": seq, "peak": peak, "per_rank": [r["peak"] for r in per_rank],
                       "rss": max(r["rss"] for r in per_rank), "step_s": max(r["step_s"] for r in per_rank),
                       "hwm_reset": all(r["hwm_reset"] for r in per_rank),
                       "mallopt": all(r["mallopt"] for r in per_rank), "wall_s": time.perf_counter() - t0})
        log(f"    sp={sp} {'tiled ' if tiles else ''}seq {seq:6d}: peak {peak / MiB:7.1f} MiB/rank "
            f"({'fits' if peak <= cap else 'over'}; {probes[-1]['wall_s']:.1f} s)")
        return peak

    def down(x: float) -> int:
        return max(unit, int(x // unit) * unit)

    def line_at(p: int, q: int | None) -> float | None:
        """Length where the line through the probes p, q (or through 0 and p) reaches the cap;
        None when the two probes give no rising line."""
        if q is None:
            return p * cap / max(peaks[p], 1)
        if q == p or (peaks[q] - peaks[p]) * (q - p) <= 0:
            return None
        return p + (cap - peaks[p]) * (q - p) / (peaks[q] - peaks[p])

    seq, widths = down(sp * 512), []
    while len(probes) < a["max_probes"]:
        probe(seq)
        fits = [s for s, m in peaks.items() if m <= cap]
        over = [s for s, m in peaks.items() if m > cap]
        lo, hi = (max(fits) if fits else None), (min(over) if over else None)
        if hi is not None and hi == unit:
            break                                     # even the shortest length exceeds the cap
        if lo is not None and hi is not None:         # bisect [lo, hi]
            if hi - lo <= unit:
                break
            widths.append(hi - lo)
            # the secant through the two probes nearest the cap (the peak is close to linear in
            # the length above the optimizer update's floor), else the chord lo-hi
            near = sorted(peaks, key=lambda s: abs(peaks[s] - cap))[:2]
            nxt = line_at(near[0], near[1]) if len(near) == 2 else None
            if nxt is None:
                nxt = line_at(lo, hi)
            if nxt is None or (len(widths) >= 3 and widths[-1] > widths[-3] / 2):
                nxt = lo + (hi - lo) / 2              # interpolation stalled: halve the bracket
            seq = min(max(down(nxt), lo + unit), hi - unit)
        elif hi is None:                              # all fit so far: extrapolate, at most doubling
            top = sorted(peaks)[-2:]
            nxt = line_at(top[-1], top[0]) if len(top) == 2 else None
            if nxt is None:
                nxt = line_at(top[-1], None)
            seq = min(max(down(nxt), lo + unit), 2 * lo)
        else:                                         # none fits yet: scale down
            seq = min(down(line_at(hi, None)), hi - unit)
    fits = [s for s, m in peaks.items() if m <= cap]
    over = [s for s, m in peaks.items() if m > cap]
    best = max(fits) if fits else 0
    nxt = min([s for s in over if s > best], default=None)
    return {"sp": sp, "tiles": tiles, "seq": best, "peak": peaks.get(best, 0), "next_seq": nxt,
            "next_peak": peaks.get(nxt) if nxt else None, "probes": probes,
            "exact": nxt is not None and nxt - best <= unit}


# --------------------------------------------------------------------------- part 2/3: time, communication


def _rank_time(sp: int, a: dict) -> dict:
    mark: dict = {}
    seq = a["time_seq"]
    step, state = _build(sp, seq, 0, a, mark)
    batches = [_batch(a, seq, seed_offset=1 + i) for i in range(a["warmup"] + a["steps"])]
    state, times, cpu, losses = timed_steps(step, state, batches, a["warmup"])
    ex, comm = explained_step(step, state, batches[0], mark)
    param_bytes = sum(x[4] for x in ex.leaves if x[0].startswith("params."))
    return {"times": times, "cpu": cpu, "losses": losses, "comm": comm, "param_bytes": param_bytes,
            "stack": ex.stack}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_llama_args(ap)
    ap.add_argument("--batch", type=int, default=1, help="global batch rows (every sp rank sees all of them)")
    ap.add_argument("--sp", default="1,2,4", help="comma-separated sp degrees (each must divide heads and kv heads)")
    ap.add_argument("--cap-mib", type=float, default=128.0, help="memory cap per rank for the step's peak (MiB)")
    ap.add_argument("--tiles", type=int, default=8, help="tiles of tile_mlps in the `tiled` and `alst` parts")
    ap.add_argument("--gqa-kv-heads", type=int, default=2,
                    help="kv heads of the `gqa` part's model (fewer than sp: Ulysses replicates them)")
    ap.add_argument("--max-probes", type=int, default=12, help="most probes per search line")
    ap.add_argument("--mem-steps", type=int, default=2,
                    help="measured steps per probe (each from its own baseline); a probe's memory is their max")
    ap.add_argument("--time-seq", type=int, default=2048, help="global sequence length of the `time` part")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="memory,gqa,time",
                    help=f"comma-separated subset of {list(PARTS)} (default memory,gqa,time; tiled, remat and "
                         "alst probe long sequences: minutes each on 2 cores)")
    ap.add_argument("--quick", action="store_true",
                    help="2 layers, cap 64 MiB, time at seq 1024 with 1 warm-up + 3 steps (~1 min)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t_start = time.perf_counter()
    if a.quick:
        a.layers, a.cap_mib, a.time_seq, a.warmup, a.steps = 2, 64.0, 1024, 1, 3
    finish_llama_args(a)
    sps = [int(s) for s in a.sp.split(",") if s.strip()]
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown parts {bad}; choose from {list(PARTS)}")
    badsp = [s for s in sps if s < 1 or a.heads % s]
    if badsp:
        ap.error(f"sp {badsp} must divide --heads {a.heads} (kv heads fewer than sp are replicated)")
    if a.heads % a.kv_heads or a.heads % a.gqa_kv_heads:
        ap.error(f"--kv-heads {a.kv_heads} and --gqa-kv-heads {a.gqa_kv_heads} must divide --heads {a.heads}")
    if "time" in parts and any(a.time_seq % s for s in sps):
        ap.error(f"--time-seq {a.time_seq} must be divisible by every sp {sps}")
    args = {k: getattr(a, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch",
                                        "cap_mib", "max_probes", "mem_steps", "time_seq", "warmup", "steps", "seed")}
    L, H, V, B = a.layers, a.hidden, a.vocab, a.batch
    d = H // a.heads
    import transformers
    n_params = sum(p.numel() for p in transformers.LlamaForCausalLM(llama_config(args, 2048)).parameters())
    print(f"LlamaForCausalLM: {n_params / 1e6:.2f}M params, {L} layers, hidden {H}, intermediate {a.intermediate}, "
          f"{a.heads} heads / {a.kv_heads} kv heads (d {d}), vocab {V}; batch {B}, fp32 AdamW; sp {sps}; "
          f"gloo, 1 thread per rank, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)

    def log(s: str) -> None:
        print(s, flush=True)

    res: dict = {"memory": {}, "tiled": {}, "remat": {}, "alst": {}, "gqa": {}, "time": {}}
    for part in MEMORY_PARTS:
        if part not in parts:
            continue
        tiles = a.tiles if part in ("tiled", "alst") else 0
        remat = part in ("remat", "alst")
        part_args = {**args, "remat": remat}
        if part == "gqa":
            part_args["kv_heads"] = a.gqa_kv_heads
        log(f"\n{part}: longest sequence with step peak <= {a.cap_mib:g} MiB/rank"
            + (f" (tile_mlps, {tiles} tiles)" if tiles else "") + (" (remat(): every layer checkpointed)"
                                                                    if remat else "")
            + (f" ({a.heads} query / {a.gqa_kv_heads} kv heads; kv replicated x"
               + "/".join(str(_kv_factor(a.gqa_kv_heads, sp)) for sp in sps) + f" at sp {sps})"
               if part == "gqa" else ""))
        for sp in sps:
            res[part][sp] = _search(sp, tiles, part_args, log)

    if "time" in parts:
        log(f"\ntime: seq {a.time_seq}, batch {B}, {a.warmup} warm-up + {a.steps} timed steps")
        for sp in sps:
            per_rank = dsfn.launch.spawn(_rank_time, sp, args=(sp, args), timeout=1800)
            r0 = per_rank[0]
            slowest = [max(r["times"][i] for r in per_rank) for i in range(len(r0["times"]))]
            res["time"][sp] = {**r0, "ranks": sp, "step_s": slowest, "step_median_s": statistics.median(slowest),
                               "step_min_s": min(slowest),
                               "cpu_median_s": statistics.median(sum(r["cpu"][i] for r in per_rank)
                                                                 for i in range(len(slowest)))}
            log(f"    sp={sp}: step {res['time'][sp]['step_median_s']:.3f} s  loss {r0['losses'][-1]:.4f}")

    # ---- tables
    targets = []
    for part in MEMORY_PARTS:
        rows = res[part]
        if not rows:
            continue
        base = rows.get(1) or rows[min(rows)]
        title = {"memory": "MLPs untiled", "tiled": f"tile_mlps({a.tiles})", "remat": "remat()",
                 "alst": f"tile_mlps({a.tiles}) + remat()",
                 "gqa": f"GQA {a.heads} query / {a.gqa_kv_heads} kv heads, MLPs untiled"}[part]
        print(f"\nlongest sequence under {a.cap_mib:g} MiB/rank step peak ({title}; multiples of sp*64; "
              f"peak = VmHWM - VmRSS of a step, max over "
              f"{a.mem_steps} steps and the ranks)")
        print("sp  ranks  longest seq  vs sp=1  tokens/rank  peak MiB/rank  next (seq: MiB)  probes")
        for sp, r in rows.items():
            vs = r["seq"] / base["seq"] if base["seq"] else float("nan")
            nxt = f"{r['next_seq']}: {r['next_peak'] / MiB:.1f}" if r["next_seq"] else "-"
            print(f"{sp:2d} {sp:6d} {r['seq']:12d} {vs:8.2f} {r['seq'] // sp:12d} {r['peak'] / MiB:14.1f} "
                  f"{nxt:>16s} {len(r['probes']):7d}")
        if part == "tiled" and res["memory"]:
            parts_txt = ", ".join(f"sp={sp} {r['seq'] / res['memory'][sp]['seq']:.2f}x"
                                  for sp, r in rows.items() if sp in res["memory"] and res["memory"][sp]["seq"])
            print(f"  tiled vs untiled longest seq: {parts_txt}")
        if part == "remat" and res["memory"]:
            parts_txt = ", ".join(f"sp={sp} {r['seq'] / res['memory'][sp]['seq']:.2f}x"
                                  for sp, r in rows.items() if sp in res["memory"] and res["memory"][sp]["seq"])
            print(f"  remat vs no checkpointing, longest seq: {parts_txt} (target >= 2x)")
        if part == "alst" and res["memory"]:
            parts_txt = ", ".join(f"sp={sp} {r['seq'] / res['memory'][sp]['seq']:.2f}x"
                                  for sp, r in rows.items() if sp in res["memory"] and res["memory"][sp]["seq"])
            print(f"  tile_mlps + remat vs neither, longest seq: {parts_txt}")
        if 1 in rows and rows[1]["seq"]:
            for sp, goal in ((2, 1.8), (4, 3.5)):
                if sp in rows:
                    ratio = rows[sp]["seq"] / rows[1]["seq"]
                    ok = ratio >= goal
                    targets.append((title, sp, ratio, goal, ok))
                    print(f"  sp={sp} vs sp=1: {ratio:.2f}x (target >= {goal}x: {'PASS' if ok else 'FAIL'})")

    if res["time"]:
        rows = res["time"]
        base = rows.get(1)
        print(f"\nstep time at the same global tokens (batch {B} x seq {a.time_seq}; median of the slowest rank over "
              f"{a.steps} steps)")
        print("sp  ranks  tokens/rank  step s (median)  min s  vs sp=1  CPU s (all ranks)  vs sp=1  final loss  "
              "max |dloss| vs sp=1")
        for sp, r in rows.items():
            vs_t = r["step_median_s"] / base["step_median_s"] if base else float("nan")
            vs_c = r["cpu_median_s"] / base["cpu_median_s"] if base else float("nan")
            dl = max(abs(x - y) for x, y in zip(r["losses"], base["losses"])) if base else float("nan")
            print(f"{sp:2d} {sp:6d} {a.time_seq // sp:12d} {r['step_median_s']:16.3f} {r['step_min_s']:6.3f} "
                  f"{vs_t:8.2f} {r['cpu_median_s']:18.3f} {vs_c:8.2f} {r['losses'][-1]:11.4f} {dl:20.2e}")

        print(f"\nsp all-to-all bytes per step and per attention layer (this rank's sends; seq {a.time_seq}, batch {B}; "
              "theory per layer = fwd q,k,v,out + the same 4 in bwd)")
        print("sp  calls (fwd/bwd)  MiB/step  fwd MiB  bwd MiB  per layer MiB  theory/layer MiB  ratio  "
              "calls/layer  sp all-reduce (calls, MiB)")
        for sp, r in rows.items():
            if sp == 1:
                continue
            tl = B * a.time_seq // sp
            q = tl * a.heads * d * 4
            kv = tl * a.kv_heads * _kv_factor(a.kv_heads, sp) * d * 4     # replicated kv heads travel too
            theory = 2 * (2 * q + 2 * kv)
            c = r["comm"].get("sp/all_to_all", {"calls": 0, "bytes": 0, "fwd_calls": 0, "fwd_bytes": 0})
            ar = r["comm"].get("sp/all_reduce", {"calls": 0, "bytes": 0})
            per_layer = c["bytes"] / L
            r["a2a_theory_per_layer"] = theory
            print(f"{sp:2d} {c['calls']:5d} ({c['fwd_calls']}/{c['calls'] - c['fwd_calls']}) "
                  f"{c['bytes'] / MiB:9.3f} {c['fwd_bytes'] / MiB:8.3f} {(c['bytes'] - c['fwd_bytes']) / MiB:8.3f} "
                  f"{per_layer / MiB:14.3f} {theory / MiB:17.3f} {per_layer / theory:6.3f} {c['calls'] / L:12g}"
                  f"   {ar['calls']}, {ar['bytes'] / MiB:.3f} (params {r['param_bytes'] / MiB:.3f})")

    print("\nnotes:")
    print(f"  - memory: fresh ranks per probe; a warm-up step on sp*64 tokens, then {a.mem_steps} steps at the probed "
          "length, each measured from its own baseline (high-water mark reset via /proc/self/clear_refs, VmRSS read "
          "before, VmHWM after); the max over steps and ranks counts. glibc's mmap threshold is fixed at 64 KiB (trim "
          "128 KiB) in the ranks so that RSS follows the live tensors (dsfn's default keeps freed memory in the "
          "process). Repeated probes agree within ~+-2 MiB: the longest length is good to ~2 multiples of sp*64.")
    if any(not p["hwm_reset"] for part in MEMORY_PARTS for r in res[part].values()
           for p in r["probes"]):
        print("  - WARNING: /proc/self/clear_refs was not writable here: the peaks are VmHWM after the step minus "
              "VmRSS before it, with the high-water mark of model building and the warm-up step not reset (valid "
              "only where the probed step's peak exceeds those).")
    print("  - what grows with the length: every layer's saved activations of this rank's T/sp tokens, the logits of "
          "its tokens, and (sp > 1) the copies around Ulysses' all-to-alls (q/k/v/out of the whole sequence for H/sp "
          "heads); the state (params + AdamW moments) is in the baseline. At short lengths the optimizer update "
          "(gradients + new params + new moments: 4-5x the parameter bytes) is the step's peak instead: the floor of "
          "the short probes.")
    print("  - step times: every rank runs 1 intra-op thread; sp=1 uses one core, sp=2 both, sp=4 oversubscribes "
          "2 cores (4 ranks): its times are not a speed claim (nor any when the load printed above exceeds the CPU "
          "count). CPU s sums the ranks' process CPU time per step.")
    print("  - all-to-all bytes are what a rank sends (its tensor); (sp-1)/sp of it leaves the rank. The sp "
          "all-reduce sums the gradients over sp (every sp rank holds all parameters): params bytes, plus the "
          "loss's token counts and value.")
    if targets:
        print("  - targets (longest sequence vs sp=1: >= 1.8x at sp=2, >= 3.5x at sp=4): "
              + "; ".join(f"{t} sp={sp} {r:.2f}x {'PASS' if ok else 'FAIL'}" for t, sp, r, _, ok in targets))
    print(f"total time {time.perf_counter() - t_start:.0f} s")
    if a.json:
        a.json.write_text(json.dumps({"args": args, "results": res}, indent=2, default=str))


if __name__ == "__main__":
    main()
