"""Donation: a step may reuse its input state's buffers for its output (JAX's `donate_argnums`).

    step = dsfn.compose(shard_zero(3), donate=True)(train_step)   # every call donates
    state, metrics = step(state, batch)
    state, metrics = plain_step(state, batch, donate=True)        # or per call

Semantics
- Without donation (the default) states are immutable: a step returns new tensors and the
  input state reads as before.
- A donated step *consumes* its input state: the optimizer writes the new parameters and
  optimizer state into the input's tensors (the same kernels, in place, so the values are
  bitwise those of the non-donated step) and the input state object becomes invalid. Any
  later use of it — a field read (`state.params`), passing it to a step, `step.gather`,
  `step.place`, `dsfn.checkpoint.save`, any `dsfn.tree` call — raises `DonatedStateError`;
  it never silently reads the updated values. A step that raises part-way invalidates its
  donated input too (some buffers may already hold the new values).
- Tensors taken out of the state *before* donating it (`w = state.params["w"]`, or a
  `step.gather` result whose leaves were replicated, i.e. the state's own tensors) alias
  the new state's buffers and see the update, as `torch.optim`'s parameters do; clone what
  you want to keep. Tensors the state holds from outside (a model's parameters after
  `functionalize(model)` without `release=True`, the user's `params` dict) are donated
  with it.

Mechanism (one flag, no branch per transform)
- `may_alias()`: True while a donated step runs (a thread-local context set by `Step`).
  The update functions (`dsfn.optim`'s Adam/SGD paths and `apply_updates`, the host and
  Triton AdamW kernels, mixed precision's low-precision copy) consult it through
  `writable(tensors)` and then write their results into their inputs.
- Holders of references to state tensors that outlive a step (the async checkpoint
  writer, which captures by reference) `register_reader(r)`: before a donated step
  writes anything, `settle_readers()` calls `r.settle_for_donation()`, which waits until
  the reader no longer needs the old values (see `dsfn.checkpoint.async_engine`).
- `mark_donated(state)` / `check_live(state, what)`: the invalidation of the input state.

Memory: donation removes the second copy of the state a functional update holds (the
update's only temporary is Adam's denominator for 16 MiB of parameters at a time). A Step
built with `compose(..., donate=True)` also leaves glibc's allocator at its defaults:
`runtime.env.tune_host_allocator` (keep all freed memory) exists because a non-donating
step reallocates its whole state every step, which a donating one does not. A donated
ZeRO-3 step with units gathered on the host also trims the heap once per step
(`runtime.env.trim_host_heap`, at the end of backward): lower resident memory for
some page faults.
`benchmarks/memory.py` measures the peaks against DDP and FSDP2.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from dsfn.aliasing import donating, may_alias, writable  # noqa: F401  (the flag lives below the state floor)
from dsfn.errors import ConfigError, DonatedStateError

_readers: "weakref.WeakSet[Any]" = weakref.WeakSet()

# Attribute a donated state carries (set with object.__setattr__: states are frozen).
_MARK = "_dsfn_donated"


def register_reader(reader: Any) -> None:
    """`reader.settle_for_donation()` runs before every donated step (held weakly)."""
    _readers.add(reader)


def settle_readers() -> None:
    """Let every registered reader finish with the buffers a donated step will overwrite."""
    for r in list(_readers):
        r.settle_for_donation()


def _donatable(state: Any) -> bool:
    """A state whose fields can be invalidated: a class that declares `donatable = True`
    (dsfn.TrainState; checked by a class flag, so this module stays below train_state)."""
    return getattr(type(state), "donatable", False) is True


def check_donatable(state: Any) -> None:
    """ConfigError unless `state` can be donated: a dsfn TrainState (its invalidation needs one)."""
    if not _donatable(state):
        raise ConfigError(f"donate=True needs a dsfn.TrainState as the step's state, got {type(state).__name__}; "
                          "build it with dsfn.TrainState.create / step.init_state, or call the step without donation")


def mark_donated(state: Any, note: str | Callable[[], str]) -> None:
    """Invalidate a donated TrainState: its child fields are removed, so every later read
    (attribute, tree op, a step) raises DonatedStateError (`TrainState.__getattr__`)."""
    import dataclasses
    if not _donatable(state) or is_donated(state):
        return
    object.__setattr__(state, _MARK, note)
    for f in dataclasses.fields(state):
        if f.metadata.get("pytree_node", True) and f.name in state.__dict__:
            object.__delattr__(state, f.name)


def is_donated(state: Any) -> bool:
    return _MARK in getattr(state, "__dict__", {})


def donated_error(state: Any, what: str) -> DonatedStateError:
    note = state.__dict__.get(_MARK, "a step")
    note = note() if callable(note) else note      # made when the error is raised: no sync in the step
    return DonatedStateError(
        f"{what}: this TrainState was donated to {note}, which reused its buffers for the state it "
        "returned, so it no longer holds its own values. Use the state that step returned; to keep this "
        "one, call the step without donation (compose(..., donate=False) or step(state, batch, donate=False)), "
        "or clone what you need before the donated call")


def check_live(state: Any, what: str) -> None:
    """Raise DonatedStateError if `state` was donated."""
    if is_donated(state):
        raise donated_error(state, what)
