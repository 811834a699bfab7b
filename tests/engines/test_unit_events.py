"""Layer events: the "run_unit" primitive's one installer (`dsfn.layer_events.UnitEvents`), and
its handlers at the engine level (ZeRO-3's gatherer, remat's checkpoint and compile_units'
compiled forward here; the pipeline's stage verbs in
tests/transforms/test_pipeline_parallel_remat.py, `_heard`; tensor parallel's collectives
need a tp group: tests/transforms/test_tensor_parallel.py, whose rows fail without its handler).

The installer hooks each unit once and runs the handlers in the order given (the stack's,
outermost first): work done before `call_next` runs outermost-first, work after it
innermost-first. A handler may replace a unit's inputs (pre) or output (post), or end the
forward by raising.
"""
import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import dsfn
from dsfn.functional import UnitEvents
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import make_mlp


class _Log:
    def __init__(self, name, log, before=True):
        self.name, self.log, self.before = name, log, before

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if self.before:
            self.log.append((self.name, phase, recompute))
            return call_next(module, phase, value, recompute)
        out = call_next(module, phase, value, recompute)
        self.log.append((self.name, phase, recompute))
        return out


def test_handlers_run_in_the_given_order_around_each_unit_and_the_hooks_go_at_exit():
    model = make_mlp([3, 4, 2])
    log = []
    outer, inner = _Log("outer", log), _Log("inner", log, before=False)
    events = UnitEvents([model.layers[0], model.layers[0]], [outer.handle_run_unit, inner.handle_run_unit])
    assert events.units == [model.layers[0]]                # each unit once
    with events:
        model(torch.randn(2, 3))
    # outer acts before its continuation, inner after its own: outer first in both phases
    assert log == [("outer", "pre", False), ("inner", "pre", False), ("outer", "post", False),
                   ("inner", "post", False)]
    log.clear()
    model(torch.randn(2, 3))
    assert log == [] and not model.layers[0]._forward_hooks and not model.layers[0]._forward_pre_hooks


class _Replace:
    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase == "pre":
            (x,), kwargs = value
            value = ((x * 0,), kwargs)              # the unit's input replaced
        else:
            value = value + 1                        # its output replaced
        return call_next(module, phase, value, recompute)


def test_a_handler_replaces_a_units_inputs_and_output():
    layer = nn.Linear(3, 2)
    with UnitEvents([layer], [_Replace().handle_run_unit]):
        out = layer(torch.randn(4, 3))
    assert torch.allclose(out, layer.bias.detach().expand(4, 2) + 1)


def test_a_recompute_in_backward_is_marked():
    layer = nn.Linear(3, 3)
    log = []
    with UnitEvents([layer], [_Log("h", log).handle_run_unit]):
        x = torch.randn(2, 3, requires_grad=True)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):   # the whole recompute runs
            torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert log == [("h", "pre", False), ("h", "post", False), ("h", "pre", True), ("h", "post", True)]


class _Around:
    """A "call" handler: doubles the input before the forward handed down, and adds `add` after."""
    def __init__(self, add, log):
        self.add, self.log = add, log

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase != "call":
            return call_next(module, phase, value, recompute)
        forward, (x,), kwargs = value
        self.log.append(self.add)
        return call_next(module, phase, (forward, (x * 2,), kwargs), recompute) + self.add


def test_a_call_runs_the_forward_through_the_handlers_outermost_around_and_is_restored_at_exit():
    layer = nn.Linear(3, 2)
    eager = layer.forward
    log = []
    x = torch.randn(4, 3)
    with UnitEvents([], [_Around(10, log).handle_run_unit, _Around(100, log).handle_run_unit], calls=[layer]):
        out = layer(x)
    # both double the input (x4); the inner adds first, the outer last: the same sum either way,
    # the order of the log is the stack's
    assert torch.allclose(out, eager(x * 4) + 110) and log == [10, 100]
    assert "forward" not in layer.__dict__ and not layer._forward_pre_hooks      # the class forward again
    assert torch.allclose(layer(x), eager(x))


class _HandDown:
    """A "call" handler that hands down another forward (as compile_units hands down the compiled one)."""
    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase == "call":
            forward, args, kwargs = value
            value = (lambda *a, **k: -forward(*a, **k), args, kwargs)
        return call_next(module, phase, value, recompute)


def test_a_call_handler_hands_down_another_forward_and_pre_post_still_run_around_it():
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    ref = layer(x)
    log = []
    with UnitEvents([layer], [_Log("h", log).handle_run_unit, _HandDown().handle_run_unit], calls=[layer]):
        out = layer(x)
    assert torch.allclose(out, -ref)
    assert log == [("h", "pre", False), ("h", "call", False), ("h", "post", False)]


class _Stop(Exception):
    pass


class _Raise:
    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if phase == "post":
            raise _Stop(value)
        return call_next(module, phase, value, recompute)


def test_an_outer_handlers_post_work_runs_before_an_inner_one_ends_the_forward():
    model = make_mlp([3, 4, 2])
    log = []
    with UnitEvents([model.layers[0]], [_Log("outer", log).handle_run_unit, _Raise().handle_run_unit]):
        with pytest.raises(_Stop):
            model(torch.randn(2, 3))
    assert log == [("outer", "pre", False), ("outer", "post", False)]


