"""One pipeline step's machinery around `run_rank` (`dsfn.transforms.pipeline_parallel` holds
the policy): the callbacks the runner calls, the stages' hooks of the step, and what is done
with the step's results.

- `PipelineStep`: one step's state and the runner's callbacks. `forward(stage, mb, h_in)`
  runs the differentiated function on micro-batch `mb` (the model then runs stage `stage`
  alone, `running` telling the transform's forward handler which), its loss scaled by 1/m;
  `backward_scope(stage, mb, last)` is entered around each backward (a recompute then runs
  that stage on that micro-batch's received activation); `split_backward(stage, mb)` says
  whether zero-bubble's B / W split runs (not where the stage recomputes: W would recompute
  it again). `hooks_for(module, plan)` installs the stages' verbs (`StageHooks`) at the
  step's first forward of a module, kept until the step's last backward; `close` undoes them.
- `broadcast_loss`: the step's loss, from the last stage to every stage of the axis (fp32).
- `sum_tied_grads`: a parameter of several stages (a tied embedding and head) has its
  gradients summed over its owners (`dsfn.state.layout.held_copies`).
- `on_stage`: a leaf laid out on its stages (`StageOwned`, or `Nested` over a piece another
  transform placed).

Imports no transform, calls no handler.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dsfn.engines.pipeline.stages import StageHooks, StagePlan, StopForward
from dsfn.errors import ConfigError
from dsfn.functional import MicroBatch, micro_batch_begins
from dsfn.placed import Placed
from dsfn.runtime import collectives as C
from dsfn.runtime import env
from dsfn.state.layout import Nested, StageOwned, held_copies, stage_piece_shape, sum_held_copies

__all__ = ["PipelineStep", "broadcast_loss", "sum_tied_grads", "on_stage"]


class PipelineStep:
    """One step of the pipeline on this rank (module docstring). `fn(params, *args, **kwargs)`:
    the differentiated function, given `params` (the step's input leaves) and micro-batch
    `mb`'s `(args, kwargs)` = `micro[mb]`; `m`: the micro-batch count; `recomputes`: whether
    the stages' layers are recomputed in backward (remat, the model's checkpointing)."""

    def __init__(self, fn: Callable[..., Any], params: Any, micro: Sequence[tuple[Any, Any]], m: int,
                 n_stages: int, recomputes: bool):
        self.fn, self.params, self.micro, self.m, self.n_stages = fn, params, micro, m, n_stages
        self.inv = 1.0 / m
        # zero-bubble's W would recompute checkpointed layers again: a micro-batch whose stage
        # recomputes (remat, the model's checkpointing, or its own checkpoint calls seen by the
        # stage's hooks) runs its backward whole at B
        self.recomputes = recomputes
        self.recomputed: set[tuple[int, int]] = set()
        self.running: tuple[int, torch.Tensor | None, int] | None = None     # (stage, h_in, n_stages) in a forward
        # id(module) -> its StageHooks (kept until the step's last backward), and the received
        # activation of each (stage, micro-batch) whose backward is still to run
        self.hooks: dict[int, tuple[nn.Module, StageHooks]] = {}
        self.unit_hooks: dict[int, StageHooks] = {}     # id(unit module) -> the StageHooks reading its events
        self.h_in: dict[tuple[int, int], torch.Tensor | None] = {}

    def forward(self, stage: int, mb: int, h_in: torch.Tensor | None) -> torch.Tensor:
        """Micro-batch `mb` through stage `stage` (`h_in`: its received activation): the
        stage's activation, or the last stage's loss scaled by 1/m."""
        self.running = (stage, h_in, self.n_stages)
        self.h_in[(stage, mb)] = h_in
        micro_batch_begins(MicroBatch(mb, "forward", self.m, interleaved=True))
        try:
            a, k = self.micro[mb]
            out = self.fn(self.params, *a, **k)
        except StopForward as done:
            return done.value
        finally:
            self.running = None
            for _, hooks in self.hooks.values():
                if hooks.saw_checkpoint:
                    self.recomputed.add((stage, mb))
                    hooks.saw_checkpoint = False
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            raise ConfigError("pipeline_parallel: the differentiated function must return a scalar loss")
        return out.reshape(()) * self.inv

    def split_backward(self, stage: int, mb: int) -> bool:
        """Whether (stage, mb)'s backward splits into B and W (not where it recomputes)."""
        return not self.recomputes and (stage, mb) not in self.recomputed

    @contextlib.contextmanager
    def backward_scope(self, stage: int, mb: int, last: bool):
        """Around (stage, mb)'s backward: a recompute in it (activation checkpointing) runs
        stage `stage` on micro-batch `mb`'s received activation (kept for a split backward's W)."""
        h_in = self.h_in.pop((stage, mb), None) if last else self.h_in.get((stage, mb))
        micro_batch_begins(MicroBatch(mb, "backward", self.m, interleaved=True))
        with contextlib.ExitStack() as scope:
            for _, hooks in list(self.hooks.values()):
                scope.enter_context(hooks.running(stage, h_in, recompute=True))
            yield

    def hooks_for(self, module: nn.Module, plan: StagePlan) -> StageHooks:
        """`module`'s StageHooks for the rest of the step, installed at its first forward of
        this module: the layer events of the forwards and of the recomputes in backward reach
        them through the transform's "run_unit" handler (`unit_hooks`)."""
        held = self.hooks.get(id(module))
        if held is not None and held[0] is module:
            return held[1]
        hooks = StageHooks(plan)
        self.hooks[id(module)] = (module, hooks)
        for m in hooks.units():
            self.unit_hooks[id(m)] = hooks
        return hooks

    def close(self) -> None:
        """Undo every module's StageHooks (the step's end, also when it raises)."""
        for _, hooks in self.hooks.values():
            hooks.close()


