"""Stack facts: what a stack of transforms implies, derived once per stack, read-only.

Transforms meet through primitives and through these facts, never through each other's
attributes. Each transform publishes plain facts about itself (`Transform.facts()`: a
dict of plain values — a mesh axis name, a dtype, a stage, a bucket size — fixed by its
options); `StackFacts(stack)` records them beside each transform's position and roles
when a Step is made. While the Step runs (or places, or gathers), a transform's handlers
read the facts of the *running* stack with `stack_facts(self)`:

    facts = stack_facts(self)
    facts.inside(self).first("reduce_dtype")     # a fact of the transforms inside this one
    facts.outside(self).has_role("zero")         # a role of the transforms outside it
    facts.grad_wire_dtype                        # a fact of the whole stack, computed once

Composing never writes to a transform: the same transform object composed into N stacks
behaves in each as that stack says (tests/transforms/test_stack_facts.py). Facts are
structural (fixed by the options): what depends on the mesh (an axis of size 1) is asked
of the runtime when the step runs.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

import torch

from dsfn.effects import active_segments

__all__ = ["FactView", "StackFacts", "stack_facts"]


class FactView:
    """The published facts of some transforms of a stack (outermost first)."""

    __slots__ = ("_decl",)

    def __init__(self, decl: Iterable[Mapping[str, Any]]):
        self._decl = tuple(decl)

    def first(self, key: str, default: Any = None) -> Any:
        """The value of fact `key` of the outermost transform here that publishes it."""
        for d in self._decl:
            if key in d:
                return d[key]
        return default

    def all(self, key: str) -> tuple:
        """Every value of fact `key` here, outermost first."""
        return tuple(d[key] for d in self._decl if key in d)

    def has_role(self, role: str) -> bool:
        return any(role in d["roles"] for d in self._decl)

    def with_role(self, role: str) -> tuple[Mapping[str, Any], ...]:
        """The facts of the transforms here that declare `role`, outermost first."""
        return tuple(d for d in self._decl if role in d["roles"])

    def __len__(self) -> int:
        return len(self._decl)


class StackFacts:
    """The facts of one stack (module docstring). Frozen: built once, then only read."""

    __slots__ = ("_decl", "_at", "grad_wire_dtype", "grads_keep_dtype", "__weakref__")

    def __init__(self, stack: Sequence[Any]):
        decl, at = [], {}
        for i, t in enumerate(stack):
            own = dict(t.facts())
            own.update(name=t.name, roles=frozenset(t.roles))
            decl.append(MappingProxyType(own))
            at.setdefault(id(t), i)
        object.__setattr__(self, "_decl", tuple(decl))
        object.__setattr__(self, "_at", MappingProxyType(at))
        whole = FactView(decl)
        # the dtype gradients travel in over every gradient reduction (dp, tp, sp), and whether
        # the reduced gradients go back to their own dtype (communication only: DeepSpeed's
        # communication_data_type for fp32 training) or stay in it (mixed precision's grads)
        object.__setattr__(self, "grad_wire_dtype", whole.first("grad_wire_dtype"))
        object.__setattr__(self, "grads_keep_dtype", bool(whole.first("grads_keep_dtype", False)))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("StackFacts are read-only")

    def _index(self, t: Any) -> int:
        try:
            return self._at[id(t)]
        except KeyError:
            raise LookupError(f"{getattr(t, 'name', t)!r} is not in this stack") from None

    def inside(self, t: Any) -> FactView:
        """The facts of the transforms inside `t` (after it in the stack)."""
        return FactView(self._decl[self._index(t) + 1:])

    def outside(self, t: Any) -> FactView:
        """The facts of the transforms outside `t` (before it in the stack)."""
        return FactView(self._decl[:self._index(t)])

    @property
    def whole(self) -> FactView:
        return FactView(self._decl)

    def to_wire(self, g: Any) -> Any:
        """Gradient `g` in the dtype it travels in over a reduction (itself when no wire
        dtype is set, or `g` is not a floating tensor)."""
        wire = self.grad_wire_dtype
        if wire is None or not isinstance(g, torch.Tensor) or g.dtype == wire or not g.is_floating_point():
            return g
        return g.to(wire)

    def from_wire(self, reduced: Any, dtype: torch.dtype) -> Any:
        """A reduced gradient back in `dtype` (the gradient's own) where the stack reduces in
        another dtype for communication only (`grads_keep_dtype`): accumulation and the
        update stay in the parameters' precision."""
        if not self.grads_keep_dtype or not isinstance(reduced, torch.Tensor) or reduced.dtype == dtype:
            return reduced
        return reduced.to(dtype)


def stack_facts(t: Any) -> StackFacts:
    """The facts of the innermost running stack that holds transform `t` (a Step's place,
    gather or call; or an `activate` block, whose facts are derived on first use). Outside
    any: the facts of `t` alone."""
    for seg in active_segments():
        if any(x is t for x in seg.stack):
            if seg.facts is None:
                seg.facts = StackFacts(seg.stack)
            return seg.facts
    return StackFacts((t,))
