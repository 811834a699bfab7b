"""`compose(*transforms)(train_step)` and the `Step` it returns.

`compose(a, b)(f) == a(b(f))`: `a` is outermost. A Step holds the user's pure
`train_step` and the stack (outermost first):

    step.place(state)   logical -> this rank's physical state (innermost transform first)
    step.gather(state)  physical -> logical (layouts on the leaves, then each transform's gather)
    step(state, batch)  -> (new_state, metrics)
    step(state, batch, donate=True)   the same values; the input state's buffers are reused

Donation (`compose(..., donate=True)` for every call, or `donate=` per call; see
`dsfn.state.donation`): the step may write the new parameters and optimizer state into
the input state's tensors, and the input state is invalid afterwards (any use raises
`DonatedStateError`). It removes the functional step's extra copy of the state from the
peak memory; values are bitwise those of the non-donated step.

Inside `step(state, batch)` the transforms are active (they handle primitives), each
transform's `wrap_step` wraps the function (the outermost runs first), and the metrics
go through the "reduce_metrics" primitive. Metrics come back as detached 0-dim tensors.
`train_step` runs in a buffer scope over `state.buffers` (dsfn.functional): the
forwards' updates of persistent buffers go into the new state's `buffers`, which then
go through the "sync_buffers" primitive (data parallel: broadcast from dp rank 0) —
inside every `wrap_step`, so a checkpoint taken at the step boundary holds them.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from dsfn import tree
from dsfn.errors import LeafTypeError, StackError, UnplacedStateError
from dsfn.functional import buffer_scope, unit_events_scope
from dsfn.runtime import env
from dsfn.runtime.mesh import ensure_ready
from dsfn.state import donation
from dsfn.state.layout import gather_tree
from dsfn.state.init import place_state
from dsfn.state.train_state import mark_placed
from dsfn.effects import activate, bind
from dsfn.transforms.facts import StackFacts

StepFn = Callable[[Any, Any], tuple[Any, dict]]

# what a Step (and the stack facts) call on a transform, beside its `handle_<primitive>`
# handlers (found by dsfn.effects): each is declared on dsfn.transforms.core.Transform with
# a default that means "nothing", so it is called, never probed for
HOOK_METHODS = ("check_stack", "facts", "place", "gather", "unplaced", "wrap_step", "explain_note", "describe")
HOOK_ATTRIBUTES = ("name", "unique", "roles", "place_after")
HOOKS = HOOK_METHODS + HOOK_ATTRIBUTES


class Step:
    """A train step with a stack of transforms around it."""

    def __init__(self, fn: StepFn, stack: tuple[Any, ...] = (), donate: bool = False):
        if isinstance(fn, Step):
            stack, fn, donate = tuple(stack) + fn.stack, fn.fn, donate or fn.donate
        if not isinstance(donate, bool):
            raise StackError(f"compose(..., donate={donate!r}): donate is True or False")
        self.donate = donate
        if not callable(fn):
            raise StackError(f"compose(...) must be applied to a train_step function, got {fn!r}")
        self.fn = fn
        self.stack = check_stack(stack)
        self.facts = StackFacts(self.stack)      # what the stack implies: read by its transforms
        if not donate:
            # a functional step reallocates its state every step: keep freed host memory for
            # reuse. A donating step updates its state in place, so glibc's own policy (which
            # returns large freed blocks) serves it with a lower peak (benchmarks/memory.py)
            env.tune_host_allocator()
        wrapped = self._call_inner
        for t in reversed(self.stack):   # the innermost wraps first, so the outermost runs first
            wrapped = t.wrap_step(wrapped)
        self._wrapped = wrapped
        self._last_out: weakref.ref | None = None    # the state the last call returned

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
        donation.check_live(state, "step.place(state)")
        ensure_ready(self.stack)     # under torchrun: init the process group; mesh axes exist
        env.check_state_device(_computed_on(getattr(state, "params", state)), "the state's params")
        return mark_placed(place_state(self.stack, self.facts, state))

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
        env.check_state_device(_computed_on(params), "params")
        from dsfn.state.train_state import TrainState
        state = TrainState.create(params, tx, seed=seed, extra=extra, init_optimizer=False, buffers=buffers)
        state = self.place(state)
        with activate(self.stack, self.facts):
            opt_state = bind("init_optimizer", lambda s: s.tx.init(s.params), state)
        return state.replace(opt_state=opt_state)

    def gather(self, state: Any) -> Any:
        """Physical state -> logical state (collective when leaves are sharded).

        The layouts on the leaves are gathered first; then each transform undoes the
        structural changes its `place` made, outermost first (the reverse of `place`).
        """
        donation.check_live(state, "step.gather(state)")
        ensure_ready(self.stack)
        state = gather_tree(state)
        with activate(self.stack, self.facts):
            for t in self.stack:
                state = t.gather(state)
        return state

    def __call__(self, state: Any, batch: Any, *, donate: bool | None = None
                 ) -> tuple[Any, dict[str, torch.Tensor]]:
        """One step: `(new_state, metrics)`. `donate` (default: the Step's, from `compose`)
        lets the step reuse `state`'s buffers for the new state; `state` is then invalid
        (module docstring)."""
        donation.check_live(state, "step(state, batch)")
        donate = self.donate if donate is None else donate
        if not isinstance(donate, bool):
            raise StackError(f"step(state, batch, donate={donate!r}): donate is True, False or None")
        ensure_ready(self.stack)
        if self._last_out is None or self._last_out() is not state:
            # a state this Step did not just return (the first, a loaded or a replaced one); the
            # loop's `state, m = step(state, batch)` skips the walk over its leaves
            _check_placed(self.stack, state)
        _check_batch(batch)
        if donate:
            donation.check_donatable(state)
            donation.settle_readers()      # background readers of the old buffers (async checkpoints)
        new_state = None
        try:
            # the layer events ("run_unit") of the step's forwards live for the whole step
            with activate(self.stack, self.facts), donation.donating(donate), unit_events_scope():
                new_state, metrics = self._wrapped(state, batch)
                metrics = bind("reduce_metrics", lambda m: m, _metrics_to_tensors(metrics))
        finally:
            if donate and new_state is not state:   # also after a failure: buffers may be half-written
                made = getattr(new_state, "step", None)
                donation.mark_donated(state, "a step that failed part-way" if new_state is None
                                      else lambda: f"the step that made step {_step_number(made)}")
        try:
            self._last_out = weakref.ref(new_state)
        except TypeError:                  # a state type without weak references: checked every call
            self._last_out = None
        return new_state, _with_lr(metrics, new_state)

    def explain(self, state: Any, batch: Any) -> "Explanation":
        """A dry run of one step on this rank: layouts, collectives, bytes.

        `state` is the placed (physical) state. The step runs once and its result is
        dropped (states are immutable, so `state` is unchanged); the runtime's counters
        give each collective's calls and bytes per (axis, op).
        """
        ensure_ready(self.stack)
        from dsfn.runtime import collectives as C
        from dsfn.state.layout import Placed, layout_of, leaf_records
        before = C.counters.snapshot()
        C.reset_gauges()
        from dsfn.functional import recording_apply_fns
        with recording_apply_fns() as seen:
            self(state, batch, donate=False)        # a dry run never consumes the state
        after = C.counters.snapshot()
        comm, links, quantized = {}, {}, {}
        for key, v in after.items():
            b = before.get(key) or C.OpCount()
            calls, nbytes = v.calls - b.calls, v.bytes - b.bytes
            if calls:
                comm[key] = (calls, nbytes)
                links[key] = (v.intra - b.intra, v.inter - b.inter)
                if v.codes - b.codes or v.scales - b.scales:
                    quantized[key] = (v.codes - b.codes, v.scales - b.scales)
        leaves = leaf_records(state)
        for fn in seen.values():     # frozen parameters, non-persistent buffers: not state, still held here
            for name, x in fn.constants.items():
                t = x.data if isinstance(x, Placed) else x
                leaves.append((f"constants.{name}", layout_of(x), tuple(t.shape), t.dtype,
                               t.numel() * t.element_size()))
        with activate(self.stack, self.facts):
            notes = [t.explain_note() for t in self.stack]
        out = Explanation(notes, leaves, comm, dict(C.gauge_max))
        out.links, out.quantized = links, quantized
        out.handlers = handler_order(self.stack)
        # dsfn.estimate_memory for this stack, beside the leaves (registered by dsfn.estimate_explain)
        view = ESTIMATE_VIEW.get("estimate")
        out.estimate = view(self.stack, state, batch) if view is not None else None
        return out

    def __repr__(self) -> str:
        inner = getattr(self.fn, "__name__", repr(self.fn))
        for t in reversed(self.stack):
            inner = f"{t.describe()}({inner})"
        return f"Step[{inner}]"


# what `Step.explain` shows beside a rank's leaves: the memory estimate of its stack
# ("estimate": (stack, state, batch) -> MemoryEstimate | None) and the comparison with the
# measured bytes ("compare": (estimate, explanation) -> str). The estimate lives above the
# transforms (it reads their facts), so it registers itself here (`dsfn.estimate_explain`,
# imported by `import dsfn`) instead of being imported by them.
ESTIMATE_VIEW: dict[str, Callable[..., Any]] = {}


class Explanation:
    """What a step does on this rank: `stack` notes, `leaves` (path, layout, local shape,
    dtype, bytes), `collectives` {(axis, op): (calls, bytes)} per step, `links` {(axis, op):
    (intra-node bytes of this rank, inter-node bytes of its node)} per step
    (`dsfn.runtime.links`; totals `intra_bytes`, `inter_bytes`), runtime `gauges`,
    `estimate` (`dsfn.estimate.MemoryEstimate` of the stack, or None), `handlers` {primitive:
    [transform names, outermost first]} (`handler_order`)."""

    def __init__(self, stack: list[str], leaves: list[tuple], collectives: dict, gauges: dict):
        self.stack, self.leaves, self.collectives, self.gauges = stack, leaves, collectives, gauges
        self.estimate = None
        # primitive -> the transforms that handle it, outermost first (the order `bind` runs them)
        self.handlers: dict[str, list[str]] = {}
        self.links: dict[tuple[str, str], tuple[float, float]] = {}
        # {(axis, op): (codes bytes, scales bytes)}: the quantized part of a collective's bytes (ZeRO++)
        self.quantized: dict[tuple[str, str], tuple[int, int]] = {}

    @property
    def state_bytes(self) -> int:
        return sum(x[4] for x in self.leaves)

    @property
    def intra_bytes(self) -> float:
        """This rank's bytes over node-local links per step."""
        return sum(v[0] for v in self.links.values())

    @property
    def inter_bytes(self) -> float:
        """Bytes crossing this rank's node's boundary per step (per node)."""
        return sum(v[1] for v in self.links.values())

    def __str__(self) -> str:
        lines = ["stack (outermost first):"] + [f"  {n}" for n in self.stack] or ["  (no transforms)"]
        if self.handlers:
            lines.append("handlers per primitive (outermost first):")
            for prim, names in self.handlers.items():
                lines.append(f"  {prim:18s} {' -> '.join(names)}")
        lines.append(f"state on this rank: {self.state_bytes / 2**20:.2f} MiB in {len(self.leaves)} tensors")
        for path, layout, shape, dtype, nbytes in self.leaves:
            lines.append(f"  {path:50s} {str(dtype).replace('torch.', ''):9s} {str(shape):16s} {layout}")
        lines.append("collectives per step:" if self.collectives else "collectives per step: none")
        for (axis, op), (calls, nbytes) in sorted(self.collectives.items()):
            intra, inter = self.links.get((axis, op), (0.0, 0.0))
            where = "node-local" if not inter else f"{inter:,.0f} B across nodes (per node)"
            lines.append(f"  {axis:12s} {op:15s} {calls:5d} calls {nbytes:14,d} B   {intra:14,.0f} B intra-node, "
                         f"{where}")
            if (axis, op) in self.quantized:
                codes, scales = self.quantized[(axis, op)]
                lines.append(f"  {'':12s} {'':15s}   of which quantized: {codes:,d} B codes + {scales:,d} B fp32 "
                             f"scales; {nbytes - codes - scales:,d} B exact")
        if self.collectives:
            lines.append(f"  by link: {self.intra_bytes:,.0f} B intra-node (this rank), "
                         f"{self.inter_bytes:,.0f} B inter-node (per node)")
        for k, v in sorted(self.gauges.items()):
            lines.append(f"peak {k}: {v}")
        if getattr(self, "estimate", None) is not None and "compare" in ESTIMATE_VIEW:
            lines.append(ESTIMATE_VIEW["compare"](self.estimate, self))
        return "\n".join(lines)

    __repr__ = __str__


def handler_order(stack: Sequence[Any]) -> dict[str, list[str]]:
    """{primitive: [the names of `stack`'s transforms that handle it, outermost first]}, for
    every primitive some transform of the stack handles: the order in which `bind` runs their
    `handle_<primitive>` methods (a transform without one is passed over), primitives sorted
    by name."""
    order: dict[str, list[str]] = {}
    for t in stack:
        for attr in dir(type(t)):
            if attr.startswith("handle_") and callable(getattr(t, attr, None)):
                order.setdefault(attr[len("handle_"):], []).append(t.name)
    return dict(sorted(order.items()))


def compose(*transforms: Any, donate: bool = False) -> Callable[[StepFn], Step]:
    """`compose(a, b, c)(f) == a(b(c(f)))`; the stack is validated now, not at the first step.

    `donate=True`: every call of the Step donates its input state (module docstring)."""
    stack = check_stack(transforms)
    if not isinstance(donate, bool):
        raise StackError(f"compose(..., donate={donate!r}): donate is True or False")

    def apply(fn: StepFn) -> Step:
        return Step(fn, stack, donate=donate)

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


def _step_number(s: Any) -> str:
    s = getattr(s, "data", s)
    try:
        return str(int(s))
    except (TypeError, ValueError, RuntimeError):
        return "?"


def _check_placed(stack: tuple[Any, ...], state: Any) -> None:
    """UnplacedStateError when a transform sees that `state` never went through `place` (a
    logical state would otherwise train unsharded, or fail deep inside an optimizer)."""
    for t in stack:
        why = t.unplaced(state)
        if why is not None:
            raise UnplacedStateError(
                f"step(state, batch) was given a state that was never placed for this stack ({t.name}: "
                f"{why}). Place it once before the loop: `state = step.place(state)`, or build it placed: "
                "`state = step.init_state(params, tx)` (the optimizer state is then born as this rank's pieces).")


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


def _computed_on(params: Any) -> list[torch.Tensor]:
    """The parameter tensors that compute where they live (offloaded pieces live on the host
    by design and are left out of the device check)."""
    from dsfn.state.layout import Offloaded, Placed, is_placed
    return [x.data if isinstance(x, Placed) else x for x in tree.leaves(params, is_leaf=is_placed)
            if not (isinstance(x, Placed) and isinstance(x.layout, Offloaded))]


def is_transform(t: Any) -> bool:
    """Whether `t` keeps the transform protocol (`HOOKS`: what a Step calls, as declared by
    `dsfn.transforms.core.Transform`; checked by shape, so this module stays below the protocol's)."""
    return all(callable(getattr(t, m, None)) for m in HOOK_METHODS) \
        and all(hasattr(t, a) for a in HOOK_ATTRIBUTES) and isinstance(getattr(t, "name", None), str)


def check_stack(stack: Sequence[Any]) -> tuple[Any, ...]:
    """Validate a stack at compose time; returns it as a tuple."""
    for i, t in enumerate(stack):
        if not is_transform(t):
            hint = ""
            if callable(t) and getattr(t, "__module__", "").startswith("dsfn.transforms"):
                hint = f" Did you forget to call it, e.g. {getattr(t, '__name__', 'transform')}()?"
            raise StackError(f"compose() takes dsfn transforms; argument {i} is {t!r}.{hint}")
    seen: dict[type, int] = {}
    for i, t in enumerate(stack):
        if t.unique and type(t) in seen:
            raise StackError(f"{t.name} appears twice in the stack (positions {seen[type(t)]} and {i}); "
                             f"use it once")
        seen.setdefault(type(t), i)
    for i, t in enumerate(stack):
        t.check_stack(stack, i)
    return tuple(stack)
