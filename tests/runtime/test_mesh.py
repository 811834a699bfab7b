"""Mesh: axis sizes, rank coordinates, groups, and clear errors for bad sizes."""
import pytest
import torch

from dsfn.errors import MeshError
from dsfn.runtime import collectives as C
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks


def _coords_and_sums(axes):
    mesh = init_mesh(**axes)
    r = torch.tensor([float(mesh.rank)])
    sums = {a: C.all_reduce(r, a).item() for a in ("dp", "tp")}
    return mesh.coords, mesh.ranks("dp"), mesh.ranks("tp"), sums


def test_2x2_mesh_groups_are_row_major_with_tp_fastest():
    out = run_on_ranks(_coords_and_sums, 4, {"dp": 2, "tp": 2}, timeout=60)
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [o[2] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[3]["tp"] for o in out] == [1, 1, 5, 5]     # 0+1, 2+3
    assert [o[3]["dp"] for o in out] == [2, 4, 2, 4]     # 0+2, 1+3


def _make(axes):
    try:
        init_mesh(**axes)
    except MeshError as e:
        return str(e)
    return "ok"


def test_sizes_that_do_not_multiply_to_world_are_an_error():
    msgs = run_on_ranks(_make, 2, {"dp": 2, "tp": 2}, timeout=60)
    assert all("multiply to 4" in m and "world size is 2" in m for m in msgs)
    msgs = run_on_ranks(_make, 4, {"dp": -1, "tp": 3}, timeout=60)
    assert all("not divisible" in m for m in msgs)


def test_single_process_mesh_and_bad_axis_names():
    mesh = init_mesh()
    assert mesh.size("dp") == 1 and mesh.group("dp") is None
    with pytest.raises(MeshError, match="no axis 'pp'"):
        mesh.size("pp")
    with pytest.raises(MeshError, match="positive"):
        init_mesh(dp=0)
