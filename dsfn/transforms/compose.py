"""`compose(*transforms)(train_step)` and the `Step` it returns.

`compose(a, b)(f) == a(b(f))`: `a` is outermost. A Step holds the user's pure
`train_step` and the stack (outermost first):

    step.place(state)   logical -> this rank's physical state (innermost transform first)
    step.gather(state)  physical -> logical (layouts on the leaves, then each transform's gather)
    step(state, batch)  -> (new_state, metrics)

Inside `step(state, batch)` the transforms are active (they handle primitives), each
transform's `wrap_step` wraps the function (the outermost runs first), and the metrics
go through the "reduce_metrics" primitive. Metrics come back as detached 0-dim tensors.
`train_step` runs in a buffer scope over `state.buffers` (dsfn.functional): the
forwards' updates of persistent buffers go into the new state's `buffers`, which then
go through the "sync_buffers" primitive (data parallel: broadcast from dp rank 0) —
inside every `wrap_step`, so a checkpoint taken at the step boundary holds them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dsfn import tree
from dsfn.errors import LeafTypeError, StackError
from dsfn.functional import buffer_scope
from dsfn.runtime import env
from dsfn.runtime.mesh import ensure_ready
from dsfn.state.layout import gather_tree
from dsfn.transforms.core import Transform, activate, bind, check_stack, register_step_class

StepFn = Callable[[Any, Any], tuple[Any, dict]]


class Step:
    """A train step with a stack of transforms around it."""

    def __init__(self, fn: StepFn, stack: tuple[Transform, ...] = ()):
        if isinstance(fn, Step):
            stack, fn = tuple(stack) + fn.stack, fn.fn
        if not callable(fn):
            raise StackError(f"compose(...) must be applied to a train_step function, got {fn!r}")
        self.fn = fn
        self.stack = check_stack(stack)
        env.tune_host_allocator()      # a functional step reallocates its state every step
        wrapped = self._call_inner
        for t in reversed(self.stack):   # the innermost wraps first, so the outermost runs first
            wrapped = t.wrap_step(wrapped)
        self._wrapped = wrapped

    def _call_inner(self, state: Any, batch: Any) -> tuple[Any, dict]:
        held = getattr(state, "buffers", None)
        held = held if isinstance(held, dict) else {}
        with buffer_scope(held) as scope:
            out = self.fn(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise StackError("train_step must return (new_state, metrics: dict); got "
                             f"{type(out).__name__}")
        if held:
            out = (_new_buffers(state, out[0], scope), out[1])
        return out

    def place(self, state: Any) -> Any:
        """Logical state -> this rank's physical state."""
        ensure_ready(self.stack)     # under torchrun: init the process group; mesh axes exist
        with activate(self.stack):
            for t in reversed(self.stack):
                state = t.place(state)
            for t in reversed(self.stack):   # layouts that wrap the finished ones (offload)
                after = getattr(t, "place_after", None)
                if after is not None:
                    state = after(state)
        return state

    def init_state(self, params: Any, tx: Any, seed: int = 0, extra: dict | None = None,
                   buffers: dict | None = None) -> Any:
        """This rank's physical state for fresh training, without the full optimizer state.

        Equals `self.place(TrainState.create(params, tx, seed, extra, buffers=buffers))`, but the
        optimizer state is made only for what the optimizer will see on this rank (ZeRO
        shards, mixed precision's master weights): the "init_optimizer" primitive, whose
        default is `tx.init(params)`. Full parameters are still needed once, on every
        rank, as `params`.
        """
        ensure_ready(self.stack)
        from dsfn.state.train_state import TrainState
        state = TrainState.create(params, tx, seed=seed, extra=extra, init_optimizer=False, buffers=buffers)
        state = self.place(state)
        with activate(self.stack):
            opt_state = bind("init_optimizer", lambda s: s.tx.init(s.params), state)
        return state.replace(opt_state=opt_state)

    def gather(self, state: Any) -> Any:
        """Physical state -> logical state (collective when leaves are sharded).

        The layouts on the leaves are gathered first; then each transform undoes the
        structural changes its `place` made, outermost first (the reverse of `place`).
        """
        ensure_ready(self.stack)
        state = gather_tree(state)
        with activate(self.stack):
            for t in self.stack:
                state = t.gather(state)
        return state

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        ensure_ready(self.stack)
        _check_batch(batch)
        with activate(self.stack):
            new_state, metrics = self._wrapped(state, batch)
            metrics = bind("reduce_metrics", lambda m: m, _metrics_to_tensors(metrics))
        return new_state, _with_lr(metrics, new_state)

    def explain(self, state: Any, batch: Any) -> "Explanation":
        """A dry run of one step on this rank: layouts, collectives, bytes.

        `state` is the placed (physical) state. The step runs once and its result is
        dropped (states are immutable, so `state` is unchanged); the runtime's counters
        give each collective's calls and bytes per (axis, op).
        """
        ensure_ready(self.stack)
        from dsfn.runtime import collectives as C
        from dsfn.state.layout import Placed, is_placed, layout_of
        before = C.counters.snapshot()
        C.reset_gauges()
        self(state, batch)
        after = C.counters.snapshot()
        comm = {}
        for key, v in after.items():
            b = before.get(key)
            calls, nbytes = v.calls - (b.calls if b else 0), v.bytes - (b.bytes if b else 0)
            if calls:
                comm[key] = (calls, nbytes)
        leaves = []
        for path, x in tree.leaves_with_path(state, is_leaf=is_placed):
            t = x.data if isinstance(x, Placed) else x
            if isinstance(t, torch.Tensor):
                leaves.append((path, layout_of(x), tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        notes = [getattr(t, "explain_note", t.describe)() for t in self.stack]
        return Explanation(notes, leaves, comm, dict(C.gauge_max))

    def __repr__(self) -> str:
        inner = getattr(self.fn, "__name__", repr(self.fn))
        for t in reversed(self.stack):
            inner = f"{t.describe()}({inner})"
        return f"Step[{inner}]"


class Explanation:
    """What a step does on this rank: `stack` notes, `leaves` (path, layout, local shape,
    dtype, bytes), `collectives` {(axis, op): (calls, bytes)} per step, runtime `gauges`."""

    def __init__(self, stack: list[str], leaves: list[tuple], collectives: dict, gauges: dict):
        self.stack, self.leaves, self.collectives, self.gauges = stack, leaves, collectives, gauges

    @property
    def state_bytes(self) -> int:
        return sum(x[4] for x in self.leaves)

    def __str__(self) -> str:
        lines = ["stack (outermost first):"] + [f"  {n}" for n in self.stack] or ["  (no transforms)"]
        lines.append(f"state on this rank: {self.state_bytes / 2**20:.2f} MiB in {len(self.leaves)} tensors")
        for path, layout, shape, dtype, nbytes in self.leaves:
            lines.append(f"  {path:50s} {str(dtype).replace('torch.', ''):9s} {str(shape):16s} {layout}")
        lines.append("collectives per step:" if self.collectives else "collectives per step: none")
        for (axis, op), (calls, nbytes) in sorted(self.collectives.items()):
            lines.append(f"  {axis:4s} {op:15s} {calls:5d} calls {nbytes / 2**20:10.3f} MiB")
        for k, v in sorted(self.gauges.items()):
            lines.append(f"peak {k}: {v}")
        return "\n".join(lines)

    __repr__ = __str__


register_step_class(Step)


def compose(*transforms: Transform) -> Callable[[StepFn], Step]:
    """`compose(a, b, c)(f) == a(b(c(f)))`; the stack is validated now, not at the first step."""
    stack = check_stack(transforms)

    def apply(fn: StepFn) -> Step:
        return Step(fn, stack)

    return apply


def _new_buffers(state: Any, new_state: Any, scope: Any) -> Any:
    """`new_state` with the scope's buffers (entries `train_step` replaced itself stay its
    own), after the "sync_buffers" primitive (default: as they are)."""
    held, out = state.buffers, getattr(new_state, "buffers", None)
    if not isinstance(out, dict) or set(out) != set(held):
        raise StackError("train_step returned a state whose buffers have other names than its input's "
                         f"({sorted(set(held) ^ set(out or {}))[:5]}); keep the structure of state.buffers")
    current = scope.buffers
    merged = {n: (current[n] if out[n] is held[n] else out[n]) for n in held}
    return tree.replace(new_state, buffers=bind("sync_buffers", lambda b: b, merged))


def _check_batch(batch: Any) -> None:
    for path, x in tree.leaves_with_path(batch):
        if not isinstance(x, torch.Tensor):
            raise LeafTypeError(f"batch leaf {path or '<root>'!r} is a {type(x).__name__}; every batch "
                                "leaf must be a torch.Tensor (convert with torch.as_tensor)")


def _metrics_to_tensors(metrics: dict) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise LeafTypeError(f"metric {k!r} has shape {tuple(v.shape)}; metrics are scalars")
            out[k] = v.detach().reshape(())
        elif isinstance(v, (int, float, bool)):
            out[k] = torch.tensor(float(v))
        else:
            raise LeafTypeError(f"metric {k!r} is a {type(v).__name__}; metrics are scalars or 0-dim tensors")
    return out


def _with_lr(metrics: dict[str, torch.Tensor], state: Any) -> dict[str, torch.Tensor]:
    """Add the optimizer's learning rate (the same on every rank, so never reduced)."""
    opt_state = getattr(state, "opt_state", None)
    if "lr" not in metrics and opt_state is not None:
        from dsfn.optim import current_lr
        lr = current_lr(opt_state)
        if lr is not None:
            return {**metrics, "lr": lr.detach().reshape(()).clone()}
    return metrics
