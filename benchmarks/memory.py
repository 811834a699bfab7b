"""Peak resident memory per rank and step time: DDP, FSDP2 and dsfn, with and without donation.

    python benchmarks/memory.py                 # 27.4M GPT ("27m"), 2 gloo ranks (~10 min on 2 cores)
    python benchmarks/memory.py --quick         # tiny GPT, few steps (< 1 min)
    python benchmarks/memory.py --configs ddp,zero3,zero3+donate --json out.json

Every configuration runs in its own freshly spawned process group (2 ranks, fork, one
intra-op thread each), so peaks never mix: the same model, data and AdamW
(lr 1e-3, betas (0.9, 0.95), wd 0.1, fp32) in every one. Per rank:
- `setup MiB`: the high-water mark (VmHWM) from before the model is built until the
  first step starts (model, functionalize, init/place or DDP/FSDP2 wrapping);
- `step MiB`: the high-water mark over the steps alone (VmHWM reset with
  `/proc/self/clear_refs` = 5 right before the first step);
- `peak MiB`: the process's whole high-water mark (VmHWM at the end, = ru_maxrss);
- `base MiB`: resident memory before the model is built (the interpreter, torch, the data),
  so `peak - base` is what training added;
- step time: median over the timed steps of the slowest rank (barrier before each).
Figures are the max over ranks. `+donate` runs the same dsfn stack with
`compose(..., donate=True)`: the optimizer updates the state's buffers in place.

Donation's step time is also measured *paired* (`--paired`, on by default): one process
group per dsfn stack trains two states side by side, alternating a donated and a
non-donated step on the same batch, so a load change on a shared machine hits both
alike; the figure is the median of the per-pair ratios (donated / non-donated).

`--malloc live` sets glibc's allocator, in every rank of every system alike, to return
freed blocks of 64 KiB or more to the kernel at once (mmap threshold 64 KiB, trim
threshold 1 MiB; dsfn's `tune_host_allocator` off): RSS then follows the bytes that are
live, so the peaks say what the programs hold rather than what the allocator keeps. It
is slow (every step faults its temporaries in again): read its step times as nothing.

`--ckpt DIR` adds async checkpoints under donation (ZeRO-3, `async_checkpoint(every=2)`
into DIR, writes to the page cache): a capture by reference makes the donated step after a
save wait for the write (the writer still reads the buffers the step overwrites);
`capture="copy"` snapshots the state into a reused host buffer at the save instead, so no
step waits, at the cost of one state-sized buffer. Printed per mode: the median time of
the saving steps (capture, plus the wait for the previous save: one save in flight) and
of the steps right after a save, and the peak RSS.

Targets (issue 17): dsfn data_parallel peak <= DDP; dsfn ZeRO-3 peak <= FSDP2 and
<= 0.8x DDP; step time with donation <= 1.03x without. The script prints PASS/FAIL, the
ZeRO-3 rows with their ratios to DDP and FSDP2 measured in the same run (the table's
"vs DDP" and "vs FSDP2" columns).
"""
from __future__ import annotations

import argparse
import json
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

import dsfn  # noqa: E402
import dsfn.launch  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from _steps import global_mean, peer  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
DSFN = ["dp", "zero1", "zero2", "zero3", "zero3+offload"]
CONFIGS = ["ddp", "fsdp2"] + [c + d for c in DSFN for d in ("", "+donate")]


