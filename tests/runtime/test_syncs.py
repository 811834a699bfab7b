"""dsfn.runtime.syncs: the host-sync counter, and the optimizer path's sync budget.

The `meta` device stands in for the GPU (see the module docstring of dsfn.runtime.syncs):
a step run on meta takes the code paths it takes on CUDA, and the counter sees every read
of a device value, blocking copy and data-dependent shape. For the fused AdamW path
(Triton on CUDA) dispatch is told that meta tensors run "kernels", and the kernel is the
torch reference, which shares the kernel's argument preparation (lr/step/coefficients).
"""
from __future__ import annotations


import pytest
import torch

import dsfn
from dsfn import tree
from dsfn.runtime.syncs import count_host_syncs
from dsfn.testing.syncs import later_step_syncs, per_leaf_adamw
from dsfn.testing.syncs import meta_runs_kernels as meta_kernels
from dsfn.transforms import clip_grad_norm, loss_scale, mixed_precision, offload, shard_zero


# ----------------------------------------------------------------------------------------------
# the counter
# ----------------------------------------------------------------------------------------------

def test_counts_scalar_reads_of_device_tensors_not_host_ones():
    d = torch.ones(3, device="meta")
    h = torch.ones(3)
    with count_host_syncs() as s:
        assert d.sum().item() == 0.0          # meta reads give zeros (fake values, counted)
        bool(d[0] > 0)
        float(h.sum())                        # a host value: no device to wait for
        h.tolist()
    assert s.by_kind == {"item": 2} and s.total == 2


def test_counts_blocking_copies_both_ways_and_not_non_blocking_ones():
    d = torch.ones(3, device="meta")
    with count_host_syncs() as s:
        d.cpu()
        d.tolist()
        torch.ones(2).to("meta")
        torch.tensor(1.0, device="meta")
        torch.ones(2).to("meta", non_blocking=True)
        torch.full((), 1.0, device="meta")
        torch.empty(3).copy_(d, non_blocking=True)
    assert s.by_kind == {"d2h": 2, "h2d": 2}


def test_counts_data_dependent_shapes_and_synchronize(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)   # no CUDA here: count only
    d = torch.ones(3, device="meta")
    with count_host_syncs() as s:
        d.nonzero()
        torch.cuda.synchronize()
    assert s.by_kind == {"data_dependent": 1, "synchronize": 1}
    torch.cuda.synchronize()                # restored: counted no more
    assert s.total == 2


def test_cpu_as_device_counts_host_reads():
    with count_host_syncs(devices=("cpu",)) as s:
        torch.ones(2).sum().item()
    assert s.by_kind == {"item": 1}


# ----------------------------------------------------------------------------------------------
# the optimizer path: O(1) syncs per step, not one per parameter tensor
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def meta_runs_kernels():
    """Dispatch picks the fused AdamW path for meta tensors, as it does for CUDA ones."""
    with meta_kernels():
        yield


def _example_optimizer(clip: bool = True):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import train_gpt
    return train_gpt.make_optimizer(1e-3, warmup=2, steps=100, weight_decay=0.1, clip=clip)


def _syncs_per_step(n_layer: int, stack, tx=None) -> tuple[int, list]:
    s = later_step_syncs(n_layer, stack, tx or _example_optimizer())
    return s.total, s.events


STACKS = {
    "zero3+bf16": lambda: [shard_zero(3), mixed_precision(torch.bfloat16)],
    "zero3+bf16+clip": lambda: [shard_zero(3), mixed_precision(torch.bfloat16), clip_grad_norm(1.0)],
    "zero2+fp16+loss_scale+clip": lambda: [shard_zero(2), mixed_precision(torch.float16), loss_scale(),
                                           clip_grad_norm(1.0)],
    "zero3+offload": lambda: [shard_zero(3), offload("cpu")],
}


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_syncs_per_step_are_few_and_do_not_grow_with_the_model(meta_runs_kernels, stack):
    small, ev_small = _syncs_per_step(2, STACKS[stack])
    large, ev_large = _syncs_per_step(6, STACKS[stack])
    assert small <= 3, ev_small
    assert large == small, (ev_small, ev_large)


def test_control_per_tensor_lr_copies_are_counted(meta_runs_kernels):
    """The control: the old preparation (the host lr and step copied to the device by every
    leaf's kernel call, one launch per leaf) is seen as syncs that grow with the number of
    parameter tensors."""
    with per_leaf_adamw():
        small, _ = _syncs_per_step(2, STACKS["zero3+bf16"])
        large, _ = _syncs_per_step(6, STACKS["zero3+bf16"])
    assert large > small > 3


def test_muon_step_syncs_are_few_and_do_not_grow(meta_runs_kernels):
    stack = lambda: [shard_zero(3), mixed_precision(torch.bfloat16)]      # noqa: E731
    small, ev = _syncs_per_step(2, stack, tx=dsfn.optim.muon(lr=0.02))
    large, _ = _syncs_per_step(6, stack, tx=dsfn.optim.muon(lr=0.02))
    assert small <= 3 and large == small, ev


def test_control_per_gradient_overflow_and_norm_reads_are_counted(meta_runs_kernels, monkeypatch):
    """The control for loss scaling and clipping: the old overflow test (a bool per gradient)
    and the old global norm (each leaf's part read on the host) grow with the tensors."""
    import sys
    LS = sys.modules["dsfn.transforms.loss_scale"]
    CL = sys.modules["dsfn.transforms.clip"]

    def old_overflow(grads):
        leaves = [t for t in tree.leaves(grads) if t.numel()]
        [bool(torch.isfinite(n)) for n in torch._foreach_norm(leaves, float("inf"))]     # all read: a finite step
        return False

    def old_sq_norm(grads):
        xs = [t for t in tree.leaves(grads) if t.numel()]
        return torch.stack([n.double().square().cpu() for n in torch._foreach_norm(xs, 2)]).sum()
    monkeypatch.setattr(LS, "any_nonfinite_everywhere", old_overflow)
    monkeypatch.setattr(CL, "global_sq_norm", old_sq_norm)
    small, _ = _syncs_per_step(2, STACKS["zero2+fp16+loss_scale+clip"])
    large, _ = _syncs_per_step(6, STACKS["zero2+fp16+loss_scale+clip"])
    assert large > small > 3
