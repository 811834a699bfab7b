"""`Placed`: a physical leaf — this rank's piece of a logical tensor under a layout.

Plain data, below every floor that handles state (optimizers, transforms, checkpoints):
`Placed(data, layout)` is a pytree node whose one child is the tensor and whose layout
(`dsfn.state.layout`: Replicated, FlatShard, DimShard, Nested, Offloaded, ...) rides in
the tree structure. The layouts themselves live in `dsfn.state.layout`, which re-exports
these names.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from dsfn import tree

__all__ = ["Placed", "data_of", "is_placed"]


@dataclass(frozen=True, init=False)
class Placed:
    """A physical leaf: this rank's `data` under `layout`. A pytree node, not a leaf."""
    data: torch.Tensor
    layout: Any            # a dsfn.state.layout.Layout
    # its pytree flattening ((data,), layout), made once: optree reads it through a C-level
    # attrgetter, so flattening a state of Placed leaves runs no Python per leaf
    _flat: tuple = field(init=False, repr=False, compare=False)

    def __init__(self, data: torch.Tensor, layout: Any):
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_flat", ((data,), layout))


tree.register_node(Placed, operator.attrgetter("_flat"), lambda layout, children: Placed(children[0], layout))


def is_placed(x: Any) -> bool:
    return isinstance(x, Placed)


def data_of(x: Any) -> Any:
    """A leaf's tensor: a Placed piece's data, or the leaf itself."""
    return x.data if isinstance(x, Placed) else x