def _status(key: str) -> float:
    """A /proc/self/status field in MiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _live_malloc() -> None:
    """glibc returns freed blocks >= 64 KiB to the kernel at once (see `--malloc live`)."""
    import ctypes
    import os
    os.environ["DSFN_MALLOC_TUNING"] = "0"            # read when the first Step is built
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 2**10)                      # M_MMAP_THRESHOLD (fixed: no dynamic growth)
    libc.mallopt(-1, 2**20)                           # M_TRIM_THRESHOLD


def _batches(cfg: GPTConfig, global_batch: int, n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _dsfn_step(name: str, apply_fn):
    from dsfn.transforms import data_parallel, offload, shard_zero

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    base, donate = name.removesuffix("+donate"), name.endswith("+donate")
    stack = {"dp": [data_parallel()], "zero1": [shard_zero(1)], "zero2": [shard_zero(2)],
             "zero3": [shard_zero(3)], "zero3+offload": [shard_zero(3), offload("cpu")]}[base]
    return dsfn.compose(*stack, donate=donate)(train_step)


def _rank_main(name: str, preset: str, micro: int, warmup: int, steps: int, seed: int, malloc: str) -> dict:
    if malloc == "live":
        _live_malloc()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig.preset(preset)
    batches = _batches(cfg, micro * world, warmup + steps, seed)
    _reset_hwm()
    base = _status("VmRSS")
    torch.manual_seed(seed)
    model = GPT(cfg)
    times: list[float] = []
    if name in ("ddp", "fsdp2"):
        net, opt = peer(name, model, HP)
        setup = _status("VmHWM")
        _reset_hwm()
        for i, b in enumerate(batches):
            rows = slice(rank * micro, (rank + 1) * micro)
            dist.barrier()
            t0 = time.perf_counter()
            loss = gpt_loss(net(b["input_ids"][rows]), b["labels"][rows])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        final_loss = global_mean(loss)
    else:
        apply_fn, params = dsfn.functionalize(model, release=True)
        step = _dsfn_step(name, apply_fn)
        state = step.init_state(params, dsfn.optim.adamw(**HP), seed=seed)   # moments born in their layout
        del params
        setup = _status("VmHWM")
        _reset_hwm()
        for i, b in enumerate(batches):
            dist.barrier()
            t0 = time.perf_counter()
            state, m = step(state, b)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        final_loss = float(m["loss"])
    step_peak = _status("VmHWM")
    peak_total = max(setup, step_peak)
    return {"name": name, "base_mb": base, "setup_mb": setup, "step_mb": step_peak, "peak_mb": peak_total,
            "step_s": times, "loss": final_loss}


def _paired_main(name: str, preset: str, micro: int, warmup: int, steps: int, seed: int) -> dict:
    """Donated vs non-donated step time of one dsfn stack, alternating in one process group."""
    cfg = GPTConfig.preset(preset)
    batches = _batches(cfg, micro * dist.get_world_size(), warmup + steps, seed)
    runs = {}
    for donate in (False, True):
        torch.manual_seed(seed)
        apply_fn, params = dsfn.functionalize(GPT(cfg), release=True)
        step = _dsfn_step(name + ("+donate" if donate else ""), apply_fn)
        runs[donate] = [step, step.init_state(params, dsfn.optim.adamw(**HP), seed=seed)]
    ratios, times = [], {False: [], True: []}
    for i, b in enumerate(batches):
        order = (False, True) if i % 2 == 0 else (True, False)     # neither always goes first
        for donate in order:
            step, state = runs[donate]
            dist.barrier()
            t0 = time.perf_counter()
            runs[donate][1], m = step(state, b)
            dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)              # the slowest rank's step
            if i >= warmup:
                times[donate].append(float(dt))
        if i >= warmup:
            ratios.append(times[True][-1] / times[False][-1])
    return {"ratio": statistics.median(ratios), "donated_s": statistics.median(times[True]),
            "plain_s": statistics.median(times[False])}


def _ckpt_main(mode: str, root: str, preset: str, micro: int, steps: int, seed: int) -> dict:
    """ZeRO-3 with async checkpoints every 2 steps; mode: "reference", "reference+donate", "copy+donate"."""
    from dsfn.transforms import async_checkpoint, shard_zero
    cfg = GPTConfig.preset(preset)
    batches = _batches(cfg, micro * dist.get_world_size(), steps, seed)
    capture, donate = mode.removesuffix("+donate"), mode.endswith("+donate")
    torch.manual_seed(seed)
    apply_fn, params = dsfn.functionalize(GPT(cfg), release=True)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    ckpt = async_checkpoint(f"{root}/{mode}", every=2, keep=1, capture=capture)
    step = dsfn.compose(shard_zero(3), ckpt, donate=donate)(train_step)
    state = step.init_state(params, dsfn.optim.adamw(**HP), seed=seed)
    del params
    saving, after = [], []
    for i, b in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        state, m = step(state, b)
        dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= 2:                          # step i makes step i + 1: odd i saves, even i follows a save
            (after if i % 2 == 0 else saving).append(float(dt))
    ckpt.wait()
    return {"saving_s": statistics.median(saving), "after_save_s": statistics.median(after),
            "peak_mb": _status("VmHWM")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="27m")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="tiny GPT, 1 warm-up + 3 steps")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-paired", dest="paired", action="store_false",
                    help="skip the paired donated/non-donated step-time runs")
    ap.add_argument("--paired-steps", type=int, default=12)
    ap.add_argument("--ckpt", type=Path, default=None, help="also measure async checkpoints under donation, "
                    "writing into this directory")
    ap.add_argument("--malloc", choices=("default", "live"), default="default",
                    help="live: glibc returns freed blocks at once, so RSS follows the live bytes")
    a = ap.parse_args()
    if a.quick:
        a.model, a.warmup, a.steps = "tiny", 1, 3
    world = 2
    cfg = GPTConfig.preset(a.model)
    print(f"GPT {a.model}: {cfg.num_params() / 1e6:.1f}M params, seq {cfg.seq_len}, micro-batch {a.micro_batch} x "
          f"{world} ranks (gloo, 1 thread each), AdamW fp32, {a.warmup} warm-up + {a.steps} timed steps, "
          f"malloc {a.malloc}", flush=True)
    results = {}
    for name in a.configs.split(","):
        per_rank = dsfn.launch.spawn(_rank_main, world, args=(name, a.model, a.micro_batch, a.warmup, a.steps,
                                                              a.seed, a.malloc), timeout=1800)
        slowest = [max(r["step_s"][i] for r in per_rank) for i in range(len(per_rank[0]["step_s"]))]
        r = {k: max(x[k] for x in per_rank) for k in ("base_mb", "setup_mb", "step_mb", "peak_mb")}
        r.update(step_median_s=statistics.median(slowest), loss=per_rank[0]["loss"])
        results[name] = r
        print(f"  {name:20s} peak {r['peak_mb']:7.1f} MiB (setup {r['setup_mb']:7.1f}, steps {r['step_mb']:7.1f}, "
              f"base {r['base_mb']:6.1f})  step {r['step_median_s']:.3f}s  loss {r['loss']:.5f}", flush=True)

    ddp, f2 = results.get("ddp"), results.get("fsdp2")

    def vs(name: str, ref: dict | None) -> float:
        """`name`'s peak RSS over the reference system's, measured in this run."""
        return results[name]["peak_mb"] / ref["peak_mb"] if ref else float("nan")
    print("\nconfig                peak MiB  peak-base  vs DDP  vs FSDP2  setup MiB  steps MiB  step s  vs non-donated")
    for name, r in results.items():
        plain = results.get(name.replace("+donate", "")) if name.endswith("+donate") else None
        t = f"{r['step_median_s'] / plain['step_median_s']:.3f}" if plain else ""
        print(f"{name:20s} {r['peak_mb']:9.1f} {r['peak_mb'] - r['base_mb']:10.1f} {vs(name, ddp):7.3f} "
              f"{vs(name, f2):9.3f} {r['setup_mb']:10.1f} {r['step_mb']:10.1f} {r['step_median_s']:7.3f} {t:>15s}")

    paired = {}
    if a.paired:
        print("\npaired step time, donated / non-donated (alternating steps in one process group):")
        for name in dict.fromkeys(n.removesuffix("+donate") for n in a.configs.split(",") if n in CONFIGS[2:]):
            per_rank = dsfn.launch.spawn(_paired_main, world, args=(name, a.model, a.micro_batch, a.warmup,
                                                                     a.paired_steps, a.seed), timeout=1800)
            paired[name] = per_rank[0]
            p = paired[name]
            print(f"  {name:20s} {p['ratio']:.3f}  (medians: donated {p['donated_s']:.3f}s, "
                  f"non-donated {p['plain_s']:.3f}s)", flush=True)

    ckpt = {}
    if a.ckpt is not None:
        print("\nZeRO-3 + async_checkpoint(every=2): median time of the saving steps (capture, and the wait for the "
              "previous save) and of the steps after a save; peak RSS:")
        for mode in ("reference", "reference+donate", "copy+donate"):
            per_rank = dsfn.launch.spawn(_ckpt_main, world, args=(mode, str(a.ckpt), a.model, a.micro_batch,
                                                                   a.paired_steps, a.seed), timeout=1800)
            ckpt[mode] = per_rank[0] | {"peak_mb": max(r["peak_mb"] for r in per_rank)}
            c = ckpt[mode]
            print(f"  {mode:18s} saving step {c['saving_s']:.3f}s  step after a save {c['after_save_s']:.3f}s  "
                  f"peak {c['peak_mb']:.1f} MiB", flush=True)

    checks = []
    for dp in ("dp", "dp+donate"):
        if ddp and dp in results:
            checks.append((f"{dp} peak <= DDP", results[dp]["peak_mb"] <= ddp["peak_mb"]))
    for z in ("zero3", "zero3+donate"):
        if z in results and f2:
            checks.append((f"{z} peak <= FSDP2 ({vs(z, f2):.3f}x FSDP2)", vs(z, f2) <= 1))
        if z in results and ddp:
            checks.append((f"{z} peak <= 0.80x DDP ({vs(z, ddp):.3f}x DDP)", vs(z, ddp) <= 0.8))
    for name, p in paired.items():
        checks.append((f"{name}: donated step <= 1.03x non-donated (paired)", p["ratio"] <= 1.03))
    print()
    for what, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    if a.json:
        a.json.write_text(json.dumps({"runs": results, "paired": paired, "ckpt": ckpt}, indent=2, default=float))


if __name__ == "__main__":
    main()
