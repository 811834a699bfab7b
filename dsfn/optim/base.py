"""The optimizer protocol: `GradientTransformation`, `chain`, `identity`, `apply_updates`.

A `GradientTransformation` is a pair of pure functions (optax's protocol):

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

- `params`, `grads` and `updates` are pytrees of tensors with one structure (usually the
  `dict[str, Tensor]` from `dsfn.functionalize`); leaf i of `updates` has the shape of
  leaf i of `params`.
- Purity: `update` never writes to `grads`, `state` or `params`; it returns new tensors
  (it may return an input tensor unchanged, e.g. `identity`). In-place ops are used only
  on tensors a transform allocated itself in the same call. The exception is a donated
  step (`dsfn.aliasing.may_alias()`): there `apply`/`apply_updates` and the state
  updates of Adam and SGD momentum write their results into their inputs (the same
  kernels, so the same values); `update`'s returned updates are never affected.
- Every stateful transform keeps `count`, a 0-dim int64 tensor on the CPU, in its state:
  the number of updates it has made. It lives on the host, like `torch.optim`'s `step`,
  so reading it (bias corrections, schedules) never waits for a device.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from dsfn import tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.aliasing import writable

PyTree = Any
Params = Any
Updates = Any
OptState = Any

InitFn = Callable[[Params], OptState]
UpdateFn = Callable[[Updates, OptState, Params], "tuple[Updates, OptState]"]


class GradientTransformation(NamedTuple):
    """`init(params) -> state`; `update(grads, state, params) -> (updates, new_state)`.

    `apply` (optional) is a fast path with the same meaning as
    `update` followed by `apply_updates`: `apply(grads, state, params) -> (new_params,
    new_state)`. A transform that computes the new parameters directly (Adam) offers it
    to skip the `p' - p` / `p + u` round trip (two passes and an allocation per step).
    """
    init: InitFn
    update: UpdateFn
    apply: Callable[[Updates, OptState, Params], "tuple[Params, OptState]"] | None = None


def step(tx: GradientTransformation, grads: Updates, state: OptState, params: Params) -> tuple[Params, OptState]:
    """New params and state after one update: `tx.apply` when offered, else update + apply_updates."""
    if tx.apply is not None:
        return tx.apply(grads, state, params)
    updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


class EmptyState(NamedTuple):
    """State of a stateless transform (no leaves)."""


def zero_count() -> torch.Tensor:
    """A fresh step count: 0-dim int64 on the CPU (see the module docstring for why CPU)."""
    return torch.zeros((), dtype=torch.int64)


def tensor_leaves(t: PyTree, what: str) -> tuple[list[torch.Tensor], tree.TreeSpec]:
    """Flatten `t`, raising LeafTypeError naming the first leaf that is not a tensor."""
    leaves, spec = tree.flatten(t)
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            for path, y in tree.leaves_with_path(t):  # slow path only to name the leaf
                if not isinstance(y, torch.Tensor):
                    raise LeafTypeError(f"{what} leaf {path or '<root>'!r} is a {type(y).__name__}; dsfn.optim "
                                        "needs torch.Tensor leaves (wrap numbers with torch.tensor)")
    return leaves, spec


def flatten_like(t: PyTree, spec: tree.TreeSpec, what: str) -> list[torch.Tensor]:
    """`t`'s leaves, LeafTypeError unless `t` has the structure `spec` (of the updates)."""
    leaves, s = tree.flatten(t)
    if s != spec:
        raise LeafTypeError(f"{what} does not have the structure of the updates ({s} vs {spec}); pass the "
                            "state this transform's init/update returned for the same params tree")
    return leaves


def apply_updates(params: Params, updates: Updates) -> Params:
    """`params + updates` leaf by leaf; each result has its param's dtype.

    Shapes: leaf i of `updates` has the shape of leaf i of `params`. The sum is taken in
    the promoted dtype of the pair and cast back to the param's dtype (optax's rule).
    One foreach pass; inputs are not modified.
    """
    p_leaves, spec = tensor_leaves(params, "params")
    u_leaves, u_spec = tensor_leaves(updates, "updates")
    if u_spec != spec:
        raise LeafTypeError(f"apply_updates: updates do not have the structure of params ({u_spec} vs {spec})")
    if not p_leaves:
        return params
    if writable(p_leaves) and all(u.dtype == p.dtype for u, p in zip(u_leaves, p_leaves)):
        with torch.no_grad():                   # a donated step: p + u written into p (same kernel)
            torch._foreach_add_(p_leaves, u_leaves)
        return tree.unflatten(spec, p_leaves)
    out = torch._foreach_add(p_leaves, u_leaves)
    out = [o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(out, p_leaves)]
    return tree.unflatten(spec, out)


def identity() -> GradientTransformation:
    """Passes updates through unchanged (no state)."""
    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        return updates, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` in order: the updates of one are the input of the next.

    State: a tuple with one entry per transform, in the same order.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise ConfigError(f"chain() argument {i} is a {type(t).__name__}, not a GradientTransformation; "
                              "pass transforms such as dsfn.optim.scale_by_adam() or dsfn.optim.adamw(lr)")
    txs: Sequence[GradientTransformation] = tuple(transforms)

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in txs)

    def update(updates: Updates, state: tuple, params: Params = None) -> tuple[Updates, tuple]:
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise LeafTypeError(f"chain of {len(txs)} transforms got a state with "
                                f"{len(state) if isinstance(state, tuple) else type(state).__name__} entries; "
                                "pass the state returned by this chain's init/update")
        new_state = []
        for t, s in zip(txs, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    if txs and txs[-1].apply is not None:
        update_head = chain(*txs[:-1]).update if len(txs) > 1 else None

        def apply(updates: Updates, state: tuple, params: Params) -> tuple[Params, tuple]:
            # the last transform computes the new params directly (see GradientTransformation)
            if not isinstance(state, tuple) or len(state) != len(txs):
                update(updates, state, params)            # raises the clear error above
            head_state: tuple = ()
            if update_head is not None:
                updates, head_state = update_head(updates, state[:-1], params)
            new_params, last = txs[-1].apply(updates, state[-1], params)
            return new_params, tuple(head_state) + (last,)
        return GradientTransformation(init, update, apply)
    return GradientTransformation(init, update)
