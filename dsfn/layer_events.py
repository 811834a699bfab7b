"""Layer events and what lives until backward: the events a forward announces below the step.

- `MicroBatch` / `micro_batch_begins`: the "micro_batch" primitive (micro-batch j's forward or
  backward begins; accumulate and the pipeline bind it).
- `UnitEvents`: the one installer of the "run_unit" primitive (a unit about to run, its call,
  just run), owned by a Step for the whole step (`unit_events_scope`) and installed at a
  module's first forward (`unit_events_for`, called by `dsfn.functional.call_module`).
- `ForwardEnded`: a forward ended early on purpose (a handler raises it in "post").
- `backward_lifetime` / `until_backward` / `in_backward`: what a forward sets up stays until
  its backward is over (a recompute in backward computes what the forward did).

Only `dsfn.effects` below it: the transforms and engines import it (or `dsfn.functional`,
which re-exports these names).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from dsfn.effects import active_stack, bind


class ForwardEnded(Exception):
    """Ends a forward early on purpose, carrying its result (a pipeline stage's last layer: the
    activation to send on). What a forward set up for backward treats it as a forward that
    completed (ZeRO-3 keeps its units' hooks for the recomputes), not as a failure."""


@dataclass(frozen=True)
class MicroBatch:
    """The event of the "micro_batch" primitive: micro-batch `index` (of `count`) begins its
    `phase` ("forward" or "backward"). `interleaved`: backwards of earlier micro-batches may
    still come after this forward (a pipeline's schedule; accumulate runs each forward after
    the previous backward). Whoever runs micro-batches binds it (`micro_batch_begins`); a
    transform that keeps per-micro-batch state (ZeRO's rounds of gradient buckets) handles it."""

    index: int
    phase: str
    count: int
    interleaved: bool = False


def micro_batch_begins(event: MicroBatch) -> None:
    """Bind the "micro_batch" primitive (default: nothing)."""
    bind("micro_batch", _no_handler, event)


def _no_handler(event: MicroBatch) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# layer events: the "run_unit" primitive

_unit_scope = threading.local()
_graph_task_id = torch._C._current_graph_task_id      # -1 outside autograd's backward (C: no Python frame)


def _innermost_unit_handler(module: nn.Module, phase: str, value: Any, recompute: bool) -> Any:
    """The default meaning of "run_unit": nothing changes (the value goes on as it is); for
    "call", the forward handed down runs."""
    if phase == "call":
        forward, args, kwargs = value
        return forward(*args, **kwargs)
    return value


def unit_chain(handlers: Sequence[Callable[..., Any]]) -> Callable[..., Any]:
    """`handlers` (outermost first) bound into one "run_unit" chain, built once
    (`functools.partial`), ending in the default meaning."""
    chain: Callable[..., Any] = _innermost_unit_handler
    for handler in reversed(list(handlers)):
        chain = functools.partial(handler, chain)
    return chain


def run_unit_handlers(stack: Sequence[Any]) -> list[Callable[..., Any]]:
    """The `handle_run_unit` methods of `stack`'s transforms, outermost first."""
    return [t.handle_run_unit for t in stack if hasattr(t, "handle_run_unit")]


class _UnitCall:
    """A unit's instance `forward` while its layer events are installed: the call goes down the
    "run_unit" chain as phase "call" with the forward it replaced. `previous` is what the
    instance dict held (None: the class's forward)."""

    __slots__ = ("module", "chain", "own", "previous")

    def __init__(self, module: nn.Module, chain: Callable[..., Any]):
        self.module, self.chain = module, chain
        self.previous = module.__dict__.get("forward")
        self.own = self.previous or type(module).forward.__get__(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.chain(self.module, "call", (self.own, args, kwargs), _graph_task_id() != -1)


class UnitEvents:
    """The one installer of layer events: a forward pre-hook and a forward hook on each of
    `units`, and an instance `forward` on each of `calls` (modules, each once), which bind the
    "run_unit" primitive through `handlers` (the stack's `handle_run_unit` methods, outermost
    first) as each unit is about to run, runs, or has just run:

        handle_run_unit(call_next, module, phase, value, recompute) -> value

    - phase "pre": `value` is `(args, kwargs)` of the call; a handler may return other ones
      (a pipeline stage's first layer takes the received activation);
    - phase "call" (only for `calls`): `value` is `(forward, args, kwargs)` and the chain
      returns the output; a handler may hand down another forward (tensor parallel's
      collectives around the local matmul, compile_units' compiled forward) or act around
      `call_next`; the innermost runs `forward(*args, **kwargs)`;
    - phase "post": `value` is the unit's output; a handler may return another, or raise
      (`ForwardEnded`: a pipeline stage's last layer ends the forward there);
    - `recompute`: the call runs inside autograd's backward (an activation checkpoint's
      recompute).

    A handler does its work before `call_next` to act outermost-first (ZeRO-3 gathers in
    "pre" and releases in "post" before an inner pipeline's stop), after it to act
    innermost-first. The chain is built once (`functools.partial`), so an event costs its hook
    and one call per handler. A context manager: the hooks live from `__enter__` to
    `__exit__` (a Step owns them for the whole step: `unit_events_scope`)."""

    def __init__(self, units: Sequence[nn.Module], handlers: Sequence[Callable[..., Any]],
                 calls: Sequence[nn.Module] = ()):
        self.units = _distinct(units)
        self.calls = _distinct(calls) if calls else []
        self.chain = unit_chain(handlers)
        self._handles: list[Any] = []
        self._swapped: list[_UnitCall] = []

    def __enter__(self) -> "UnitEvents":
        chain = self.chain

        def pre(mod, args, kwargs):
            value = (args, kwargs)
            new = chain(mod, "pre", value, _graph_task_id() != -1)
            return None if new is value else new

        def post(mod, args, out):
            new = chain(mod, "post", out, _graph_task_id() != -1)
            return None if new is out else new
        try:
            for m in self.units:
                self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(post))
            for m in self.calls:
                if isinstance(m.__dict__.get("forward"), _UnitCall):
                    continue        # another root's events call through it already (a shared module)
                call = _UnitCall(m, chain)
                m.forward = call
                self._swapped.append(call)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for call in reversed(self._swapped):
            if call.previous is None:
                del call.module.forward
            else:
                call.module.forward = call.previous
        self._swapped.clear()
        return False


def _distinct(modules: Sequence[nn.Module]) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for m in modules:
        seen.setdefault(id(m), m)
    return list(seen.values())


@contextlib.contextmanager
def unit_events_scope() -> Iterator[None]:
    """Opened by a Step around one step: the layer events installed by its forwards
    (`unit_events_for`) stay until the step ends (its backward and recomputes included), one
    installer per module, and are removed then, also when the step raises."""
    prev = getattr(_unit_scope, "installed", None)
    installed: dict[int, tuple[nn.Module, UnitEvents]] = {}
    _unit_scope.installed = installed
    try:
        yield
    finally:
        _unit_scope.installed = prev
        for _, events in installed.values():
            events.__exit__(None, None, None)


def unit_events_for(module: nn.Module) -> Any:
    """What a forward of `module` needs for its layer events: a context manager. The running
    stack's transforms that handle "run_unit" name the modules they want events of (the
    "units_of" primitive: each adds its own to the tuple); none: nothing is installed. Inside a
    Step, installed at the step's first forward of `module` and kept for the step; outside one
    (a bare stack), for this forward and its backward (`until_backward`)."""
    installed = getattr(_unit_scope, "installed", None)
    if installed is not None:
        hit = installed.get(id(module))
        if hit is not None and hit[0] is module:
            return contextlib.nullcontext()
    stack = active_stack()
    handlers = run_unit_handlers(stack)
    if not handlers:
        return contextlib.nullcontext()
    units = bind("units_of", _no_units, module)
    calls: Any = ()
    for t in stack:                 # (a loop, not a call: this runs at every first forward of a step)
        if hasattr(t, "handle_unit_calls_of"):
            calls = bind("unit_calls_of", _no_units, module)
            break
    if not units and not calls:
        return contextlib.nullcontext()
    events = UnitEvents(units, handlers, calls)
    if installed is None:
        return until_backward(events)
    events.__enter__()
    installed[id(module)] = (module, events)
    return contextlib.nullcontext()


def _no_units(module: nn.Module) -> tuple:
    """The default of "units_of" and "unit_calls_of": no module wants layer events."""
    return ()


def recompute_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a module hook that must also run around a recompute of a module's `forward` alone
    (`remat` checkpoints `forward`, past the module's own hooks, as Hugging Face does, and runs
    the marked hooks itself)."""
    hook._dsfn_recompute = True
    return hook


class RecomputeEvents:
    """The layer events of a recompute in backward, for `modules` (each once): from `__enter__`
    (a forward is over) to `__exit__` (its backward is), every call of one of them binds
    "run_unit" through `handlers` with phase "recompute_pre" (value `(args, {})`) and
    "recompute_post" (value its output), `recompute` True inside backward. ZeRO-3 names the
    modules owning sharded parameters directly, and its handler installs their re-gathered
    weights around the call. One pair of global module hooks (a dict lookup per module call;
    the forward runs none of it), marked `recompute_hook`: a checkpoint of a layer's forward
    skips the layer's own hooks, its submodules' calls still pass these."""

    def __init__(self, modules: Any, handlers: Sequence[Callable[..., Any]]):
        self.modules = modules      # a mapping whose keys are the watched modules' ids (kept live by its owner)
        chain = unit_chain(handlers)
        self._handles: list[Any] = []

        def pre(mod, args):
            if id(mod) in modules:
                chain(mod, "recompute_pre", (args, {}), _graph_task_id() != -1)

        def post(mod, args, out):
            if id(mod) in modules:
                chain(mod, "recompute_post", out, _graph_task_id() != -1)
        self.hooks = (recompute_hook(pre), recompute_hook(post))     # made once; entered every step

    def __enter__(self) -> "RecomputeEvents":
        pre, post = self.hooks
        self._handles = [nn.modules.module.register_module_forward_pre_hook(pre),
                         nn.modules.module.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc: Any) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        return False


def recompute_events_for(modules: Any, cache: Any) -> RecomputeEvents | None:
    """The recompute events of `modules` (a mapping keyed by module id, kept live by its owner)
    for the running stack's "run_unit" handlers (None when no transform handles it), not yet
    installed: enter it when the forward is over. `cache` (an IdentityCache of the caller's)
    keeps them for the same stack and mapping, step after step."""
    stack = active_stack()

    def make() -> RecomputeEvents | None:
        handlers = run_unit_handlers(stack)
        return RecomputeEvents(modules, handlers) if handlers else None
    return cache.get((modules, *stack), make)


# ---------------------------------------------------------------------------------------------
# what lives until backward is over

_lifetime = threading.local()


@contextlib.contextmanager
def backward_lifetime() -> Iterator[contextlib.ExitStack]:
    """Opened by value_and_grad's default around forward and backward: contexts handed to
    `until_backward` inside it are exited when it closes (in reverse order)."""
    stack = _lifetime.__dict__.setdefault("stack", [])
    with contextlib.ExitStack() as exits:
        stack.append(exits)
        try:
            yield exits
        finally:
            stack.pop()


@contextlib.contextmanager
def until_backward(cm: Any) -> Iterator[Any]:
    """Enter `cm`; exit it when the running value_and_grad's backward is over (or at the end
    of the `with` block when no value_and_grad runs, e.g. an evaluation forward).

    What a forward sets up for the model — the step's tensors bound to the module,
    tensor parallel's forwards, ZeRO-3's unit hooks, Ulysses attention — must still be
    in place when backward re-runs part of the forward (activation checkpointing's
    recompute), so the recompute computes what the forward did."""
    stack = getattr(_lifetime, "stack", None)
    if not stack:
        with cm as value:
            yield value
        return
    yield stack[-1].enter_context(cm)


def in_backward() -> bool:
    """True while autograd's engine runs backward on this thread (e.g. during a recompute)."""
    return torch._C._current_graph_task_id() != -1
