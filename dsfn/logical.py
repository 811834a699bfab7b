"""Values of the logical whole, for code that runs on this rank's pieces.

Inside a Step, the code a stack wraps (an optimizer chain, a parameter-group mask, a
user's transformation) sees the state's leaves as this rank holds them: a plain tensor
(replicated: every rank holds the whole) or a `Placed` piece (a ZeRO flat shard, a
tensor-parallel slice, an offloaded copy) whose layout says which part of the logical
tensor it is. Elementwise work runs on pieces unchanged. Anything that needs a value of
the *whole* goes through one of two primitives, which the transforms owning the
layouts answer (`dsfn.effects`):

- `reduce_leaves(partials, leaves, op)` — per-leaf reductions (sums of squares for a
  global norm, a max for an inf-norm, a count). The caller reduces its local piece
  of leaf i to `partials[i]`; each transform that owns a mesh axis some leaves are split
  over (ZeRO and data parallel: dp; tensor parallel: tp) combines those leaves'
  partials over its axis. Every element is counted once over every axis it is split
  on; a replicated leaf is counted once, and so is a piece that several ranks of an
  axis hold as replicas (`Layout.duplicate`: only the lowest of them contributes). The
  contract on `op`: "sum" for a sum of `f(x)` with `f(0) == 0`, "max" for a max of
  values >= 0 (layouts pad pieces with zeros, which must not change the result).
- `map_whole(fn, leaves)` — a non-elementwise function of whole tensors (Muon's
  Newton-Schulz): `fn(i, whole_i) -> new whole_i` (same shape and dtype); the result
  comes back as this rank's piece, in leaf i's layout. ZeRO computes each whole tensor
  once, on an owner rank; tensor parallel gathers its slices.

A leaf split over an axis that no transform of the running stack answers (e.g. a placed
state used outside its Step) raises `LayoutError` — a value of one piece never stands
in for the whole. Outside a Step, plain tensors are whole and both primitives are plain
local computations.

Helpers for such code: `leaves(tree)` (pieces kept whole, not flattened into their
data), `local(x)`, `like(x, data)`, `logical_view(tree)` (meta tensors of the logical
shapes, for decisions made on paths and shapes: masks, parameter groups).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dsfn import tree
from dsfn.effects import active_stack, bind
from dsfn.errors import LayoutError
from dsfn.placed import Placed, is_placed

__all__ = ["global_norm", "leaves", "leaves_with_path", "like", "local", "logical_shape", "logical_view",
           "map_whole", "reduce_leaves", "split_axes"]


def leaves(t: Any) -> list[Any]:
    """The leaves of `t` with each `Placed` piece kept as one leaf (flatten order)."""
    return tree.leaves(t, is_leaf=is_placed)


def leaves_with_path(t: Any) -> list[tuple[str, Any]]:
    """`(dotted path, leaf)` with `Placed` pieces as leaves: the parameter's own path."""
    return tree.leaves_with_path(t, is_leaf=is_placed)


def local(x: Any) -> torch.Tensor:
    """This rank's tensor of a leaf (a piece's data, or the tensor itself)."""
    return x.data if isinstance(x, Placed) else x


def like(x: Any, data: torch.Tensor) -> Any:
    """`data` in `x`'s layout (a piece stays a piece; a plain tensor stays plain)."""
    return Placed(data, x.layout) if isinstance(x, Placed) else data


def logical_shape(x: Any) -> tuple[int, ...]:
    return tuple(x.layout.shape) if isinstance(x, Placed) else tuple(x.shape)


def split_axes(x: Any) -> tuple[str, ...]:
    """The mesh axes a leaf's piece is split over (() for a whole tensor)."""
    return tuple(x.layout.axes()) if isinstance(x, Placed) else ()


def logical_view(t: Any) -> Any:
    """`t` with every piece replaced by a meta tensor of its logical shape and dtype (plain
    tensors stay): what masks and group labels are decided on, so a choice made on a
    ZeRO flat shard is the choice made on the matrix."""
    return tree.map(lambda x: torch.empty(x.layout.shape, dtype=x.data.dtype, device="meta")
                    if isinstance(x, Placed) else x, t, is_leaf=is_placed)


# ---------------------------------------------------------------------------------------
# primitives