# -- ZeRO-3's handler over its engine (two ranks) ------------------------------------------------

class _Slots:
    """An inner handler: the shape of each Linear unit's weight as the unit runs (pre) and
    once the handlers outside have heard it ran (post)."""

    def __init__(self):
        self.seen = []

    def handle_run_unit(self, call_next, module, phase, value, recompute):
        if isinstance(module, nn.Linear):
            self.seen.append((phase, tuple(module.weight.shape)))
        return call_next(module, phase, value, recompute)


def _zero3_forward_by_events(prefetch):
    init_mesh()
    model = make_mlp([4, 8, 8, 2], seed=1)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_fn, params = dsfn.functionalize(model)
    zero = dsfn.transforms.shard_zero(3, prefetch=prefetch)
    engine = zero._engine
    state = engine.place(dsfn.TrainState.create(params, dsfn.optim.sgd(0.1)))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    C.reset_gauges()
    gatherer = engine.begin_forward(apply_fn, state.params, None)
    slots = _Slots()
    events = UnitEvents(engine.units_of(model), [zero.handle_run_unit, slots.handle_run_unit])
    with events, gatherer.listening(engine.live_units, engine.recompute_watch), gatherer:
        out = gatherer.view(gatherer.call_params, x)
    want = torch.func.functional_call(make_mlp([4, 8, 8, 2], seed=1), full, (x,))
    return (torch.equal(out, want), C.gauge_max.get("zero3.live_units"), slots.seen, dict(engine.live_units),
            len(engine.units_of(model)))


def test_zero3s_run_unit_handler_gathers_each_unit_just_in_time_and_releases_it():
    for prefetch in (0, 1):
        for same, live, seen, registry, n_units in run_on_ranks(_zero3_forward_by_events, 2, prefetch, timeout=60):
            assert same                                     # gathered weights: the full model's output
            assert live == prefetch + 1, (prefetch, live)   # units in flight: this one + the prefetched
            # inside ZeRO: each unit gathered whole as it runs, its flat shard back once it ran
            assert seen == [("pre", (8, 4)), ("post", (16,)), ("pre", (8, 8)), ("post", (32,)),
                            ("pre", (2, 8)), ("post", (8,))], seen
            assert registry == {} and n_units == 4          # the root and its 3 layers


class _Counted(nn.Module):
    """A layer that counts its forwards (a checkpoint's recompute runs it again)."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


def test_remats_call_handler_runs_the_unit_under_a_checkpoint_only_while_installed():
    from dsfn.engines.remat import Installed, is_checkpointed
    from dsfn.transforms import remat
    layer = _Counted()
    x = torch.randn(4, 3, requires_grad=True)
    ref = torch.autograd.grad(layer(x).sum(), (x, layer.lin.weight))
    handler = remat().handle_run_unit
    layer.calls = 0
    with Installed([("layer", layer)], None, None):
        assert is_checkpointed(layer)
        with UnitEvents([], [handler], calls=[layer]):
            out = layer(x)
            got = torch.autograd.grad(out.sum(), (x, layer.lin.weight))
    assert layer.calls == 2                     # the forward, and its recompute in backward
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not is_checkpointed(layer)
    layer.calls = 0
    with UnitEvents([], [handler], calls=[layer]):      # nothing installed: the call goes on as it is
        torch.autograd.grad(layer(x).sum(), x)
    assert layer.calls == 1


def test_compile_units_call_handler_hands_down_its_compiled_forward():
    from dsfn.transforms import compile_units
    model = make_mlp([3, 4, 4, 2])
    cu = compile_units(units=["layers.*"], backend="eager")
    units = cu.handle_unit_calls_of(lambda m: (), model)       # its "unit_calls_of": the blocks
    assert list(units) == [m for m in model.layers]
    x = torch.randn(2, 3)
    ref = model(x)
    seen = []

    class _Spy:
        def handle_run_unit(self, call_next, module, phase, value, recompute):
            if phase == "call":
                seen.append(value[0] is cu.compiled_forward(module))
            return call_next(module, phase, value, recompute)
    with UnitEvents([], [cu.handle_run_unit, _Spy().handle_run_unit], calls=units):
        out = model(x)
    assert torch.equal(out, ref) and seen and all(seen)


def test_recompute_events_reach_the_handlers_for_the_watched_modules_until_exit():
    from dsfn.layer_events import RecomputeEvents
    model = make_mlp([3, 4, 2])
    watched = {id(model.layers[0]): model.layers[0]}
    log = []
    x = torch.randn(2, 3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)   # recomputed in backward
    with RecomputeEvents(watched, [_Log("h", log).handle_run_unit]):
        model(x)                                         # after the forward: heard, not in backward
        out.sum().backward()                             # the recompute: heard in backward
    assert log == [("h", "recompute_pre", False), ("h", "recompute_post", False),
                   ("h", "recompute_pre", True), ("h", "recompute_post", True)]
    log.clear()
    model(x)
    assert log == []                                     # the global hooks are gone
