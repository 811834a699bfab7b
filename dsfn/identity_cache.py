"""Caches of per-structure work keyed by the identity of the objects it was made for.

dsfn redoes nothing that stays the same step after step: a gradient plan, a unit plan, a
frozen view, a mesh split. What such work depends on are *objects* handed on from step to
step (a mesh, a module, an `ApplyFn`, the leaves' layouts), so the caches here compare
their keys the cheap way, never calling a Python `__eq__` on a hit:

- `same`: a tuple of objects compared element by element **by identity** (`is`). Another
  object of equal value is a miss (a new mesh, a new module of the same shape).
- `equal` (optional): a value compared with `==`. Lists (or tuples) of the same objects as
  last time compare equal without a Python call per element: a list comparison checks
  identity first. Use it for "these leaves' layouts", "these names", a `TreeSpec`.

A value is made (`make()`, a callable taking no argument) on the first `get` and again on
every miss: when any `same` object is not the one held, or `equal` differs. A hit costs one
Python call (`get` itself); the comparisons run in C (`map(operator.is_, ...)`, `==`).

Lifetimes, chosen per cache (the one each hand-rolled cache had before):

- strong (default): the cache holds its `same` objects (and its value) alive until they are
  replaced or `clear()`ed. An `IdentityCache` holds one key, the last one; a `KeyedCache`
  one per slot.
- `weak=True`: the `same` objects are held by weak reference, so the cache never keeps
  them alive; a dead one is a miss (never a false hit: a new object at the dead one's
  address is another object, and its weak reference no longer answers the old one).

`KeyedCache` holds several entries in a dict by a hashable `slot` (an `id(obj)`, or a
tuple with one, or `(axis, op)`): an id can be reused once its object is collected, so every
entry also holds its `same` objects, and a hit needs them to be the ones asked about (the
guard the hand-rolled `hit[0] is obj` was). `maxsize` bounds it: past that many slots the
oldest one is dropped (insertion order); None (default): unbounded, entries live until
replaced or cleared.
"""
from __future__ import annotations

import weakref
from operator import is_
from typing import Any, Callable, Hashable, Iterator

__all__ = ["IdentityCache", "KeyedCache"]

_deref = weakref.ref.__call__      # a C slot: dereferencing a held weak reference costs no Python call


class IdentityCache:
    """One slot: the value made for the last key (module docstring).

    `get(same, make, equal=None)` -> the value made for `same` (a tuple of objects, compared
    by identity) and `equal` (compared with `==`), made by `make()` on a miss. Strong by
    default (holds the last `same` objects alive); `weak=True` holds them by weak reference."""

    __slots__ = ("weak", "_same", "_equal", "_value")

    def __init__(self, *, weak: bool = False):
        self.weak = weak
        self._same: tuple | None = None
        self._equal: Any = None
        self._value: Any = None

    def get(self, same: tuple, make: Callable[[], Any], equal: Any = None) -> Any:
        held = self._same
        if held is not None and len(held) == len(same) and self._equal == equal and \
                all(map(is_, map(_deref, held) if self.weak else held, same)):
            return self._value
        value = make()
        self._same = tuple(map(weakref.ref, same)) if self.weak else tuple(same)
        self._equal, self._value = equal, value
        return value

    def clear(self) -> None:
        """Forget the held key and value (the next `get` makes it again)."""
        self._same = self._equal = self._value = None

    def __len__(self) -> int:
        return 0 if self._same is None else 1


class KeyedCache:
    """Several slots in a dict by `slot` (module docstring): `get(slot, same, make, equal=None)`
    -> the value made for `same` (objects compared by identity, held with the entry: the
    guard against an `id` reused after garbage collection) and `equal` (compared with `==`)
    in that slot, made by `make()` on a miss, which replaces the slot's entry. Strong by
    default; `weak=True` holds the `same` objects by weak reference. `maxsize`: the most
    slots held, the oldest dropped first (None: unbounded)."""

    __slots__ = ("weak", "maxsize", "_entries")

    def __init__(self, *, weak: bool = False, maxsize: int | None = None):
        if maxsize is not None and (isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1):
            raise ValueError(f"KeyedCache(maxsize={maxsize!r}): a slot count >= 1 or None")
        self.weak, self.maxsize = weak, maxsize
        self._entries: dict[Hashable, tuple] = {}     # slot -> (same, equal, value)

    def get(self, slot: Hashable, same: tuple, make: Callable[[], Any], equal: Any = None) -> Any:
        hit = self._entries.get(slot)
        if hit is not None and len(hit[0]) == len(same) and hit[1] == equal and \
                all(map(is_, map(_deref, hit[0]) if self.weak else hit[0], same)):
            return hit[2]
        value = make()
        entries = self._entries
        entries.pop(slot, None)           # a replaced entry becomes the newest
        entries[slot] = (tuple(map(weakref.ref, same)) if self.weak else tuple(same), equal, value)
        if self.maxsize is not None and len(entries) > self.maxsize:
            del entries[next(iter(entries))]
        return value

    def values(self) -> Iterator[Any]:
        """The values held, oldest first."""
        return (e[2] for e in list(self._entries.values()))

    def clear(self) -> None:
        """Forget every entry (the next `get` of each slot makes it again)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, slot: Hashable) -> bool:
        return slot in self._entries
