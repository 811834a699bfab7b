"""Two nodes launched the way users launch them: one torchrun agent per node, meeting at a
c10d rendezvous, each starting its node's ranks; hybrid ZeRO-3 (`shard_group="node"`)
then shards over the ranks of each agent and replicates across the agents.

Here both "nodes" are agents on this machine (two subprocesses); the topology the ranks
see comes from torchrun's own variables (LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE),
so the layout is the one two real nodes get (about 10 s here: two agents, a rendezvous,
four ranks). `test_hybrid_zero3_on_two_nodes_of_two` is the same property on
`run_on_ranks(..., ranks_per_node=2)` (torchrun's variables set per rank), under a second,
with the negative controls of the check.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import dsfn
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_mlp, regression_batches
from dsfn.testing.reference import run_training

REPO = Path(__file__).resolve().parents[1]
SIZES, N_STEPS, GLOBAL_BATCH = [6, 8, 3], 3, 8
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE

# One node's script: each rank trains on its quarter of every global batch (as a
# DistributedSampler would give it) and saves what it ended with and the layout it saw.
SCRIPT = textwrap.dedent(f"""
    import os, sys
    import torch
    import dsfn
    from dsfn.runtime import env, current_mesh
    from dsfn.testing.models import make_mlp, regression_batches
    from dsfn.testing.reference import train_step_for, mse_loss
    from dsfn.transforms import compose, shard_zero

    out = sys.argv[1]
    rank, rows = int(os.environ["RANK"]), {GLOBAL_BATCH} // {WORLD}
    apply_fn, params = dsfn.functionalize(make_mlp({SIZES}, seed=0))
    step = compose(shard_zero(3, shard_group="node", split_batch=False))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9), seed=0))
    for batch in regression_batches({N_STEPS}, {GLOBAL_BATCH}, {SIZES[0]}, {SIZES[-1]}, seed=1):
        state, metrics = step(state, {{k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}})
    final = step.gather(state)
    mesh = current_mesh()
    torch.save({{"world": env.world_size(), "agent": os.environ["TEST_AGENT"],
                "node": int(os.environ["GROUP_RANK"]),
                "topology": (mesh.topology.nodes, mesh.topology.ranks_per_node, mesh.topology.source),
                "dp_shard": mesh.ranks("dp_shard"), "dp_replicate": mesh.ranks("dp_replicate"),
                "params": {{k: v.detach().clone() for k, v in final.params.items()}}}},
               os.path.join(out, f"rank{{rank}}.pt"))
""")


def _batches(rows=slice(None)):
    return [{k: v[rows] for k, v in b.items()}
            for b in regression_batches(N_STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=1)]


def _reference(batches):
    """Single-process training on `batches` (this process has no process group)."""
    res = run_training(lambda: make_mlp(SIZES, seed=0), lambda: dsfn.optim.sgd(lr=0.1, momentum=0.9),
                       batches)
    return res.state.params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(ranks: list[dict]) -> None:
    """What two nodes of two must have ended with (both tests)."""
    assert [r["world"] for r in ranks] == [WORLD] * WORLD
    assert {r["topology"][:2] for r in ranks} == {(NODES, PER_NODE)}
    assert [r["node"] for r in ranks] == [rank // PER_NODE for rank in range(WORLD)]   # node-major
    for rank, r in enumerate(ranks):
        node_ranks = [q for q in range(WORLD) if ranks[q]["agent"] == r["agent"]]
        assert r["dp_shard"] == node_ranks, (rank, r["dp_shard"], node_ranks)    # the group is the node
        assert r["dp_replicate"] == [q for q in range(WORLD) if q % PER_NODE == rank % PER_NODE]
    for r in ranks[1:]:
        assert_trees_close(r["params"], ranks[0]["params"], rtol=0, atol=0)
    full = _reference(_batches())
    assert_trees_close(ranks[0]["params"], full, rtol=1e-5, atol=1e-6)
    # negative control: what rank 0 would end with training alone on its quarter
    alone = _reference(_batches(slice(0, GLOBAL_BATCH // WORLD)))
    assert max((alone[k] - full[k]).abs().max().item() for k in full) > 1e-3


def _agent_flags(endpoint: str) -> list[str]:
    """The flags of README's torchrun line ("Several nodes"), at this test's sizes."""
    return ["--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "dsfn-two-nodes"]


def _flag_names(words: list[str]) -> list[str]:
    return [w for w in words if w.startswith("--")]


def test_the_readme_torchrun_line_is_the_one_this_file_runs():
    """README's several-nodes-torchrun block cannot run here (two nodes); this file runs its
    line with the sizes and the endpoint changed, so the two must name the same flags."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- doc-test: several-nodes-torchrun; skip -->\n```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split() for line in block.splitlines() if line.strip()]
    assert lines and all(w[0] == "torchrun" and w[-1] == "train.py" for w in lines), block
    for words in lines:
        assert _flag_names(words) == _flag_names(_agent_flags("HOST:29500")), words
        assert words[words.index("--rdzv-backend") + 1] == "c10d"


