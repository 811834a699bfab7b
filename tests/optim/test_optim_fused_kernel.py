"""`dsfn.optim.adamw` runs the Triton AdamW kernel where dispatch picks Triton (here forced
with DSFN_KERNELS=triton under the interpreter) and trains exactly as the foreach path
(to an ulp: the kernel's sqrt/div are correctly rounded, torch's CPU sqrt is not)."""
import torch

import dsfn
from dsfn import tree
from dsfn.ops import adamw as adamw_kernel
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import train_step_for


def _train(n_steps):
    apply_fn, params = dsfn.functionalize(make_mlp([5, 7, 3], 0))
    sched = dsfn.optim.WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=3)
    step = dsfn.compose()(train_step_for(apply_fn))
    state = step.init_state(params, dsfn.optim.adamw(lr=sched, weight_decay=0.1))
    losses = []
    for b in regression_batches(n_steps, 8, 5, 3, seed=4):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


class _LaunchCounter:
    """Stands in for a Triton kernel object: counts `kernel[grid](...)` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_adamw_uses_the_fused_kernel_when_dispatch_picks_triton(monkeypatch):
    """One multi-tensor launch per step for all 4 leaves (was one per leaf), same training."""
    ref_state, ref_losses = _train(5)
    multi = _LaunchCounter(adamw_kernel._adamw_multi_kernel)
    single = _LaunchCounter(adamw_kernel._adamw_kernel)
    monkeypatch.setattr(adamw_kernel, "_adamw_multi_kernel", multi)
    monkeypatch.setattr(adamw_kernel, "_adamw_kernel", single)
    monkeypatch.setenv("DSFN_KERNELS", "triton")
    state, losses = _train(5)
    assert (multi.launches, single.launches) == (5, 0)     # every step, one launch for every leaf
    assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    for (p, a), (_, b) in zip(tree.leaves_with_path(state.replace(tx=None)),
                              tree.leaves_with_path(ref_state.replace(tx=None))):
        assert torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-8), p


def test_cpu_default_keeps_the_foreach_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the Triton kernel must not run on CPU by default")
    monkeypatch.setattr(adamw_kernel, "adamw_update_triton", boom)
    monkeypatch.setattr(adamw_kernel, "_adamw_multi_kernel", boom)
    monkeypatch.delenv("DSFN_KERNELS", raising=False)
    _train(2)
