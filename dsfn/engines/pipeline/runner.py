"""Running one rank's part of a pipeline schedule: its actions in order, with the
activations and their gradients sent between the stages' ranks.

The schedule (`dsfn.engines.pipeline.schedules`) lists, per rank, F (forward), BW (full
backward) or B / W (zero-bubble's split backward) actions of (stage, micro-batch).
`run_rank(actions, ...)` executes them with the caller's `forward(stage, mb, h_in)` and
autograd:

- F(s, j): receives stage s-1's activation for micro-batch j (s > 0; a leaf that requires
  grad), runs `forward` — the activation of stage s (s < last, sent on asynchronously) or
  the micro-batch's (scaled) loss (the last stage);
- BW(s, j): receives the gradient of stage s's activation from stage s+1 (s < last),
  back-propagates it (the loss itself on the last stage) into the parameters' `.grad` and
  the received activation's, and sends that on to stage s-1 (s > 0);
- B(s, j) (zero-bubble's split, `dsfn.engines.pipeline.split_backward`): receives the same gradient
  and back-propagates it to the received activation alone — the weight branches of the
  graph do not run — keeping the gradients that arrive where they leave the input's path,
  and sends the activation's gradient on to stage s-1 as BW does. On the first stage (no
  received activation) B computes nothing: no stage waits for it;
- W(s, j): the weight gradients of (s, j) from what its B kept, accumulated into the
  weights' `.grad` by autograd as the whole backward does; the stage's graph for (s, j) is
  freed after it. B + W do about one backward's work (each node's input and weight
  branches run once each). `run_rank(..., weights=...)` names the weights (the leaves the
  forwards use); a schedule with B and W needs them.

Transfers are point-to-point through torch.distributed on the pipeline axis's ranks, with
a tag unique to (stage, micro-batch, direction), so a rank holding several stages
(interleaved, ZBV) matches each receive with its send whatever the order. Micro-batch 0's
activation on each boundary is preceded by a small int64 header (its dims and dtype); the
other micro-batches' activations (the same shape: equal micro-batches) and every gradient
(shaped as the activation its receiver holds) travel bare, one message each. Sends are
asynchronous and waited for at the end. Receives are posted ahead (`irecv`): a gradient's
as soon as its forward has run, micro-batch j+1's activation once j's has arrived, so that
the data is there when the action comes, instead of a blocking receive that starts the
transfer only then (gloo's sender waits for the receive to be posted); a receive is waited
for right before its action (the schedule's checker proves this order finishes). Imports
no transform.

Timeline. Given a list (`run_rank(..., timeline=records)`), one `Slot(action, start, end)`
(`dsfn.engines.pipeline.schedules.Slot`; `.kind`, `.stage`, `.mb` name its action) is
appended per action, in the rank's order: `time.perf_counter()` (CLOCK_MONOTONIC on Linux,
one clock for every process of the machine) around the action's compute — the forward, or
the backward — excluding the time blocked in its receive (idle time, the bubble) and the
posting of its asynchronous send; B and W each record their own compute (on the first
stage B computes nothing and lasts ~0). Without a list nothing is timed.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsfn.engines.pipeline.schedules import Action, Kind, Slot
from dsfn.engines.pipeline.split_backward import WeightGrad, WeightIndex, backward_input
from dsfn.errors import ConfigError
from dsfn.runtime import collectives as C

__all__ = ["StageLinks", "run_rank"]

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_HEADER = 8


class StageLinks:
    """Point-to-point transfers between the stages' ranks. `rank_of[s]`: the global rank
    holding stage s; `m`: micro-batches (for the tags).

    What travels (module docstring): a forward activation of micro-batch 0 carries a
    header (its dims and dtype) before it; the other micro-batches' activations on that
    boundary must have the same shape and dtype (the micro-batches are equal slices; a
    different one is a ConfigError on the sending rank) and travel bare, the receiver
    using micro-batch 0's header. A gradient travels bare: its receiver holds the
    activation it is the gradient of (`like`). `post` starts a receive ahead of time
    (`dist.irecv` into a buffer of the known shape), so the data lands while this rank
    computes; `recv` then only waits for it."""

    def __init__(self, rank_of: Sequence[int], m: int, device: torch.device, axis: str = "pp"):
        self.rank_of, self.m, self.device, self.axis = list(rank_of), m, device, axis
        self.boundary_bytes: dict[tuple[int, int], int] = {}     # (from stage, to stage) -> bytes sent
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.me = dist.get_rank() if dist.is_initialized() else 0
        self.local: dict[int, torch.Tensor] = {}      # tag -> a tensor this rank sent itself (ZBV's turn)
        self.shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}   # receiving stage -> mb 0's activation
        self.sent_shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.posted: dict[int, tuple[Any, torch.Tensor]] = {}     # tag -> (irecv work, its buffer)

    def _tag(self, stage: int, mb: int, backward: bool) -> int:
        return (stage * self.m + mb) * 2 + int(backward)

    def send(self, t: torch.Tensor, to_stage: int, stage: int, mb: int, backward: bool) -> None:
        t = t.detach().contiguous()
        if t.dtype not in _DTYPES or t.dim() > _HEADER - 2:
            raise ConfigError(f"pipeline_parallel: a stage boundary carries a {t.dtype} tensor of {t.dim()} dims; "
                              f"supported: {[str(d) for d in _DTYPES]}, up to {_HEADER - 2} dims")
        dst, tag = self.rank_of[to_stage], self._tag(stage, mb, backward)
        edge = (to_stage + 1, to_stage) if backward else (to_stage - 1, to_stage)
        self.boundary_bytes[edge] = self.boundary_bytes.get(edge, 0) + t.numel() * t.element_size()
        if dst == self.me:            # both stages on this rank: no transfer
            self.local[tag] = t.clone()
            return
        out = [t]
        if not backward:
            if mb == 0:
                self.sent_shapes[stage] = (tuple(t.shape), t.dtype)
                header = torch.zeros(_HEADER, dtype=torch.int64)
                header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
                header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
                out = [header.to(self.device), t]
            elif self.sent_shapes.get(stage) != (tuple(t.shape), t.dtype):
                raise ConfigError(f"pipeline_parallel: micro-batch {mb}'s activation into stage {stage} is "
                                  f"{tuple(t.shape)} {t.dtype}, micro-batch 0's was {self.sent_shapes.get(stage)}: "
                                  "a stage boundary carries one shape for every micro-batch (cut the batch into "
                                  "equal micro-batches; a stage's output shape must not depend on the data)")
        for x in out:
            self.pending.append((dist.isend(x, dst, tag=tag), x))
        C.counters.record(self.axis, "send", t.numel() * t.element_size(), None, dst)

    def _known(self, stage: int, mb: int, backward: bool, like: torch.Tensor | None
               ) -> tuple[tuple[int, ...], torch.dtype] | None:
        if backward:
            return (tuple(like.shape), like.dtype) if like is not None else None
        return self.shapes.get(stage) if mb > 0 else None

    def post(self, from_stage: int, stage: int, mb: int, backward: bool, like: torch.Tensor | None = None) -> None:
        """Start receiving (from_stage -> stage, mb, direction) now, when it comes from
        another rank: micro-batch 0's forward header, or a payload whose shape is known
        (a gradient shaped as `like`, a later micro-batch's activation). Else nothing."""
        src, tag = self.rank_of[from_stage], self._tag(stage, mb, backward)
        if src == self.me or tag in self.posted or mb >= self.m:
            return
        known = self._known(stage, mb, backward, like)
        if known is None and (backward or mb > 0):
            return
        buf = (torch.empty(_HEADER, dtype=torch.int64, device=self.device) if known is None
               else torch.empty(known[0], dtype=known[1], device=self.device))
        self.posted[tag] = (dist.irecv(buf, src, tag=tag), buf)

    def recv(self, from_stage: int, stage: int, mb: int, backward: bool,
             like: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor (from_stage -> stage, mb, direction); `like`: for a gradient, the
        activation it is the gradient of (its shape and dtype)."""
        src, tag = self.rank_of[from_stage], self._tag(stage, mb, backward)
        if src == self.me:
            return self.local.pop(tag)
        if backward and like is None:
            raise ConfigError("StageLinks.recv of a gradient needs like= (the activation it is the gradient of)")
        hit = self.posted.pop(tag, None)
        if hit is not None:
            hit[0].wait()
            if backward or mb > 0:
                return hit[1]
            header = hit[1]
        elif backward or mb > 0:
            known = self._known(stage, mb, backward, like)
            if known is None:
                raise ConfigError(f"StageLinks: micro-batch {mb}'s activation into stage {stage} is received before "
                                  "micro-batch 0's, whose header gives the shape: run each stage's forwards in "
                                  "micro-batch order")
            out = torch.empty(known[0], dtype=known[1], device=self.device)
            dist.recv(out, src, tag=tag)
            return out
        else:
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src, tag=tag)
        header = header.cpu()
        ndim, dtype = int(header[0]), _DTYPES[int(header[1])]
        self.shapes[stage] = (tuple(int(d) for d in header[2:2 + ndim]), dtype)
        out = torch.empty(self.shapes[stage][0], dtype=dtype, device=self.device)
        dist.recv(out, src, tag=tag)
        return out

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        if self.posted:
            raise ConfigError(f"StageLinks: {len(self.posted)} receive(s) posted and never used (tags "
                              f"{sorted(self.posted)}): every posted (stage, micro-batch) must be received")


class _RankRun:
    """One rank's run of its actions (`run_rank`): what it holds between them — each
    forward's received activation and output until its backward, what each B keeps for its
    W, the last stage's losses — and one method per action kind."""

    def __init__(self, n_stages: int, links: StageLinks,
                 forward: Callable[[int, int, torch.Tensor | None], torch.Tensor], timeline: list | None,
                 index: WeightIndex | None, backward_scope: Callable[[int, int, bool], Any] | None,
                 split_backward: Callable[[int, int], bool] | None):
        self.links, self.forward_fn, self.timeline, self.index = links, forward, timeline, index
        self.backward_scope, self.split_backward = backward_scope, split_backward
        self.whole_at_b: set[tuple[int, int]] = set()          # B ran the whole backward: W has nothing to do
        self.held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.pending: dict[tuple[int, int], WeightGrad] = {}       # B done, W not yet: what W needs
        self.losses: dict[int, torch.Tensor] = {}
        self.last = n_stages - 1
        self.timed = timeline is not None

    def scope(self, a: Action, last: bool) -> Any:
        """The caller's `backward_scope` around (a.stage, a.mb)'s backward, or nothing."""
        return (self.backward_scope(a.stage, a.mb, last) if self.backward_scope is not None
                else contextlib.nullcontext())

    def post_headers(self, actions: Sequence[Action]) -> None:
        """Receives start ahead of their action, so the data lands while this rank computes:
        micro-batch 0's headers now (micro-batch j+1's activation once j's arrived, its shape;
        a gradient as soon as the forward it belongs to has run: in `forward`)."""
        for a in actions:
            if a.kind == Kind.F and a.stage > 0 and a.mb == 0:
                self.links.post(a.stage - 1, a.stage, 0, backward=False)

    def forward(self, a: Action) -> None:
        """F(s, j): receive stage s-1's activation, run the forward, send its activation on
        (or keep the last stage's loss)."""
        links, key = self.links, (a.stage, a.mb)
        h_in = None
        if a.stage > 0:
            h_in = links.recv(a.stage - 1, a.stage, a.mb, backward=False).requires_grad_(True)
            links.post(a.stage - 1, a.stage, a.mb + 1, backward=False)
        if self.timed:
            t0 = time.perf_counter()
        out = self.forward_fn(a.stage, a.mb, h_in)
        if self.timed:
            self.timeline.append(Slot(a, t0, time.perf_counter()))
        if a.stage < self.last:
            links.send(out, a.stage + 1, a.stage + 1, a.mb, backward=False)
            links.post(a.stage + 1, a.stage, a.mb, backward=True, like=out)
        else:
            self.losses[a.mb] = out.detach()
        self.held[key] = (h_in, out)

    def backward(self, a: Action) -> None:
        """BW(s, j) or B(s, j): receive the activation's gradient, back-propagate it (whole,
        or to the received activation alone: B's split), send the input's gradient on."""
        key = (a.stage, a.mb)
        h_in, out = self.held.pop(key)
        grad = self.links.recv(a.stage + 1, a.stage, a.mb, backward=True, like=out) if a.stage < self.last else None
        if self.timed:
            t0 = time.perf_counter()
        whole = a.kind == Kind.BW or (self.split_backward is not None and not self.split_backward(a.stage, a.mb))
        if whole and a.kind == Kind.B:
            self.whole_at_b.add(key)
        with self.scope(a, whole):
            if whole:
                torch.autograd.backward(out, grad)
            else:
                self.pending[key] = backward_input(out, grad, h_in, self.index)
        del out         # B: the graph is W's now (its upper part, unused by W, is freed here)
        if self.timed:
            self.timeline.append(Slot(a, t0, time.perf_counter()))
        if a.stage > 0:
            g = h_in.grad if h_in.grad is not None else torch.zeros_like(h_in)
            self.links.send(g, a.stage - 1, a.stage - 1, a.mb, backward=True)

    def weights(self, a: Action) -> None:
        """W(s, j): the weight gradients from what its B kept (nothing when B ran the whole
        backward: an empty record)."""
        key = (a.stage, a.mb)
        if key in self.whole_at_b:     # its backward done whole at B
            self.whole_at_b.discard(key)
            if self.timed:
                t0 = time.perf_counter()
                self.timeline.append(Slot(a, t0, t0))
            return
        if key not in self.pending:
            raise ConfigError(f"run_rank: {a} has no B before it on this rank (or a second W): each B(s, j) "
                              "is followed by exactly one W(s, j); check the schedule (check_schedule)")
        if self.timed:
            t0 = time.perf_counter()
        with self.scope(a, True):
            self.pending.pop(key).run()
        if self.timed:
            self.timeline.append(Slot(a, t0, time.perf_counter()))

    def finish(self) -> list[torch.Tensor]:
        """Every B had its W; the sends waited for; the losses in micro-batch order."""
        if self.pending:
            raise ConfigError(f"run_rank: B ran without its W for (stage, micro-batch) {sorted(self.pending)}: their "
                              "weight gradients would be missing; each B(s, j) needs a W(s, j) later on the same rank")
        self.links.finish()
        return [self.losses[j] for j in sorted(self.losses)]


def run_rank(actions: Sequence[Action], n_stages: int, links: StageLinks,
             forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
             timeline: list | None = None, weights: Sequence[torch.Tensor] | None = None,
             backward_scope: Callable[[int, int, bool], Any] | None = None,
             split_backward: Callable[[int, int], bool] | None = None) -> list[torch.Tensor]:
    """Run this rank's `actions` (module docstring); returns the last stage's loss per
    micro-batch it computed (detached), in micro-batch order. `forward(stage, mb, h_in)`
    returns the stage's activation (a stage before the last) or the scaled loss (the last),
    with autograd recording. `timeline`: when a list, one `Slot` per action is appended to
    it, in order, timing the action's compute without its receive (module docstring).
    `weights`: the leaf tensors whose `.grad` the backward fills (every stage's parameters,
    as the forwards use them); needed when `actions` hold B and W (the split backward).
    `backward_scope(stage, mb, last)`: a context manager entered around each BW, B and W
    action's backward (the caller's hooks then know whose recomputes run); `last` is True
    for the micro-batch's last one there (BW, or W). `split_backward(stage, mb)` False: that
    B runs the whole backward and its W nothing (the order runs, the split does not) — for
    layers recomputed in backward (activation checkpointing), which W would recompute again,
    once per group of weights; None: every B and W split."""
    split = any(a.kind in (Kind.B, Kind.W) for a in actions)
    if split and weights is None:
        raise ConfigError("run_rank: the schedule splits the backward into B and W, which needs the weights "
                          "(the leaf tensors the forwards use): pass run_rank(..., weights=[...])")
    index = WeightIndex(weights) if split else None
    run = _RankRun(n_stages, links, forward, timeline, index, backward_scope, split_backward)
    run.post_headers(actions)
    for a in actions:
        if a.kind == Kind.F:
            run.forward(a)
        elif a.kind in (Kind.BW, Kind.B):
            run.backward(a)
        else:       # Kind.W
            run.weights(a)
    return run.finish()
