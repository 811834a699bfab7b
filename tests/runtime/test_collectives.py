"""Collectives: results equal the math, and the counters record calls and bytes per axis."""
import pytest
import torch

from dsfn.runtime import collectives as C
from dsfn.runtime import counters, init_mesh
from dsfn.testing import run_on_ranks


def _all_ops():
    mesh = init_mesh()
    n, r = mesh.size("dp"), mesh.rank
    counters.reset()
    x = torch.arange(2 * n, dtype=torch.float32) + 10 * r
    out = {
        "sum": C.all_reduce(x, "dp").tolist(),
        "avg": C.all_reduce(x, "dp", "avg").tolist(),
        "gather": C.all_gather(x[:2], "dp").tolist(),
        "scatter": C.reduce_scatter(x, "dp").tolist(),
        "a2a": C.all_to_all(x, "dp").tolist(),
        "bcast": C.broadcast_(x.clone(), "dp", src=n - 1).tolist(),
        "async": C.all_reduce(x, "dp", async_op=True).wait().tolist(),
        "x_unchanged": x.tolist(),
    }
    out["counts"] = {op: (counters.calls("dp", op), counters.bytes("dp", op))
                     for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}
    return out


def test_collectives_match_math_and_count_bytes():
    n = 2
    res = run_on_ranks(_all_ops, n, timeout=60)
    xs = [torch.arange(2 * n, dtype=torch.float32) + 10 * r for r in range(n)]
    total = sum(xs)
    for r, o in enumerate(res):
        assert o["sum"] == total.tolist() and o["async"] == total.tolist()
        assert o["avg"] == (total / n).tolist()
        assert o["gather"] == torch.cat([x[:2] for x in xs]).tolist()
        assert o["scatter"] == total[2 * r:2 * r + 2].tolist()
        assert o["a2a"] == torch.cat([x[2 * r:2 * r + 2] for x in xs]).tolist()
        assert o["bcast"] == xs[-1].tolist()
        assert o["x_unchanged"] == xs[r].tolist()
        nbytes = 2 * n * 4
        assert o["counts"] == {"all_reduce": (3, 3 * nbytes), "all_gather": (1, nbytes),
                               "reduce_scatter": (1, nbytes), "all_to_all": (1, nbytes),
                               "broadcast": (1, nbytes)}


def test_single_process_collectives_are_identity_and_count_nothing():
    init_mesh()
    counters.reset()
    x = torch.ones(4)
    assert torch.equal(C.all_reduce(x, "dp"), x) and torch.equal(C.all_gather(x, "dp"), x)
    assert counters.calls() == 0


def _coalesced_gather():
    from dsfn.runtime import collectives as C
    m = init_mesh()
    n, r = m.size("dp"), m.local_rank("dp")
    ins = [torch.arange(3.0) + 10 * r, torch.full((2,), 100.0 + r)]
    want = [torch.cat([torch.arange(3.0) + 10 * q for q in range(n)]),
            torch.cat([torch.full((2,), 100.0 + q) for q in range(n)])]
    outs = [torch.empty(n * t.numel()) for t in ins]
    C._coalesced_all_gather(m.group("dp"), outs, ins).wait()
    return all(torch.equal(o, w) for o, w in zip(outs, want))


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_all_gather_lands_every_rank_in_its_slot(world):
    """The NCCL path of all_gather_into_ (one coalesced process-group call per bucket), run
    through gloo's implementation of the same call: rank r's tensor k lands at [r*k, (r+1)*k)."""
    assert all(run_on_ranks(_coalesced_gather, world, timeout=60))
