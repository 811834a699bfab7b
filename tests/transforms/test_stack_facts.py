"""Stack facts: derived once per stack, read-only, and composing never writes to a transform.

- `compose` leaves every transform object as it was: all of its attributes (private ones
  included) are the same objects with the same values after composing it into any stack
  (hypothesis over stacks of the factories). Negative control: a transform whose
  `check_stack` writes to itself (what data_parallel, ZeRO, offload, remat and
  sequence_parallel did before) is caught by the same comparison.
- One object in two stacks sees each stack's facts: `stack_facts(t)` answers from the
  running Step's stack (inside / outside / whole), and a handler of the same object reads
  different facts in each (the training consequence — one shard_zero object whose first
  stack's reduce dtype was overwritten by a second compose — is
  tests/transforms/test_reduce_dtype.py::test_one_transform_object_in_two_stacks_trains_each_as_alone).
- StackFacts cannot be written.
"""
from __future__ import annotations

import copy

import pytest
import torch

from dsfn.identity_cache import IdentityCache, KeyedCache
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.effects import activate
from dsfn.transforms import (accumulate, clip_grad_norm, data_parallel, loss_scale, mixed_precision, offload, remat,
                             sequence_parallel, shard_zero, tensor_parallel)
from dsfn.transforms.core import Transform
from dsfn.transforms.facts import StackFacts, stack_facts


def _snapshot(t: Transform) -> dict:
    """Every attribute of `t`: (identity, a deep copy where one can be made) per name."""
    out = {}
    for k, v in vars(t).items():
        try:
            val = copy.deepcopy(v)
        except Exception:          # (locks, file stores): identity alone
            val = None
        out[k] = (id(v), val)
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        (ia, va), (ib, vb) = a[k], b[k]
        if ia != ib:
            return False
        if va is not None and vb is not None and not _equal(va, vb):
            return False
    return True


def _equal(x, y, depth: int = 0) -> bool:
    """Structural equality of two deep copies (objects compared by their attributes)."""
    if type(x) is not type(y):
        return False
    if depth > 6:
        return True
    if isinstance(x, (IdentityCache, KeyedCache)):
        # a memo keyed by the identity of what it was made from (a mesh, a tree spec): a stack
        # with other inputs misses it and makes its own, so what it holds is no stack fact
        return True
    if isinstance(x, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype and (x.is_meta or torch.equal(x, y))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k], depth + 1) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_equal(a, b, depth + 1) for a, b in zip(x, y))
    if hasattr(x, "__dict__") and not callable(x):
        return _equal(vars(x), vars(y), depth + 1)
    try:
        return bool(x == y)
    except Exception:
        return True


OUTERS = {"shard_zero(0)": lambda: shard_zero(0), "shard_zero(2)": lambda: shard_zero(2),
          "shard_zero(3)": lambda: shard_zero(3), "data_parallel": lambda: data_parallel()}
INNERS = {"accumulate": lambda: accumulate(2), "offload": lambda: offload("cpu"),
          "mixed_precision": lambda: mixed_precision(torch.bfloat16),
          "mixed_precision(fp32 reduce)": lambda: mixed_precision(torch.bfloat16, reduce_dtype=torch.float32),
          "loss_scale": lambda: loss_scale(), "clip_grad_norm": lambda: clip_grad_norm(1.0),
          "remat": lambda: remat()}
ORDER = ["accumulate", "offload", "mixed_precision", "mixed_precision(fp32 reduce)", "loss_scale", "clip_grad_norm",
         "remat"]


def _stack(outer: str, inners: list[str]) -> list[Transform]:
    names = sorted(set(inners), key=ORDER.index)
    if "mixed_precision" in names and "mixed_precision(fp32 reduce)" in names:
        names.remove("mixed_precision(fp32 reduce)")
    if "remat" in names:                       # remat sits right inside the parallel transform
        names = ["remat"] + [n for n in names if n != "remat"]
    return [OUTERS[outer]()] + [INNERS[n]() for n in names]


@settings(max_examples=30, deadline=None)
@given(outer=st.sampled_from(sorted(OUTERS)), first=st.lists(st.sampled_from(ORDER), max_size=4),
       second=st.lists(st.sampled_from(ORDER), max_size=4))
def test_composing_never_writes_to_a_transform(outer, first, second):
    """The same objects composed into two stacks: each one's attributes are unchanged by both."""
    stack = _stack(outer, first)
    before = [_snapshot(t) for t in stack]
    dsfn.compose(*stack)(lambda s, b: (s, {}))
    others = _stack(outer, second)
    dsfn.compose(stack[0], *others[1:])(lambda s, b: (s, {}))     # the same outer object, another stack
    assert all(_same(b, _snapshot(t)) for b, t in zip(before, stack))


class _Writes(Transform):
    """The old pattern: check_stack records what the stack implies on the object."""
    name = "writes"

    def check_stack(self, stack, index):
        self._accumulates = any("accumulate" in t.roles for t in stack)


def test_negative_control_a_transform_that_writes_in_check_stack_is_caught():
    t = _Writes()
    t._accumulates = False
    before = _snapshot(t)
    dsfn.compose(t, accumulate(2))(lambda s, b: (s, {}))
    assert not _same(before, _snapshot(t))


def test_one_object_reads_each_running_stack_s_facts():
    zero = shard_zero(2)
    mp32, mp16 = mixed_precision(torch.bfloat16, reduce_dtype=torch.float32), mixed_precision(torch.bfloat16)
    a = dsfn.compose(zero, accumulate(2), mp32)(lambda s, b: (s, {}))
    b = dsfn.compose(zero, mp16)(lambda s, b: (s, {}))
    seen = {}
    for name, step in (("a", a), ("b", b), ("a again", a)):
        with activate(step.stack, step.facts):
            f = stack_facts(zero)
            seen[name] = (f.grad_wire_dtype, f.inside(zero).has_role("accumulate"), f.outside(zero).has_role("zero"),
                          f.inside(zero).first("compute_dtype"))
    assert seen["a"] == seen["a again"] == (torch.float32, True, False, torch.bfloat16)
    assert seen["b"] == (torch.bfloat16, False, False, torch.bfloat16)


def test_facts_see_positions_and_publications():
    tp = tensor_parallel({"x": "colwise"})
    r = remat(partition_activations=True)
    sp = sequence_parallel()
    step = dsfn.compose(sp, shard_zero(1), tp, r)(lambda s, b: (s, {}))
    f = step.facts
    assert f.outside(r).first("tp_axis") == "tp" and f.inside(tp).first("tp_axis") is None
    assert f.inside(sp).all("dp_axis") == ("dp",) and f.outside(sp).all("dp_axis") == ()
    assert f.whole.with_role("zero")[0]["zero_stage"] == 1
    with pytest.raises(LookupError):
        f.inside(remat())          # not in this stack


def test_stack_facts_are_read_only():
    f = StackFacts([shard_zero(2), mixed_precision()])
    with pytest.raises(AttributeError):
        f.grad_wire_dtype = torch.float32
    with pytest.raises(TypeError):
        f.whole.with_role("zero")[0]["zero_stage"] = 3          # each transform's published facts too
