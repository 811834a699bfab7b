"""Parameter offload on one device (ZeRO-Infinity at world 1, issue 40): the device bytes that
hold weights during a step, against the model's size.

    python benchmarks/offload_one_device.py             # GPT "27m" (6 layers, d512), CPU: the accounting
    python benchmarks/offload_one_device.py --quick     # GPT "small"
    python benchmarks/offload_one_device.py --device cuda   # a GPU: torch.cuda.max_memory_allocated too

`compose(shard_zero(3), offload("cpu", params=True))` on one rank keeps every parameter in
host memory and copies each unit to the device just before it runs (the next prefetched).
On CPU the "device" is the same memory, so the figure is the runtime's accounting: the peak
of ZeRO-3's units in flight (the gauge "zero3.live_units", the root unit besides) times the
largest unit's weight bytes, plus the root unit's (embeddings, head), against all the
parameters' bytes. On a GPU the same run also reports the peak allocated device bytes, with
the plain single-device step (everything resident) beside it. Step time: dsfn's offloaded
step against the plain one in the same process (median of repeats after warm-up).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn.models import GPT, GPTConfig, gpt_loss  # noqa: E402
from dsfn.runtime import collectives as C  # noqa: E402
from dsfn.runtime import init_mesh  # noqa: E402
from dsfn.transforms import offload, shard_zero  # noqa: E402
from dsfn.units import find_units  # noqa: E402


def run(stack, cfg, device, steps):
    model = GPT(cfg, seed=0).to(device)
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: gpt_loss(apply_fn(p, b["input_ids"]), b["labels"]))(
            state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*stack)(train_step)
    state = step.place(dsfn.TrainState.create(params, tx=dsfn.optim.adamw(1e-3)))
    del params
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device=device)
    batch = {"input_ids": ids, "labels": ids}
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    C.reset_gauges()
    for k in range(steps + 2):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        if k >= 2:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return model, statistics.median(times), dict(C.gauge_max), peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    init_mesh()
    cfg = GPTConfig.preset("small" if args.quick else "27m")
    model, t_off, gauges, peak_off = run((shard_zero(3, param_persistence_threshold=0), offload("cpu", params=True)),
                                         cfg, args.device, args.steps)
    _, t_plain, _, peak_plain = run((), cfg, args.device, args.steps)
    total = sum(p.numel() * 4 for p in model.parameters())
    units = [m for _, m in find_units(model, None)]
    unit_bytes = [sum(p.numel() * 4 for p in u.parameters()) for u in units]
    root = total - sum(unit_bytes)
    live = gauges.get("zero3.live_units", 0)
    in_flight = root + live * max(unit_bytes)
    print(f"GPT {cfg.n_layer} layers d{cfg.d_model}: {total / 2**20:.1f} MiB of fp32 parameters, {len(units)} units "
          f"of {max(unit_bytes) / 2**20:.2f} MiB, root (embeddings, head) {root / 2**20:.2f} MiB")
    print(f"units in flight at peak: {live} (+ the root); weight bytes on the device at peak: "
          f"{in_flight / 2**20:.2f} MiB = {in_flight / total:.2f}x the model")
    if peak_off is not None:
        print(f"torch.cuda.max_memory_allocated: offloaded {peak_off / 2**20:.1f} MiB vs resident "
              f"{peak_plain / 2**20:.1f} MiB ({peak_off / peak_plain:.2f}x)")
    print(f"step: offloaded {t_off * 1e3:.1f} ms vs resident {t_plain * 1e3:.1f} ms ({t_off / t_plain:.2f}x) on "
          f"{args.device}")


if __name__ == "__main__":
    main()
