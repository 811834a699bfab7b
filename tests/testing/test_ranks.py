"""dsfn.testing: run_on_ranks, tree assertions, hypothesis strategies."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings

from dsfn.errors import RankFailure
from dsfn.testing import strategies
from dsfn.testing.asserts import assert_trees_close, assert_trees_equal
from dsfn.testing.ranks import run_on_ranks


def _reduce_scatter_then_gather(n, *, scale):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(n * world, dtype=torch.float32) * (rank + 1) * scale
    shard = torch.empty(n)
    dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
    gathered = torch.empty(n * world)
    dist.all_gather_into_tensor(gathered, shard)
    return {"rank": rank, "gathered": gathered}


@pytest.mark.parametrize("world_size", [1, 3])
def test_run_on_ranks_collectives(world_size):
    out = run_on_ranks(_reduce_scatter_then_gather, world_size, 4, scale=2.0)
    mean_factor = sum(r + 1 for r in range(world_size)) / world_size
    expected = torch.arange(4 * world_size, dtype=torch.float32) * mean_factor * 2.0
    assert [o["rank"] for o in out] == list(range(world_size))
    for o in out:
        assert_trees_close(o["gathered"], expected, rtol=1e-6, atol=1e-6)


def test_run_on_ranks_reports_failures():
    def fn():
        if dist.get_rank() == 1:
            raise RuntimeError("nope")
        return 0

    with pytest.raises(RankFailure) as info:
        run_on_ranks(fn, 2, timeout=30)
    assert info.value.rank == 1


# ------------------------------------------------------------------ asserts

def _tree(w=1.0):
    return {"layers": [{"w": torch.full((2, 3), w), "b": torch.zeros(3)}], "step": 3,
            "lr": 0.1, "name": "mlp", "none": None}


def test_close_trees_pass():
    assert_trees_close(_tree(1.0), _tree(1.0 + 1e-7), rtol=1e-6, atol=0)
    assert_trees_equal(_tree(), _tree())


def test_close_reports_path_and_errors():
    a, e = _tree(1.0), _tree(1.0)
    a["layers"][0]["w"][1, 2] = 1.5
    with pytest.raises(AssertionError) as info:
        assert_trees_close(a, e, rtol=1e-5, atol=1e-5, msg="after step 3")
    msg = str(info.value)
    assert msg.startswith("after step 3: 1 of")
    assert "layers.0.w" in msg and "1/6 elements" in msg and "(1, 2)" in msg
    assert "max abs err 5.000e-01" in msg and "max rel err 5.000e-01" in msg
    assert "layers.0.b" not in msg


def test_structure_mismatch_names_paths():
    a = {"x": torch.zeros(1), "y": torch.zeros(1)}
    e = {"x": torch.zeros(1), "z": torch.zeros(1)}
    with pytest.raises(AssertionError, match="structures differ") as info:
        assert_trees_close(a, e)
    assert "'y'" in str(info.value) and "'z'" in str(info.value)
    with pytest.raises(AssertionError, match="structures differ"):
        assert_trees_equal([torch.zeros(1)], (torch.zeros(1),))


def test_shape_dtype_and_kind_mismatch():
    with pytest.raises(AssertionError, match="shape"):
        assert_trees_close({"a": torch.zeros(2)}, {"a": torch.zeros(3)})
    with pytest.raises(AssertionError, match="dtype"):
        assert_trees_close({"a": torch.zeros(2)}, {"a": torch.zeros(2, dtype=torch.float64)})
    assert_trees_close({"a": torch.zeros(2)}, {"a": torch.zeros(2, dtype=torch.float64)}, check_dtype=False)
    with pytest.raises(AssertionError, match="tensor"):
        assert_trees_close({"a": torch.zeros(())}, {"a": 0.0})


def test_nan_inf_and_scalars():
    nan = torch.tensor([math.nan, math.inf, 1.0])
    assert_trees_close(nan, nan.clone())
    assert_trees_equal(nan, nan.clone())
    with pytest.raises(AssertionError):
        assert_trees_close(torch.tensor([math.nan]), torch.tensor([1.0]))
    with pytest.raises(AssertionError):
        assert_trees_close(torch.tensor([math.inf]), torch.tensor([-math.inf]))
    assert_trees_close({"lr": 0.1}, {"lr": 0.1 + 1e-9}, rtol=1e-6, atol=0)
    with pytest.raises(AssertionError, match="step"):
        assert_trees_close({"step": 3}, {"step": 4})
    with pytest.raises(AssertionError, match="name"):
        assert_trees_equal({"name": "a"}, {"name": "b"})


def test_equal_is_bitwise():
    with pytest.raises(AssertionError, match="bitwise"):
        assert_trees_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    with pytest.raises(AssertionError, match="layers.0.w"):
        assert_trees_equal(_tree(1.0), _tree(1.0 + 1e-7))
    assert_trees_equal(torch.arange(5), torch.arange(5))
    with pytest.raises(AssertionError):
        assert_trees_equal(torch.arange(5), torch.arange(1, 6))
    z = torch.complex(torch.ones(2), torch.zeros(2))
    assert_trees_equal(z, z.clone())
    assert_trees_equal(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16))


# ------------------------------------------------------------------ strategies

@settings(max_examples=50, deadline=None)
@given(ws=strategies.world_sizes(), seed=strategies.seeds(), shape=strategies.shapes(),
       cfg=strategies.mlp_configs())
def test_strategies_draw_valid_values(ws, seed, shape, cfg):
    assert 1 <= ws <= 4
    torch.manual_seed(seed)
    assert len(shape) <= 3 and all(1 <= s <= 7 for s in shape)
    assert torch.zeros(shape).shape == shape
    assert set(cfg) == {"in_features", "hidden", "out_features", "depth", "batch"}
    assert all(isinstance(v, int) and v >= 1 for v in cfg.values())


@settings(max_examples=30, deadline=None)
@given(shape=strategies.shapes(max_dims=2, max_side=3, allow_scalar=False), ws=strategies.world_sizes(2))
def test_strategy_bounds(shape, ws):
    assert 1 <= len(shape) <= 2 and max(shape) <= 3 and ws <= 2
