"""Probe: data-dependent collectives (MoE-style routing) under NCCL, against the single process.

    torchrun --nproc-per-node N benchmarks/gpu_nccl_probe.py    # N GPUs (benchmarks/gpu_checks.sh: min(GPUs, 2))
    python benchmarks/gpu_nccl_probe.py --dry-run                # 2 gloo ranks on CPU (dsfn.launch.spawn)

The model routes each row to one of two experts by the sign of its first feature and skips
an expert no row reached (`dsfn.testing.models.Routed`); the batches put dp rank 0's rows on
expert 0 and rank 1's on expert 1, so the ranks touch different parameters and ZeRO must
still issue the same collectives on every rank (a mismatch hangs NCCL: run this under a
timeout). For data_parallel, ZeRO-2 and ZeRO-3 (experts in the root and as units), 3
SGD-momentum steps on the device must give the single-process CPU run's parameters (fp32,
rtol 1e-5, TF32 off). With one GPU the world is 1 (NCCL refuses two ranks on one GPU): the
NCCL group, device placement and the steps are exercised, the cross-rank routing is not.
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

import dsfn  # noqa: E402
from dsfn.testing.models import Routed, routed_batches  # noqa: E402
from dsfn.testing.reference import train_step_for  # noqa: E402
from dsfn.transforms import data_parallel, shard_zero  # noqa: E402

STACKS = {"data_parallel": lambda: [data_parallel()], "zero2": lambda: [shard_zero(2)],
          "zero3": lambda: [shard_zero(3)]}


def _run(make_transforms, in_list: bool, device: torch.device, batches: list[dict]) -> dict[str, torch.Tensor]:
    apply_fn, params = dsfn.functionalize(Routed(in_list, seed=1).to(device))
    step = dsfn.compose(*make_transforms())(train_step_for(apply_fn))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.2, momentum=0.9)))
    for b in batches:
        state, _ = step(state, {k: v.to(device) for k, v in b.items()})
    return {k: v.detach().cpu() for k, v in step.gather(state).params.items()}


def probe(device: torch.device | None = None) -> list[tuple[str, bool, str]]:
    """Every stack on this rank; returns (name, ok, detail) rows (the same on every rank)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dsfn.runtime.env.ensure_distributed()
    device = device or dsfn.runtime.device()
    batches = routed_batches(3, 8)
    rows = []
    for in_list in (False, True):
        ref = _run(lambda: [], in_list, torch.device("cpu"), batches)       # one process, the whole batch
        for name, make in STACKS.items():
            t0 = time.perf_counter()
            got = _run(make, in_list, device, batches)
            worst = max(float(((got[k] - ref[k]).abs() / ref[k].abs().clamp(min=1e-6)).max()) for k in ref)
            ok = all(torch.allclose(got[k], ref[k], rtol=1e-5, atol=1e-6) for k in ref)
            rows.append((f"{name} ({'experts as units' if in_list else 'experts in the root'})", ok,
                         f"max rel diff {worst:.1e}, {time.perf_counter() - t0:.2f}s"))
    return rows


def _print(rows, world: int, backend: str) -> bool:
    print(f"== NCCL probe: data-dependent routing, world {world}, backend {backend}", flush=True)
    for name, ok, detail in rows:
        print(f"  {name:40s} {'PASS' if ok else 'FAIL'}  {detail}", flush=True)
    if world < 2:
        print("  note: world 1 (one GPU): the ranks' different routing is not exercised; it needs 2 GPUs")
    return all(ok for _, ok, _ in rows)


def _dry_rank() -> list:
    return probe(torch.device("cpu"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="2 gloo ranks on CPU instead of the launcher's ranks")
    a = ap.parse_args()
    if a.dry_run:
        from dsfn.launch import spawn
        rows = spawn(_dry_rank, 2, timeout=300)[0]
        return 0 if _print(rows, 2, "gloo") else 1
    rows = probe()
    ok = True
    if dsfn.runtime.rank() == 0:
        ok = _print(rows, dsfn.runtime.world_size(), dsfn.runtime.env.backend_in_use() or "none")
    dsfn.runtime.env.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
