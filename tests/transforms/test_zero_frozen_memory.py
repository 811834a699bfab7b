"""Once `shard_zero(3)` has placed a frozen base as shards, no full copy of it is left: the
tensors `functionalize` put in `apply_fn.constants` are collected, the module's frozen
parameters are empty, and after a step a rank holds base/N of it and nothing of ZeRO-3's
gather buffers (each unit's storages are kept across steps but resized to 0 bytes while
no gather of the unit is in use).

Measured as the bytes of every distinct storage reachable from a live Python tensor
(`gc.get_objects`). Negative controls: a stand-in for the old placement that leaves the
full tensors referenced (by the apply_fn and the module) goes over the bound, and under
stage 2 (frozen base replicated) the original tensors stay alive.
"""
from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import dsfn
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.transforms import compose, shard_zero

MIB = 2**20
LAYERS, D_IN, D_OUT = 4, 1024, 512            # 4 frozen units of 2 MiB: an 8 MiB base


class FrozenBase(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(D_IN, D_OUT, bias=False) for _ in range(LAYERS))
        self.layers.requires_grad_(False)
        self.head = nn.Linear(D_OUT, 4)              # the small trainable part

    def forward(self, x):
        return self.head(sum(torch.tanh(layer(x)) for layer in self.layers))


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of all live Python tensors in this process."""
    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor) or o.is_meta:
            continue
        try:
            s = o.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
        except (RuntimeError, NotImplementedError):
            continue         # no data of its own: fake/functional tensors a compile (earlier test, forked) left
        if nbytes and ptr not in seen:
            seen.add(ptr)
            total += nbytes
    return total


def run(stage: int, keep_full: bool = False):
    # what the forked rank inherited from the test process (earlier tests' tensors) is not
    # this run's: counted here and subtracted
    inherited = live_tensor_bytes()
    init_mesh(dp=2)
    if keep_full:          # the old placement: pieces stored, the full tensors still referenced
        from dsfn.state import init as zero       # place_frozen stores through it
        real = zero.store_constants

        def holding(apply_fn, placed):
            apply_fn._full = {n: apply_fn.constants[n] for n in placed}
            apply_fn.module._full = [p.data for p in apply_fn.module.parameters() if not p.requires_grad]
            real(apply_fn, placed)
        zero.store_constants = holding
    model = FrozenBase()
    apply_fn, params = dsfn.functionalize(model, release=True)
    originals = [weakref.ref(apply_fn.constants[n]) for n in apply_fn.frozen]
    base = sum(apply_fn.constants[n].numel() * 4 for n in apply_fn.frozen)

    def train_step(state, batch):
        loss = lambda p, b: ((apply_fn(p, b["x"]) - b["y"]) ** 2).mean()
        value, grads = dsfn.value_and_grad(loss)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(shard_zero(stage, **({"prefetch": 0} if stage == 3 else {})))(train_step)   # (prefetch: stage 3 only)
    state = step.init_state(params, dsfn.optim.sgd(0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(4, D_IN, generator=g), "y": torch.randn(4, 4, generator=g)}
    before = live_tensor_bytes() - inherited
    state, _ = step(state, batch)
    state, _ = step(state, batch)
    return dict(base=base, before=before, after=live_tensor_bytes() - inherited,
                alive=sum(r() is not None for r in originals),
                module=sum(p.numel() for p in model.parameters() if not p.requires_grad))


def _bound(base: int) -> int:
    # base/N + the small rest (head, its gradient and momentum, the batch); no gather buffer
    # holds memory between steps
    return base // 2 + MIB // 4


def test_sharded_frozen_base_leaves_no_full_copy():
    for r in run_on_ranks(run, 2, 3, timeout=120):
        assert r["base"] == 8 * MIB
        assert r["alive"] == 0 and r["module"] == 0, r
        assert r["after"] <= _bound(r["base"]), (r["after"] / MIB, _bound(r["base"]) / MIB)


def test_negative_control_full_tensors_still_referenced_exceed_the_bound():
    for r in run_on_ranks(run, 2, 3, True, timeout=120):
        assert r["alive"] == LAYERS
        assert r["after"] > _bound(r["base"]) + 7 * MIB, r["after"] / MIB


def test_negative_control_stage2_keeps_the_base_whole():
    for r in run_on_ranks(run, 2, 2, timeout=120):
        assert r["alive"] == LAYERS and r["module"] == r["base"] // 4, r
        assert r["after"] > _bound(r["base"]), r["after"] / MIB
