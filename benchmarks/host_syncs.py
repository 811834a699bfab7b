"""Host syncs per training step, counted on any machine (the `meta` device stands in for the GPU).

    python benchmarks/host_syncs.py            # ~1 min on 2 CPU cores

For each stack, one step of the example GPT with 2 and with 6 layers (29 vs 77 parameter
tensors) runs on meta under `dsfn.runtime.syncs.count_host_syncs()`; dispatch is told that
meta tensors take the fused (Triton on CUDA) AdamW path, whose kernel is replaced by the torch
reference (the same argument preparation). Baseline, measured in the same run for the AdamW
stacks: the code before issue 16 patched back in (the host lr and step copied to the device by
each leaf's kernel call, blocking; the loss scale's overflow test reading one bool per
gradient). Muon and offload have no baseline here ("-"). Prints syncs per step and the ratio
to the baseline; on a GPU `benchmarks/gpu_e2e.py` counts them on CUDA.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn.testing.syncs import later_step_syncs, meta_runs_kernels, patched, per_leaf_adamw  # noqa: E402
from dsfn.transforms import clip_grad_norm, loss_scale, mixed_precision, offload, shard_zero  # noqa: E402

STACKS = {
    "zero3+bf16 adamw": (lambda: [shard_zero(3), mixed_precision(torch.bfloat16)], "adamw"),
    "zero3+bf16+clip adamw": (lambda: [shard_zero(3), mixed_precision(torch.bfloat16), clip_grad_norm(1.0)], "adamw"),
    "zero2+fp16+loss_scale+clip": (lambda: [shard_zero(2), mixed_precision(torch.float16), loss_scale(),
                                            clip_grad_norm(1.0)], "adamw"),
    "zero3+offload(cpu)": (lambda: [shard_zero(3), offload("cpu")], "adamw"),
    "zero3+bf16 muon": (lambda: [shard_zero(3), mixed_precision(torch.bfloat16)], "muon"),
}


def _tx(kind: str):
    if kind == "muon":
        return dsfn.optim.muon(lr=0.02)
    import train_gpt
    return train_gpt.make_optimizer(1e-3, warmup=2, steps=100, weight_decay=0.1)


def syncs_per_step(n_layer: int, stack, kind: str) -> int:
    return later_step_syncs(n_layer, stack, _tx(kind)).total


def _old_preparation():
    """The pre-fix optimizer preparation: per-leaf blocking copies of the host lr and step."""
    stack = contextlib.ExitStack()
    stack.enter_context(per_leaf_adamw())

    def old_overflow(grads):
        # the old test read one bool per gradient; on a finite step it reads them all. Meta reads
        # are fake (False), so the reads are made and a finite step is reported
        leaves = [t for t in dsfn.tree.leaves(grads) if t.numel()]
        [bool(torch.isfinite(n)) for n in torch._foreach_norm(leaves, float("inf"))]
        return False
    LS = sys.modules["dsfn.transforms.loss_scale"]       # (the package attribute is the function)
    stack.enter_context(patched(LS, "any_nonfinite_everywhere", old_overflow))
    return stack


def main() -> None:
    with meta_runs_kernels():
        print("host syncs per step on the example GPT (meta standing in for CUDA), 2 vs 6 layers:")
        print(f"  {'stack':30s} {'2 layers':>9s} {'6 layers':>9s}   baseline (before) 2 / 6   ratio at 6 layers")
        for name, (stack, kind) in STACKS.items():
            now = [syncs_per_step(n, stack, kind) for n in (2, 6)]
            if kind == "adamw" and "offload" not in name:
                with _old_preparation():
                    base = [syncs_per_step(n, stack, kind) for n in (2, 6)]
                ratio = f"{now[1] / base[1]:.3f}" if base[1] else "n/a"
                was = f"{base[0]:6d} / {base[1]:<6d}"
            else:
                ratio, was = "-", f"{'-':>6s} / {'-':<6s}"
            print(f"  {name:30s} {now[0]:9d} {now[1]:9d}   {was}        {ratio}", flush=True)


if __name__ == "__main__":
    main()