def _launch_two_nodes(tmp_path: Path, timeout: float) -> Path:
    """Two torchrun agents (nodes) of PER_NODE ranks each at one c10d rendezvous; both are
    killed (their process groups) when either fails or the pair runs past `timeout`."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    base.update(DSFN_FORCE_CPU="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", *_agent_flags(f"127.0.0.1:{_free_port()}"),
           "--max-restarts", "0", str(script), str(out)]
    agents, logs = {}, {}
    try:
        for name in ("a", "b"):
            logs[name] = open(tmp_path / f"agent_{name}.log", "w")
            agents[name] = subprocess.Popen(cmd, env={**base, "TEST_AGENT": name}, cwd=str(tmp_path),
                                            stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in agents.values()):
            if any(p.returncode not in (None, 0) for p in agents.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for f in logs.values():
            f.close()
    said = "\n".join(f"--- agent {n} (exit {p.returncode}):\n{(tmp_path / f'agent_{n}.log').read_text()[-3000:]}"
                     for n, p in agents.items())
    assert all(p.returncode == 0 for p in agents.values()), f"the two torchrun agents did not both finish:\n{said}"
    return out


@pytest.mark.timeout(180)
def test_two_torchrun_agents_train_hybrid_zero3_with_node_local_shards(tmp_path):
    out = _launch_two_nodes(tmp_path, timeout=120)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    assert {r["topology"][2] for r in ranks} == {"torchrun"}
    assert sorted({r["agent"] for r in ranks}) == ["a", "b"]
    _check(ranks)


def _train_on_rank():
    """The script's body, on a `run_on_ranks` rank."""
    from dsfn.runtime import current_mesh, env
    from dsfn.testing.reference import mse_loss, train_step_for
    from dsfn.transforms import compose, shard_zero

    rank, rows = env.rank(), GLOBAL_BATCH // WORLD
    apply_fn, params = dsfn.functionalize(make_mlp(SIZES, seed=0))
    step = compose(shard_zero(3, shard_group="node", split_batch=False))(train_step_for(apply_fn, mse_loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.1, momentum=0.9), seed=0))
    for batch in _batches(slice(rank * rows, (rank + 1) * rows)):
        state, _ = step(state, batch)
    final = step.gather(state)
    mesh = current_mesh()
    return {"world": env.world_size(), "agent": os.environ["GROUP_RANK"], "node": int(os.environ["GROUP_RANK"]),
            "topology": (mesh.topology.nodes, mesh.topology.ranks_per_node, mesh.topology.source),
            "dp_shard": mesh.ranks("dp_shard"), "dp_replicate": mesh.ranks("dp_replicate"),
            "params": {k: v.detach().clone() for k, v in final.params.items()}}


def test_hybrid_zero3_on_two_nodes_of_two():
    ranks = run_on_ranks(_train_on_rank, WORLD, ranks_per_node=PER_NODE, timeout=90)
    _check(ranks)
    # negative controls: the check rejects shard groups across the nodes, and one node's
    # ranks ending with other parameters
    across = [{**r, "dp_shard": r["dp_replicate"], "dp_replicate": r["dp_shard"]} for r in ranks]
    with pytest.raises(AssertionError):
        _check(across)
    off = [*ranks[:2], *({**r, "params": {k: v + 1e-4 for k, v in r["params"].items()}} for r in ranks[2:])]
    with pytest.raises(AssertionError):
        _check(off)
