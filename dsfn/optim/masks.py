"""Apply a transform to some leaves only: `masked`, `partition`, and mask helpers.

A mask is either a pytree of bools with the structure of params, or a callable
`(path: str, leaf: Tensor) -> bool` where `path` is the dotted leaf path
("blocks.0.attn.qkv.weight"). A callable mask is evaluated once, at `init`, on the
params; the resulting per-leaf choice is kept in the state as static structure (not
leaves), so every later update uses the same leaves even if the layout of the tensors
changes (e.g. flat shards). The choice is made on logical paths and shapes, so it is the
same when `init` runs on this rank's pieces (`Step.init_state` under ZeRO, tensor
parallel or offload) as on the whole parameters. The inner transform sees a tree whose unselected leaves are
`None` (an empty subtree), so its state holds nothing for them.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Hashable, Literal, Mapping, Union

import torch

from dsfn import logical, tree
from dsfn.errors import ConfigError, LeafTypeError
from dsfn.optim.base import GradientTransformation, PyTree, tensor_leaves
from dsfn.placed import is_placed

MaskFn = Callable[[str, torch.Tensor], bool]
Mask = Union[PyTree, MaskFn]


def by_name(*patterns: str) -> MaskFn:
    """Mask: True where the dotted path matches any glob (fnmatch, case-sensitive; `*` crosses dots)."""
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"by_name{patterns!r}: pass one or more glob strings, e.g. by_name('*.bias', '*norm*')")

    def mask(path: str, leaf: Any) -> bool:
        return any(fnmatch.fnmatchcase(path, p) for p in patterns)
    mask.__name__ = f"by_name{patterns!r}"
    return mask


def by_ndim(min_ndim: int) -> MaskFn:
    """Mask: True for leaves with `ndim >= min_ndim` (by_ndim(2): matrices, not biases/norm scales)."""
    if isinstance(min_ndim, bool) or not isinstance(min_ndim, int) or min_ndim < 0:
        raise ConfigError(f"by_ndim({min_ndim!r}): pass a non-negative integer, e.g. by_ndim(2)")

    def mask(path: str, leaf: Any) -> bool:
        return leaf.dim() >= min_ndim
    mask.__name__ = f"by_ndim({min_ndim})"
    return mask


def evaluate_mask(sel: Any, params: PyTree, kind: str, check: Callable[[Any], Any]) -> tuple:
    """Per-leaf values of a mask/labels callable or pytree, in flatten order of params.

    Decided on the *logical* parameters (`dsfn.logical.logical_view`): a callable sees each
    parameter's own dotted path and a tensor of its logical shape and dtype, even when
    `params` holds this rank's pieces (ZeRO shards, tp slices, offloaded copies), so
    `by_ndim(2)` and `by_name("*.bias")` choose the same leaves under every stack."""
    tensor_leaves(params, "params")
    view = logical.logical_view(params)
    named = logical.leaves_with_path(view)
    if callable(sel):
        return tuple(check(sel(path, x)) for path, x in named)
    sel_leaves, sel_spec = tree.flatten(sel)
    spec = tree.structure(view)
    if sel_spec != spec:
        raise ConfigError(f"the {kind} tree does not have the structure of params ({sel_spec} vs {spec}); pass a "
                          f"tree with one {kind} value per parameter, or a callable (path, leaf) -> value")
    return tuple(check(v) for v in sel_leaves)


def as_bool(v: Any) -> bool:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dtype == torch.bool:
        return bool(v)
    if not isinstance(v, bool):
        raise ConfigError(f"mask value {v!r} is not a bool; a mask gives True (transform this leaf) or False")
    return v


def _pieces(t: PyTree, what: str) -> tuple[list, tree.TreeSpec]:
    """Leaves of `t` with each sharded piece (`Placed`) kept whole, and the structure."""
    tensor_leaves(t, what)
    return tree.flatten(t, is_leaf=is_placed)


def _update_leaves(who: str, updates: PyTree, params: PyTree, n_state: int) -> tuple:
    """(update leaves, param leaves or None, spec), checked against a state made for n_state leaves."""
    u, spec = _pieces(updates, "updates")
    if n_state != len(u):
        raise LeafTypeError(f"{who}: the state was made for {n_state} leaves, the updates have {len(u)}; "
                            "init the optimizer with the same params tree")
    if params is None:
        return u, None, spec
    p, p_spec = _pieces(params, "params")
    if p_spec != spec:
        raise LeafTypeError(f"{who}: params and updates differ in structure ({p_spec} vs {spec})")
    return u, p, spec


def _select(leaves: list, keep: tuple, spec: tree.TreeSpec) -> PyTree:
    return tree.unflatten(spec, [x if k else None for x, k in zip(leaves, keep)])


def _zeros_like(x: Any) -> Any:
    return logical.like(x, torch.zeros_like(logical.local(x)))


@tree.dataclass
class MaskedState:
    """inner: the inner transform's state (over the selected leaves only).
    mask (static): per-leaf bool in params' flatten order."""
    inner: Any
    mask: tuple = tree.static_field(default=())