def reduce_leaves(partials: Sequence[torch.Tensor], pieces: Sequence[Any], op: str = "sum") -> list[torch.Tensor]:
    """Per-leaf values of the logical whole from this rank's partials (see the module docstring).

    `partials[i]` is a tensor (any shape, typically 0-dim) computed from `local(pieces[i])`;
    the result's entry i has its shape and dtype and equals, on every rank, what the
    reduction over the whole tensor i gives. Collective when any piece is split: every
    rank calls it with the same number of leaves and layouts.
    """
    if op not in ("sum", "max"):
        raise LayoutError(f"reduce_leaves(op={op!r}): use 'sum' or 'max'")
    if len(partials) != len(pieces):
        raise LayoutError(f"reduce_leaves: {len(partials)} partials for {len(pieces)} leaves")
    pending = [split_axes(x) for x in pieces]
    if not any(pending) and not active_stack():
        return list(partials)
    # a replica (GroupDimShard: tp's shared k/v heads) is counted by the lowest rank holding it
    # only; 0 is neutral for both ops ("max" is over values >= 0)
    partials = [torch.zeros_like(p) if isinstance(x, Placed) and x.layout.duplicate() else p
                for p, x in zip(partials, pieces)]
    # through the handlers even for whole tensors: a transform that hands the optimizer
    # something other than whole leaves (zenflow's column selections) refuses here
    return bind("reduce_leaves", _unanswered_reduce, list(partials), pending, op)


def _unanswered_reduce(partials: list, pending: list, op: str) -> list:
    left = sorted({a for axes in pending for a in axes})
    if left:
        raise LayoutError(
            f"a reduction over the whole of sharded leaves (a global norm, clipping, a tree-wide value) reached "
            f"pieces split over mesh axis {left} that no transform of the running stack owns. Run the optimizer "
            "inside the Step whose transforms placed the state (state, metrics = step(state, batch)), or gather "
            "the state first (step.gather(state))")
    return partials


def map_whole(fn: Callable[[int, torch.Tensor], torch.Tensor], pieces: Sequence[Any]) -> list[Any]:
    """`fn(i, whole_i)` for every leaf, returned as this rank's pieces in the leaves' layouts.

    `fn` must give a tensor of whole_i's shape and dtype (on whole_i's device), and be
    deterministic: under tensor parallel every rank of a tp group computes it. Collective
    when any piece is split. On a tensor of more than 2 dims, `fn` acts on each dim-0 index
    alone (a stack of matrices: Muon's batched NS on stacked experts `[E, out, in]`), so
    expert parallel runs it on this rank's experts only.
    """
    pieces = list(pieces)
    if not any(isinstance(x, Placed) for x in pieces) and not active_stack():
        return [fn(i, x) for i, x in enumerate(pieces)]
    return bind("map_whole", _whole_default, fn, pieces)


def _whole_default(fn: Callable, pieces: list) -> list:
    out = []
    for i, x in enumerate(pieces):
        if isinstance(x, Placed) and x.layout.axes():
            raise LayoutError(
                f"a whole-tensor function (e.g. Muon's orthogonalisation) got a piece laid out as {x.layout!r}, "
                "which no transform of the running stack can assemble. Run the optimizer inside the Step that "
                "placed the state, or use an elementwise optimizer for this parameter")
        out.append(like(x, fn(i, local(x))))
    return out


def global_norm(t: Any) -> torch.Tensor:
    """The 2-norm of every logical element of `t` (pieces counted once), a 0-dim tensor.

    Computed like torch's `clip_grad_norm_`: the 2-norm of the per-leaf norms, in the
    promoted dtype of the leaves, on the first leaf's device. An empty tree gives 0.
    Collective when a leaf is a split piece (through `reduce_leaves`).
    """
    xs = [x for x in leaves(t) if isinstance(x, (torch.Tensor, Placed))]
    if not xs:
        return torch.zeros(())
    data = [local(x) for x in xs]
    first = data[0].device
    norms = [n.to(first) for n in torch._foreach_norm(data, 2)]
    if any(isinstance(x, Placed) and x.layout.axes() for x in xs):
        sq = reduce_leaves([n.double().square() for n in norms], xs, "sum")
        norms = [s.sqrt().to(n.dtype) for s, n in zip(sq, norms)]
    elif active_stack():
        reduce_leaves([n.square() for n in norms], xs, "sum")    # whole leaves: the transforms may refuse
    return torch.linalg.vector_norm(torch.stack(norms), 2)
