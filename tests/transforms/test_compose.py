"""compose: order semantics, handler dispatch, stack validation, purity of a step."""
import pytest
import torch

from dsfn.errors import ConfigError, LeafTypeError, StackError
from dsfn.transforms import Transform, compose, data_parallel
from dsfn.transforms.core import bind


class Tag(Transform):
    """Appends its label to a log at every hook it has, to observe order."""
    unique = False

    def __init__(self, label, log):
        self.label, self.log = label, log

    def place(self, state):
        self.log.append(("place", self.label))
        return state

    def gather(self, state):
        self.log.append(("gather", self.label))
        return state

    def wrap_step(self, fn):
        def step(state, batch):
            self.log.append(("enter", self.label))
            out = fn(state, batch)
            self.log.append(("exit", self.label))
            return out
        return step

    def handle_probe(self, call_next, x):
        self.log.append(("probe", self.label))
        return call_next(x + [self.label])


def probe_step(state, batch):
    return state, {"n": float(len(bind("probe", lambda x: x, [])))}


def test_compose_equals_nested_application():
    log1, log2 = [], []
    a1, b1 = Tag("a", log1), Tag("b", log1)
    a2, b2 = Tag("a", log2), Tag("b", log2)
    s1 = compose(a1, b1)(probe_step)
    s2 = a2(b2(probe_step))
    assert [t.label for t in s1.stack] == [t.label for t in s2.stack] == ["a", "b"]
    s1.place({}), s2.place({})
    s1({}, {}), s2({}, {})
    assert log1 == log2


def test_order_outer_wraps_and_handles_first_inner_places_first_and_gathers_last():
    log = []
    step = compose(Tag("outer", log), Tag("inner", log))(probe_step)
    step.place({})
    _, m = step({}, {"x": torch.zeros(2)})
    step.gather({})
    assert log == [("place", "inner"), ("place", "outer"),
                   ("enter", "outer"), ("enter", "inner"),
                   ("probe", "outer"), ("probe", "inner"),
                   ("exit", "inner"), ("exit", "outer"),
                   ("gather", "outer"), ("gather", "inner")]
    assert m["n"] == 2.0


def test_primitive_outside_a_step_uses_the_default():
    assert bind("probe", lambda x: x + ["default"], []) == ["default"]


def test_stack_errors_at_compose_time():
    with pytest.raises(StackError, match="forget to call"):
        compose(data_parallel)
    with pytest.raises(StackError, match="twice"):
        compose(data_parallel(), data_parallel())
    with pytest.raises(StackError, match="argument 0"):
        compose("zero")


def test_unknown_transform_argument_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['buckets'\].*valid arguments"):
        data_parallel(buckets=3)
    with pytest.raises(ConfigError, match="bucket size"):
        data_parallel(bucket_mb=0)


def test_train_step_must_return_state_and_metrics():
    step = compose()(lambda s, b: s)
    with pytest.raises(StackError, match="must return"):
        step({}, {})


def test_batch_leaves_must_be_tensors():
    step = compose()(lambda s, b: (s, {}))
    with pytest.raises(LeafTypeError, match="batch leaf 'ids.0' is a int"):
        step({}, {"ids": [1, 2, 3]})


def test_metric_must_be_scalar():
    step = compose()(lambda s, b: (s, {"v": torch.ones(3)}))
    with pytest.raises(LeafTypeError, match="metric 'v'"):
        step({}, {})
