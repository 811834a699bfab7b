"""Host work per training step, counted on CPU: aten ops, Triton launches, meta-device time.

    python benchmarks/op_count.py            # HF Llama (4 layers, d128), ~1 min
    python benchmarks/op_count.py --quick    # 2 layers, fewer repeats (smoke test)

dsfn is host-bound on a GPU when its step issues more kernels than the GPU needs
(../shared/reference/gpu_measured.md). These are the CPU proxies of that, on the same small
Hugging Face Llama trained by plain torch (autocast bf16 + `torch.optim.AdamW`, fused and
foreach) and by dsfn stacks (`mixed_precision()` + `dsfn.optim.adamw`):

1. aten ops dispatched per step (`dsfn.testing.opcount.OpCounter`, a TorchDispatchMode),
   all of them and the "computing" ones (those that launch a kernel on a GPU: views and
   metadata excluded), with CPU kernels (dsfn's foreach path) and with the GPU's choice
   forced (`DSFN_KERNELS=triton` under Triton's interpreter: the grouped AdamW and casts;
   the launches of dsfn's Triton kernels are counted besides).
3. Python calls per step of ZeRO-3 at world 2 (`dsfn.testing.opcount.python_calls`), with 9
   and 16 tensors per layer: its gather / release / reduce-scatter machinery (per unit: the
   same count for both), and all of dsfn (the step boundary's per-leaf tree work grows).
2. host time of one step on the `meta` device (no compute, no data: all of it is Python and
   dispatch overhead), torch (fp32, foreach AdamW: autocast and the fused kernel do not run
   on meta) against dsfn (fp32 and bf16) with the GPU's kernel choices emulated
   (`dsfn.testing.syncs.meta_runs_kernels`). Median of repeated steps, after warm-up.

Ratios are dsfn / torch in the same run. tests/test_hot_path.py pins (1) so a regression
fails CI.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _stacks(donate_too: bool = True):
    from dsfn.transforms import data_parallel, mixed_precision, shard_zero
    out = [("dsfn dp+mp", [data_parallel(), mixed_precision()], False),
           ("dsfn zero3+mp", [shard_zero(3), mixed_precision()], False)]
    if donate_too:
        out += [("dsfn dp+mp donate", [data_parallel(), mixed_precision()], True),
                ("dsfn zero3+mp donate", [shard_zero(3), mixed_precision()], True)]
    return out


def count_table(layers: int) -> list[tuple[str, int, int, int]]:
    """(name, total ops, computing ops, Triton launches) per step, world 1."""
    from dsfn.testing import opcount as O
    b = O.count_batch()
    rows = []
    for name, fused in (("torch fused", True), ("torch foreach", False)):
        ops, launches, _ = O.count_step(O.torch_step(O.llama_for_counts(num_hidden_layers=layers), fused=fused),
                                        None, b)
        rows.append((name, ops.total, ops.computing, launches.total))
    for name, stack, donate in _stacks():
        step, state = O.dsfn_step(O.llama_for_counts(num_hidden_layers=layers), stack, donate=donate)
        ops, launches, _ = O.count_step(step, state, b)
        rows.append((name, ops.total, ops.computing, launches.total))
    return rows


def meta_times(layers: int, repeats: int) -> list[tuple[str, float]]:
    """(name, median host ms per step on meta)."""
    import torch

    from dsfn.testing import opcount as O
    from dsfn.testing.syncs import meta_runs_kernels
    from dsfn.transforms import data_parallel, mixed_precision, shard_zero
    b = O.count_batch(device="meta")
    out = []

    def timed(step, state):
        for _ in range(2):
            state, _ = step(state, b)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state, _ = step(state, b)
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)
    m = O.llama_for_counts(device="meta", num_hidden_layers=layers)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    def torch_step(state, batch):
        m(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return state, None
    out.append(("torch fp32 foreach", timed(torch_step, None)))
    with meta_runs_kernels():
        for name, stack in (("dsfn dp fp32", [data_parallel()]), ("dsfn dp+mp", [data_parallel(), mixed_precision()]),
                            ("dsfn zero3+mp", [shard_zero(3), mixed_precision()])):
            step, state = O.dsfn_step(O.llama_for_counts(device="meta", num_hidden_layers=layers), stack,
                                      donate=True)
            out.append((name + " donate", timed(step, state)))
    return out


def _python_calls_rank() -> None:
    import torch

    import dsfn
    from dsfn.runtime import init_mesh
    from dsfn.testing import opcount as O
    init_mesh(dp=2)
    torch.set_num_threads(1)
    rows = []
    for bias in (False, True):       # 9 or 16 tensors per decoder layer
        n, calls = O.zero3_step_calls(bias, {"zero3": O.zero3_machinery(), "all": O.in_dsfn}, layers=16,
                                      hidden=64)
        rows.append((n, sum(calls["zero3"].values()), sum(calls["all"].values()), calls["all"]))
    if dsfn.runtime.rank() == 0:
        for tensors, z3, total, calls in rows:
            print(f"  {tensors:4d} tensors: ZeRO-3 gather/release/reduce-scatter {z3:6d}   all of dsfn {total:6d}  "
                  f"(most: {', '.join(f'{k} {v}' for k, v in calls.most_common(4))})")


def python_calls() -> None:
    """ZeRO-3 + mixed precision at world 2 (gloo), HF Llama 16 layers with 9 and 16 tensors per
    layer: Python calls per step (generator resumptions excluded) into ZeRO-3's stage-3
    machinery and into all of dsfn."""
    from dsfn.launch import spawn
    spawn(_python_calls_rank, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--section", choices=["counts", "meta", "pycalls"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    layers = a.layers or (2 if a.quick else 4)
    if a.section == "counts":
        rows = count_table(layers)
        base_t, base_c = rows[0][1], rows[0][2]
        for name, total, comp, launches in rows:
            print(f"  {name:24s} {total:6d} {total / base_t:6.3f}x {comp:9d} {(comp + launches) / base_c:6.3f}x "
                  f"{launches:8d}")
        return
    if a.section == "pycalls":
        python_calls()
        return
    if a.section == "meta":
        rows = meta_times(layers, 5 if a.quick else 20)
        for name, ms in rows:
            print(f"  {name:28s} {ms:8.2f} ms  {ms / rows[0][1]:6.3f}x")
        return
    print(f"HF Llama, {layers} layers, hidden 128, batch 2 x 32, AdamW; world 1; per step after 2 warm-up steps")
    header = f"  {'':24s} {'aten ops':>6s} {'vs torch fused':>7s} {'computing':>9s} {'+launches vs torch':>7s} {'launches':>8s}"
    for label, env in (("CPU kernels (dsfn: foreach AdamW, Tensor.to casts)", {}),
                       ("GPU kernel choice (DSFN_KERNELS=triton, Triton interpreter)",
                        {"DSFN_KERNELS": "triton", "TRITON_INTERPRET": "1"})):
        print(f"\n{label}:\n{header}", flush=True)
        subprocess.run([sys.executable, __file__, "--section", "counts", "--layers", str(layers)],
                       env={**os.environ, **env}, check=True)
    print("\nhost time of one step on the meta device (no compute; GPU kernel choices emulated for dsfn):", flush=True)
    subprocess.run([sys.executable, __file__, "--section", "meta", "--layers", str(layers)]
                   + (["--quick"] if a.quick else []), check=True)
    if not a.quick:
        print("\nPython calls per step, ZeRO-3 + mixed precision at world 2 (gloo), HF Llama 16 layers d64:", flush=True)
        subprocess.run([sys.executable, __file__, "--section", "pycalls"], check=True)


if __name__ == "__main__":
    main()
