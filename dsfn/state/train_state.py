"""`TrainState`: the whole training state as one immutable pytree.

Fields (children unless noted):
- `step`: 0-dim int64 tensor, number of optimizer updates applied so far.
- `params`: pytree of parameter tensors (usually `dict[str, Tensor]` from `functionalize`).
- `opt_state`: the optimizer's state pytree (moments, counts, lr).
- `rng`: int64 tensor [2] = (seed, draws); `rng_generator` derives torch generators from it.
- `buffers`: dict name -> tensor of the model's persistent buffers (BatchNorm's running
  statistics, anything a forward updates): `TrainState.create(..., buffers=apply_fn.buffers)`.
  A Step feeds them to the forwards and puts the updated values in the new state
  (see dsfn.functional); they are replicated tensors, synced over data parallel by
  broadcast from dp rank 0 at the end of every step, and saved by checkpoints.
- `extra`: dict for more state owned by transforms and users (loss scale, data cursor, ...).
- `tx` (static): the `GradientTransformation` that owns `opt_state`.

States are never mutated: `replace` and `apply_gradients` return new states; the input
state's tensors are unchanged after a step. Leaves may be `Placed` (sharded/offloaded
pieces) after `Step.place`. The one exception is donation (`dsfn.state.donation`): a step
called with `donate=True` writes the new values into the input state's tensors and
invalidates the input state object — every later read of its fields raises
`DonatedStateError`.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from dsfn import tree
from dsfn.errors import LeafTypeError
from dsfn.effects import bind
from dsfn.state import donation


@tree.dataclass
class TrainState:
    step: torch.Tensor
    params: Any
    opt_state: Any
    rng: torch.Tensor
    buffers: dict = tree.field(default_factory=dict)
    extra: dict = tree.field(default_factory=dict)
    tx: Any = tree.static_field(default=None)
    donatable = True        # (a class attribute, not a field) a donated step may invalidate it

    @classmethod
    def create(cls, params: Any, tx: Any, seed: int = 0, extra: dict | None = None,
               init_optimizer: bool = True, buffers: dict | None = None) -> "TrainState":
        """A fresh state: step 0, `tx.init(params)`, rng from `seed`, the model's persistent
        `buffers` (`apply_fn.buffers`; the state holds these tensors, the step never changes them).

        `init_optimizer=False` leaves `opt_state` None, for `Step.init_state`, which
        makes the optimizer state after the layout is known (only this rank's shard).
        """
        check_tensor_leaves(params, "params")
        buffers = check_buffers(buffers)
        if tx is None or not (hasattr(tx, "init") and hasattr(tx, "update")):
            from dsfn.errors import ConfigError
            raise ConfigError("TrainState.create needs tx=a dsfn optimizer (e.g. dsfn.optim.adamw(lr=1e-3)), "
                              f"got {tx!r}")
        step = torch.zeros((), dtype=torch.int64)
        _FRESH[id(step)] = weakref.ref(step, lambda _r, k=id(step): _FRESH.pop(k, None))
        return cls(step=step, params=params,
                   opt_state=tx.init(params) if init_optimizer else None,
                   rng=torch.tensor([int(seed), 0], dtype=torch.int64), buffers=buffers,
                   extra=dict(extra or {}), tx=tx)

    def replace(self, **changes: Any) -> "TrainState":
        return tree.replace(self, **changes)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: a donated state's fields were removed
        # (dsfn.state.donation.mark_donated), so reading one names the problem
        if name != "__dict__" and donation.is_donated(self):
            raise donation.donated_error(self, f"TrainState.{name}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def apply_gradients(self, grads: Any) -> "TrainState":
        """One optimizer update with `grads` (same structure as `params`); step += 1.

        A primitive: transforms such as ZeRO change how (and where) the update runs.
        """
        return bind("apply_gradients", _apply_gradients, self, grads)

    def rng_generator(self, stream: int = 0) -> torch.Generator:
        """A torch.Generator determined by (seed, step, stream): reproducible across resumes."""
        g = torch.Generator()
        seed, _ = (int(x) for x in self.rng.tolist())
        g.manual_seed((seed * 1_000_003 + int(self.step) * 7919 + stream) % (2**63 - 1))
        return g


def _apply_gradients(state: TrainState, grads: Any) -> TrainState:
    from dsfn.optim.base import step as optim_step
    if tree.structure(grads) != tree.structure(state.params):
        raise LeafTypeError("apply_gradients: grads do not have the structure of params "
                            f"(grads: {tree.structure(grads)}, params: {tree.structure(state.params)})")
    params, opt_state = optim_step(state.tx, grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def check_buffers(buffers: Any) -> dict:
    """`buffers` as a flat dict name -> tensor (None: empty), or a LeafTypeError."""
    if buffers is None:
        return {}
    if not isinstance(buffers, dict):
        raise LeafTypeError(f"buffers must be a dict name -> tensor (apply_fn.buffers), got {type(buffers).__name__}")
    for name, t in buffers.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise LeafTypeError(f"buffers[{name!r}] is a {type(t).__name__}; buffers map names to tensors "
                                "(pass apply_fn.buffers from dsfn.functionalize)")
    return dict(buffers)


def check_tensor_leaves(t: Any, what: str) -> None:
    """Raise LeafTypeError naming the first leaf of `t` that is not a tensor."""
    for path, x in tree.leaves_with_path(t):
        if not isinstance(x, torch.Tensor):
            raise LeafTypeError(f"{what} leaf {path or '<root>'!r} is a {type(x).__name__}; dsfn needs "
                                "torch.Tensor leaves here (wrap numbers with torch.tensor)")


# The step counters of states `create` made, until a Step places them: a state that still
# holds one never went through `Step.place` (its leaves are the logical, unplaced ones).
# Keyed by id with a weak reference, so a freed counter's entry goes with it.
_FRESH: dict[int, weakref.ref] = {}


def never_placed(state: Any) -> bool:
    """Whether `state` is (a `replace` of) a `TrainState.create` result no Step has placed."""
    step = getattr(state, "step", None)
    ref = _FRESH.get(id(step)) if isinstance(step, torch.Tensor) else None
    return ref is not None and ref() is step


def mark_placed(state: Any) -> Any:
    """`state` with a step counter of its own (not the fresh one `create` made), so
    `never_placed` is False for it and still True for the logical state it came from."""
    if never_placed(state):
        return state.replace(step=state.step.clone())
    return state