def masked(inner: GradientTransformation, mask: Mask,
           others: Literal["zero", "pass"] = "zero") -> GradientTransformation:
    """Apply `inner` to the leaves where `mask` is True.

    Unselected leaves get a zero update (`others="zero"`, they stay frozen) or their
    incoming update unchanged (`others="pass"`, optax's `masked`: use this inside a chain,
    e.g. `masked(add_decayed_weights(0.1), by_ndim(2), others="pass")`). Either way the
    inner transform keeps no state for them.
    """
    if not isinstance(inner, GradientTransformation):
        raise ConfigError(f"masked(inner=...) takes a GradientTransformation, got {type(inner).__name__}")
    if others not in ("zero", "pass"):
        raise ConfigError(f"masked(others={others!r}): use 'zero' (freeze unselected leaves) or 'pass' "
                          "(leave their updates unchanged)")

    def init(params: PyTree) -> MaskedState:
        keep = evaluate_mask(mask, params, "mask", as_bool)
        leaves, spec = _pieces(params, "params")
        return MaskedState(inner=inner.init(_select(leaves, keep, spec)), mask=keep)

    def update(updates: PyTree, state: MaskedState, params: PyTree = None) -> tuple[PyTree, MaskedState]:
        keep = state.mask
        u, p, spec = _update_leaves("masked", updates, params, len(keep))
        sub_p = None if p is None else _select(p, keep, spec)
        sub_u, inner_state = inner.update(_select(u, keep, spec), state.inner, sub_p)
        it = iter(logical.leaves(sub_u))
        out = [next(it) if k else (_zeros_like(x) if others == "zero" else x) for x, k in zip(u, keep)]
        return tree.unflatten(spec, out), MaskedState(inner=inner_state, mask=keep)

    return GradientTransformation(init, update)


@tree.dataclass
class PartitionState:
    """inner: {label: that label's transform state}.
    labels (static): per-leaf label in params' flatten order."""
    inner: dict
    labels: tuple = tree.static_field(default=())


def partition(transforms: Mapping[Hashable, GradientTransformation],
              labels: Union[PyTree, Callable[[str, torch.Tensor], Hashable]]) -> GradientTransformation:
    """Route each leaf to `transforms[label]` (optax's `multi_transform`).

    `labels` is a pytree of labels shaped like params, or a callable `(path, leaf) -> label`.
    Each transform sees only its leaves (the rest are None) and keeps state only for them.
    E.g. no weight decay on biases and norms:
    `partition({"decay": adamw(lr, weight_decay=0.1), "no_decay": adamw(lr, weight_decay=0.0)},
    lambda path, x: "decay" if x.dim() >= 2 else "no_decay")`.
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise ConfigError("partition(transforms=...) takes a non-empty dict {label: GradientTransformation}")
    for k, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise ConfigError(f"partition: transforms[{k!r}] is a {type(t).__name__}, not a GradientTransformation")
    txs = dict(transforms)

    def check_label(v: Any) -> Hashable:
        if v not in txs:
            raise ConfigError(f"partition: label {v!r} has no transform; known labels: {sorted(map(repr, txs))}. "
                              "Add it to the transforms dict or fix the labels")
        return v

    def init(params: PyTree) -> PartitionState:
        labs = evaluate_mask(labels, params, "labels", check_label)
        leaves, spec = _pieces(params, "params")
        inner = {k: t.init(_select(leaves, tuple(x == k for x in labs), spec)) for k, t in txs.items()}
        return PartitionState(inner=inner, labels=labs)

    def update(updates: PyTree, state: PartitionState, params: PyTree = None) -> tuple[PyTree, PartitionState]:
        labs = state.labels
        u, p, spec = _update_leaves("partition", updates, params, len(labs))
        out: list[Any] = list(u)
        new_inner = {}
        for k, t in txs.items():
            keep = tuple(x == k for x in labs)
            sub_u, new_inner[k] = t.update(_select(u, keep, spec), state.inner[k],
                                           None if p is None else _select(p, keep, spec))
            it = iter(logical.leaves(sub_u))
            for i, kk in enumerate(keep):
                if kk:
                    out[i] = next(it)
        return tree.unflatten(spec, out), PartitionState(inner=new_inner, labels=labs)

    return GradientTransformation(init, update)
