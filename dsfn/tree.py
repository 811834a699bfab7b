"""Pytree helpers: every pytree operation in dsfn goes through here.

optree only sees a registered dataclass (TrainState, optimizer states, Placed leaves)
when called with the namespace it was registered under; a call without it silently
treats the whole object as one leaf. Pinning the namespace in one module removes that
failure mode.

Leaves are `torch.Tensor`s (and `None` is an empty subtree, as in optree).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import optree

NAMESPACE = "dsfn"

PyTree = Any
TreeSpec = optree.PyTreeSpec


def flatten(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], TreeSpec]:
    """Leaves in a deterministic order (dict keys sorted) and the structure."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def unflatten(spec: TreeSpec, leaves: Iterable[Any]) -> PyTree:
    return optree.tree_unflatten(spec, list(leaves))


def leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def structure(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> TreeSpec:
    return optree.tree_structure(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree,
        is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """`fn` over corresponding leaves; all trees must share `tree`'s structure."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def map_with_path(fn: Callable[..., Any], tree: PyTree, *rest: PyTree,
                  is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """Like `map`, with the leaf's dotted path string ("layers.0.weight") as first argument."""
    return optree.tree_map_with_path(lambda p, *xs: fn(path_str(p), *xs), tree, *rest,
                                     is_leaf=is_leaf, namespace=NAMESPACE)


def leaves_with_path(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[tuple[str, Any]]:
    paths, leaves_, _ = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return [(path_str(p), x) for p, x in zip(paths, leaves_)]


def path_str(path: Sequence[Any]) -> str:
    return ".".join(str(k) for k in path)


def dataclass(cls=None, /, **kwargs):
    """A frozen dataclass registered as a pytree node under dsfn's namespace.

    Fields marked with `static_field()` are metadata (part of the structure, not leaves).
    """
    def wrap(c):
        kwargs.setdefault("frozen", True)
        return optree.dataclasses.dataclass(c, namespace=NAMESPACE, **kwargs)
    return wrap if cls is None else wrap(cls)


def static_field(**kwargs) -> Any:
    """A dataclass field that is structure (hashable metadata), not a child."""
    return optree.dataclasses.field(pytree_node=False, **kwargs)


def field(**kwargs) -> Any:
    return optree.dataclasses.field(**kwargs)


def replace(obj: Any, **changes: Any) -> Any:
    """A copy of a frozen dataclass with some fields changed."""
    return dataclasses.replace(obj, **changes)


def register_node(cls: type, flatten_fn: Callable, unflatten_fn: Callable) -> None:
    """Register a custom node type (flatten_fn(x) -> (children, aux), unflatten_fn(aux, children))."""
    optree.register_pytree_node(cls, flatten_fn, unflatten_fn, namespace=NAMESPACE)