def broadcast_loss(losses: Sequence[torch.Tensor], axis: str, src: int) -> torch.Tensor:
    """The step's loss (the sum of the last stage's micro-batch losses; zero elsewhere) from
    `axis`'s rank `src` to all of them. It travels in fp32 (the other stages do not know its
    dtype: bf16 under mixed precision) and comes back in it."""
    value = torch.stack(losses).sum().float() if losses else torch.zeros((), device=env.device())
    return C.broadcast_(value.detach().clone(), axis, src=src)


def sum_tied_grads(grads: list[torch.Tensor], placed: Sequence[Any]) -> list[torch.Tensor]:
    """`grads` (one per leaf of `placed`) with each parameter of several stages (tied
    embedding and head) summed over its owners, whose copies then take the same update (a
    piece split inside the stage, tensor_parallel's: the same piece on every owner, summed
    alike). Replaces those entries of `grads` in place, and returns it."""
    tied = [k for k, x in enumerate(placed) if isinstance(x, Placed) and held_copies(x.layout) is not None]
    if tied:
        summed = sum_held_copies([grads[k] for k in tied], [held_copies(placed[k].layout) for k in tied],
                                  [0 if held_copies(placed[k].layout).holds() else
                                   math.prod(stage_piece_shape(placed[k].layout)) for k in tied])
        for k, g in zip(tied, summed):
            grads[k] = g
    return grads


def on_stage(x: Any, owned: StageOwned) -> Placed:
    """Leaf `x` laid out on its stages: a whole tensor as `owned`; a piece another transform
    inside placed (tensor_parallel's DimShard of the logical tensor) as `Nested(owned, its
    layout)`: the owners keep their piece, the other stages hold an empty one."""
    if isinstance(x, Placed):
        piece = x.data if owned.holds() else x.data.new_empty((0,))
        return Placed(piece, Nested(owned, x.layout))
    return Placed(owned.shard(x), owned)
