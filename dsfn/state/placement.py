"""Rules over placed leaves and state trees: a leaf's layout and piece (`layout_of`, `data`,
`leaf_records`), logical <-> physical (`place`, `unplace`, `place_tree`, `gather_tree`),
layering a layout on a leaf (`shard_further`, `inner_view`), the stages' layouts
(`held_copies`, `stage_split`, `stage_piece_shape`, `sum_held_copies`) and the mirror rule
by which optimizer state follows its parameter (`mirrored_param`, `map_with_mirrors`).
"""
from __future__ import annotations

from typing import Any

import torch

from dsfn import tree
from dsfn.errors import LayoutError
from dsfn.placed import Placed, is_placed
from dsfn.runtime import collectives as C
from dsfn.runtime.mesh import Mesh
from dsfn.state.layout_base import Layout, Nested, Replicated
from dsfn.state.split_layouts import StageOwned


def layout_of(x: Any) -> Layout:
    return x.layout if isinstance(x, Placed) else Replicated(tuple(x.shape) if isinstance(x, torch.Tensor) else ())


def leaf_records(state: Any) -> list[tuple[str, Layout, tuple[int, ...], torch.dtype, int]]:
    """(path, layout, local shape, dtype, bytes) of every tensor leaf of `state`, the pieces
    this rank holds (`Step.explain`'s leaves; a meta piece counts the bytes it stands for:
    `dsfn.estimate` reads a meta state placed on a virtual mesh with it)."""
    out = []
    for path, x in tree.leaves_with_path(state, is_leaf=is_placed):
        t = x.data if isinstance(x, Placed) else x
        if isinstance(t, torch.Tensor):
            out.append((path, layout_of(x), tuple(t.shape), t.dtype, t.numel() * t.element_size()))
    return out


def place(full: torch.Tensor, layout: Layout, mesh: Mesh | None = None) -> Any:
    """Logical tensor -> this rank's physical leaf (a plain tensor when replicated)."""
    if isinstance(layout, Replicated):
        return full
    return Placed(layout.shard(full, mesh), layout)


def unplace(x: Any, mesh: Mesh | None = None) -> Any:
    """Physical leaf -> logical tensor (collective for sharded layouts)."""
    return x.layout.unshard(x.data, mesh) if isinstance(x, Placed) else x


def place_tree(logical: Any, layouts: Any, mesh: Mesh | None = None) -> Any:
    """Apply a tree of layouts (same structure as `logical`) leaf by leaf."""
    return tree.map(lambda x, l: place(x, l, mesh), logical, layouts,
                    is_leaf=lambda x: isinstance(x, Layout))


def gather_tree(physical: Any, mesh: Mesh | None = None) -> Any:
    """Every Placed leaf back to its logical tensor; plain leaves pass through."""
    return tree.map(lambda x: unplace(x, mesh), physical, is_leaf=is_placed)


def held_copies(layout: Any) -> StageOwned | None:
    """The StageOwned of a leaf held as copies by several stages (a tied embedding and
    head), directly or as the inner layout of a Nested (ZeRO's shard of it), else None.
    Each owner's gradient of such a leaf is a part (its own stage's uses): the update
    needs their sum over `axis`, which whoever takes the gradients over forms."""
    while isinstance(layout, Nested):
        layout = layout.inner
    return layout if isinstance(layout, StageOwned) and len(layout.owners) > 1 else None


def stage_split(layout: Any) -> tuple[StageOwned | None, Any]:
    """(the StageOwned, the layout inside the stage or None) of a leaf's layout: `StageOwned`
    itself, or `Nested(StageOwned, inner)` (the stage's tensor split further inside the stage,
    e.g. tensor_parallel's DimShard); (None, None) for any other layout."""
    if isinstance(layout, StageOwned):
        return layout, None
    if isinstance(layout, Nested) and isinstance(layout.inner, StageOwned):
        return layout.inner, layout.outer
    return None, None


def stage_piece_shape(layout: Any) -> tuple[int, ...]:
    """The shape of an owner's piece of a leaf laid out by stages, seen from any rank along
    the stages' axis: `StageOwned`'s whole tensor, or for `Nested(StageOwned, X)` (the stage's
    tensor split further inside the stage: tensor_parallel's DimShard) this rank's piece of X
    (X's axes lie inside a stage, so a non-owner's coordinates give an owner's piece)."""
    owned, inner = stage_split(layout)
    if owned is None:
        raise LayoutError(f"stage_piece_shape: {layout!r} is not a stage's layout (StageOwned, or Nested with a "
                          "StageOwned inside)")
    return tuple(inner.local_shape()) if inner is not None else tuple(owned.shape)


