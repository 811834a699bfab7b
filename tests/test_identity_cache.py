"""dsfn.identity_cache: hits on the same objects, misses on equal-valued others, the id
reuse guard, list keys compared by element identity first, lifetimes (strong / weak), the
bound; and the cost of a hit (one Python call, none per key element)."""
from __future__ import annotations

import gc
import sys
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsfn.identity_cache import IdentityCache, KeyedCache


class Obj:
    """Equal to every other Obj of the same value: a key compared by identity must miss on it."""

    def __init__(self, v: int = 0):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Obj) and other.v == self.v

    def __hash__(self):
        return hash(self.v)


class Counted:
    """A `make` that counts its calls."""

    def __init__(self):
        self.n = 0

    def __call__(self, value="made"):
        self.n += 1
        return (value, self.n)


class NoEq:
    """An element whose `==` must never run on a hit (the list comparison checks identity first)."""
    calls = 0

    def __eq__(self, other):
        NoEq.calls += 1
        return self is other

    __hash__ = object.__hash__


def test_identity_cache_hits_on_the_same_object_and_misses_on_an_equal_other():
    c, make = IdentityCache(), Counted()
    a, b = Obj(1), Obj(1)
    assert a == b and a is not b
    first = c.get((a,), make)
    assert c.get((a,), make) is first and make.n == 1          # hit: the same object
    assert c.get((b,), make) is not first and make.n == 2      # miss: equal value, another object
    assert c.get((b,), make) == ("made", 2) and make.n == 2    # the slot holds the last key only
    assert c.get((a,), make) == ("made", 3)                    # a again: made again
    c.clear()
    assert len(c) == 0 and c.get((a,), make) == ("made", 4)


def test_identity_and_equality_parts_of_a_key():
    c, make = IdentityCache(), Counted()
    a = Obj()
    c.get((a,), make, equal=(1, "x"))
    assert c.get((a,), make, equal=(1, "x")) == ("made", 1)    # equal part compared with ==
    assert c.get((a,), make, equal=(2, "x")) == ("made", 2)    # differs: miss
    assert c.get((a, a), make, equal=(2, "x")) == ("made", 3)  # another number of objects: miss
    assert c.get((), make, equal=[1]) == ("made", 4)
    assert c.get((), make, equal=[1]) == ("made", 4)           # a list of equal values: hit


def test_a_list_key_is_compared_by_element_identity_first():
    c, make = IdentityCache(), Counted()
    elems = [NoEq() for _ in range(50)]
    c.get((), make, equal=list(elems))
    NoEq.calls = 0
    assert c.get((), make, equal=list(elems)) == ("made", 1)   # a new list of the same objects: hit
    assert NoEq.calls == 0                                      # with no __eq__ call per element
    other = list(elems)
    other[7] = NoEq()
    assert c.get((), make, equal=other) == ("made", 2)          # one element another object: miss


def test_keyed_cache_guards_against_a_reused_id():
    """Slots keyed by id(obj): an entry made for a collected object never answers a new
    object at the same address (the entry holds its objects, compared by identity)."""
    c, make = KeyedCache(), Counted()
    a = Obj()
    assert c.get(id(a), (a,), make) == ("made", 1)
    assert c.get(id(a), (a,), make) == ("made", 1)
    impostor = Obj()
    assert c.get(id(a), (impostor,), make) == ("made", 2)     # same slot, another object: miss, replaced
    assert c.get(id(a), (impostor,), make) == ("made", 2)
    assert len(c) == 1 and list(c.values()) == [("made", 2)]


def test_keyed_cache_holds_its_objects_alive_by_default_which_keeps_ids_unique():
    c, make = KeyedCache(), Counted()
    a = Obj()
    ref = weakref.ref(a)
    c.get(id(a), (a,), make)
    del a
    gc.collect()
    assert ref() is not None                                    # strong: the entry keeps it alive
    c.clear()
    gc.collect()
    assert ref() is None


def test_weak_caches_do_not_keep_their_objects_alive_and_a_dead_one_misses():
    for cache, get in ((IdentityCache(weak=True), lambda c, o, m: c.get((o,), m)),
                       (KeyedCache(weak=True), lambda c, o, m: c.get("slot", (o,), m))):
        make = Counted()
        a = Obj()
        ref = weakref.ref(a)
        get(cache, a, make)
        assert get(cache, a, make) == ("made", 1)
        del a
        gc.collect()
        assert ref() is None                                    # weak: not kept alive
        b = Obj()                                               # maybe at the dead one's address
        assert get(cache, b, make) == ("made", 2)               # never a false hit


def test_identity_cache_keeps_the_last_key_alive_by_default():
    c = IdentityCache()
    a = Obj()
    ref = weakref.ref(a)
    c.get((a,), Counted())
    del a
    gc.collect()
    assert ref() is not None
    c.get((Obj(),), Counted())                                  # replaced: the old key is let go
    gc.collect()
    assert ref() is None


def test_keyed_cache_bound_drops_the_oldest_slot():
    c, make = KeyedCache(maxsize=2), Counted()
    objs = [Obj(i) for i in range(3)]
    for o in objs:
        c.get(id(o), (o,), make)
    assert len(c) == 2 and id(objs[0]) not in c and id(objs[2]) in c
    assert c.get(id(objs[1]), (objs[1],), make) == ("made", 2)  # still held: a hit
    with pytest.raises(ValueError, match="maxsize"):
        KeyedCache(maxsize=0)


def test_a_failed_make_leaves_the_cache_as_it_was():
    c = IdentityCache()
    a, b = Obj(), Obj()
    c.get((a,), lambda: 1)

    def fail():
        raise RuntimeError("no")
    with pytest.raises(RuntimeError):
        c.get((b,), fail)
    assert c.get((a,), lambda: 2) == 1


def test_a_hit_costs_one_python_call():
    c, kc = IdentityCache(), KeyedCache(weak=True)
    a, elems = Obj(), [Obj(i) for i in range(100)]
    c.get((a,), Counted(), equal=list(elems))
    kc.get("k", (a,), Counted(), equal=list(elems))
    calls = []

    def prof(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
    key, make = list(elems), Counted()
    sys.setprofile(prof)
    try:
        c.get((a,), make, equal=key)
        kc.get("k", (a,), make, equal=key)
    finally:
        sys.setprofile(None)
    assert calls == ["get", "get"], calls


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2)), min_size=1, max_size=30))
def test_matches_a_reference_model(ops):
    """A run of gets over a few objects (some equal-valued) and equal-parts: `make` runs
    exactly when the last key differs (by identity, or by == of the equal part)."""
    objs = [Obj(i % 2) for i in range(5)]                       # pairs of equal-valued objects
    c, kc = IdentityCache(), KeyedCache()
    last, slots = None, {}
    for i, e in ops:
        o = objs[i]
        want_hit = last is not None and last[0] is o and last[1] == e
        made = []
        c.get((o,), lambda: made.append(1), equal=e)
        assert bool(made) != want_hit
        last = (o, e)
        slot = i % 3                                            # slots shared by several objects
        held = slots.get(slot)
        want_hit = held is not None and held[0] is o and held[1] == e
        made = []
        kc.get(slot, (o,), lambda: made.append(1), equal=e)
        assert bool(made) != want_hit
        slots[slot] = (o, e)