def shard_further(x: Any, make: Any) -> Placed:
    """Put the layout `make(shape)` on top of whatever layout leaf `x` has: `shape` is the
    shape of x's local piece; a placed leaf becomes `Nested(its layout, make(shape))`."""
    if isinstance(x, Placed):
        outer = make(tuple(x.data.shape))
        return Placed(outer.shard(x.data), Nested(x.layout, outer))
    layout = make(tuple(x.shape))
    return Placed(layout.shard(x), layout)


def inner_view(x: Any, piece: torch.Tensor) -> Any:
    """`piece` (x's outer layer undone, e.g. gathered over dp) as the transforms inside see it:
    a Placed with the inner layout for a Nested leaf, else the plain tensor."""
    if isinstance(x, Placed) and isinstance(x.layout, Nested):
        return Placed(piece, x.layout.inner)
    return piece


def data(x: Any) -> Any:
    """The local tensor of a leaf, placed or not."""
    return x.data if isinstance(x, Placed) else x


def mirrored_param(path: str, shape: tuple[int, ...] | None, param_shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The parameter an optimizer-state leaf mirrors: the longest dotted suffix of its
    `path` that names a parameter of the same (logical) `shape` (Adam's `mu.<name>`,
    mixed precision's `master.<name>` -> `<name>`). The one rule by which ZeRO shards,
    offload moves and zenflow masks optimizer state along with its parameter."""
    if shape is None:
        return None
    parts = path.split(".")
    for k in range(len(parts)):
        name = ".".join(parts[k:])
        s = param_shapes.get(name)
        if s is not None and tuple(s) == tuple(shape):
            return name
    return None


def map_with_mirrors(state: Any, fn: Any, params: bool = True) -> Any:
    """`state` with `fn(owner, leaf) -> new leaf` applied to every parameter (`owner`: its own
    path) and to every optimizer-state leaf that mirrors one (`owner`: the parameter's path,
    by `mirrored_param` on the leaves' logical shapes as they are before this call), so a
    parameter and its mirrors always take one layout. With `params=False` only the mirrors
    are mapped. Leaves that mirror nothing (step counts, scalars) are left as they are."""
    shapes = {p: _logical_shape_of(x) for p, x in tree.leaves_with_path(state.params, is_leaf=is_placed)}

    def mirror(path: str, x: Any) -> Any:
        if not isinstance(x, (torch.Tensor, Placed)):
            return x
        owner = mirrored_param(path, _logical_shape_of(x), shapes)
        return x if owner is None else fn(owner, x)
    new_params = tree.map_with_path(fn, state.params, is_leaf=is_placed) if params else state.params
    opt = getattr(state, "opt_state", None)
    new_opt = tree.map_with_path(mirror, opt, is_leaf=is_placed) if opt is not None else opt
    return state.replace(params=new_params, opt_state=new_opt)


def _logical_shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)


def sum_held_copies(parts: list[torch.Tensor], copies: list[StageOwned],
                     owner_numel: list[int]) -> list[torch.Tensor]:
    """The one sum of a tied leaf's gradient parts over the stages that hold copies of it (a
    tied embedding and head: `held_copies`), so every copy takes the same update. `parts[k]`:
    this rank's gradient of leaf k (an owner's part, or a non-owner's empty tensor),
    `copies[k]` its StageOwned, `owner_numel[k]` the elements of an owner's part (a non-owner
    joins with that many zeros: the owners' parts are alike, the same coordinates inside the
    stage). Every rank along each copies' axis joins one all-reduce per (axis, dtype), in the
    order given; an owner gets the sum in its part's shape, a non-owner its part back."""
    todo: dict[tuple[str, torch.dtype], list[int]] = {}
    for k, (part, owned) in enumerate(zip(parts, copies)):
        todo.setdefault((owned.axis, part.dtype), []).append(k)
    out = list(parts)
    for (axis, dtype), ks in todo.items():
        flat_parts = [parts[k].reshape(-1) if copies[k].holds() else
                      torch.zeros(owner_numel[k], dtype=dtype, device=parts[k].device) for k in ks]
        flat = C.all_reduce_(torch.cat(flat_parts), axis, "sum")
        at = 0
        for k, part in zip(ks, flat_parts):
            if copies[k].holds():
                out[k] = flat[at:at + part.numel()].view_as(parts[k]).clone()
            at += part.numel()
    return out
