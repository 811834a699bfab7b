"""`dsfn.estimate_memory` against what `Step.explain` measures, and against DeepSpeed's formulas.

For ZeRO 0-3, ZeRO + mixed precision, CPU offload (optimizer state, and ZeRO-3 parameters)
and tensor parallel, at world 2 and 4: every state field of the estimate (params,
optimizer, master, host) is within 5% of the bytes of the placed state's leaves that
`explain()` reports on each rank (the GPT's parameters do not divide evenly, so ZeRO's
padding is in both). The estimate is made from a meta-device copy of the model. Negative
control: an estimate made for the wrong stage or world misses by more than 5%.

Pipeline parallel (pp 2, and pp 2 x dp 2 with shard_zero(1) outside): params and optimizer
bytes equal the measured leaves of each rank exactly (GPT; a tiny Llama whose tied embedding
lives on both ends); the negative control, every parameter on every rank, misses. The
activation peak in micro-batches is the schedule simulator's (1F1B: p - rank, GPipe: m);
the activation bytes are a model (docs/estimate.md), checked against that model
by hand, not measured.
"""
import math

import pytest
import torch

import dsfn
from dsfn.estimate import (MemoryEstimate, deepspeed_zero2_estimate, deepspeed_zero3_estimate, estimate_memory,
                           measured_state_bytes)
from dsfn.models.gpt import GPT, GPTConfig, tp_plan
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.models import token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import mixed_precision, offload, shard_zero, tensor_parallel

VOCAB = 67
CONF = GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=2, n_head=4, d_model=36)
STACKS = {
    "zero0": lambda m: [shard_zero(0)],
    "zero1": lambda m: [shard_zero(1)],
    "zero2+bf16": lambda m: [shard_zero(2), mixed_precision()],
    "zero3": lambda m: [shard_zero(3)],
    "zero3+offload+bf16": lambda m: [shard_zero(3), offload("cpu"), mixed_precision()],
    "zero3+offload_params": lambda m: [shard_zero(3), offload("cpu", params=True)],
    "zero1+tp": lambda m: [shard_zero(1), tensor_parallel(tp_plan(), model=m)],
}
FIELDS = ("params", "optimizer", "master", "host", "nvme")


def _measure(names, world):
    """On each rank: (measured fields, estimate fields) per stack."""
    out = {}
    for name in names:
        tp = 2 if "tp" in name else 1
        init_mesh(dp=world // tp, tp=tp)
        torch.manual_seed(0)
        model = GPT(CONF)
        apply_fn, params = dsfn.functionalize(model)
        tx = dsfn.optim.adamw(1e-3)
        step = dsfn.compose(*STACKS[name](model))(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, tx))
        expl = step.explain(state, token_batches(1, 4, 16, VOCAB)[0])
        with torch.device("meta"):
            meta = GPT(CONF)
        est = estimate_memory(meta, STACKS[name](model), world, tx=tx, tp=tp)
        assert expl.estimate is not None and "estimate | measured" in str(expl)
        out[name] = (measured_state_bytes(expl), {k: getattr(est, k) for k in FIELDS},
                     {k: getattr(expl.estimate, k) for k in FIELDS})
    return out


def _close(est, measured, rel=0.05):
    return all(math.isclose(est[k], measured[k], rel_tol=rel, abs_tol=0) for k in FIELDS)


@pytest.mark.parametrize("world", [2, 4])
def test_estimate_within_5_percent_of_explain(world):
    names = list(STACKS)
    for rank_result in run_on_ranks(_measure, world, names, world, timeout=300):
        for name, (measured, est, via_explain) in rank_result.items():
            assert sum(measured.values()) > 0
            assert _close(est, measured), (name, est, measured)
            assert _close(via_explain, measured), (name, via_explain, measured)
    # negative controls: another stage, another world size
    r = run_on_ranks(_measure, world, ["zero1"], world, timeout=300)[0]["zero1"][0]
    with torch.device("meta"):
        meta = GPT(CONF)
    wrong_stage = estimate_memory(meta, [shard_zero(0)], world)
    wrong_world = estimate_memory(meta, [shard_zero(1)], world * 2)
    assert not _close({k: getattr(wrong_stage, k) for k in FIELDS}, r)
    assert not _close({k: getattr(wrong_world, k) for k in FIELDS}, r)


def test_zero_paper_figures_and_deepspeed_formulas():
    """Ψ = 7.5B, N = 64, mixed-precision Adam (the ZeRO paper's Figure 1): the paper's
    (2 + 2 + 12)Ψ/N model states per rank at stage 3, and DeepSpeed's estimator formulas."""
    psi, n = 7_500_000_000, 64
    stack = [shard_zero(3), mixed_precision()]
    est = estimate_memory(psi, stack, n)
    paper = 16 * psi / n                     # 1.875e9 bytes: the paper's "1.9 GB"
    states = est.params + est.grads + est.optimizer + est.master
    assert math.isclose(states, paper, rel_tol=1e-3), (states, paper)
    est2 = estimate_memory(psi, [shard_zero(2), mixed_precision()], n)
    assert math.isclose(est2.params + est2.grads + est2.optimizer + est2.master, 2 * psi + 14 * psi / n, rel_tol=1e-3)
    # DeepSpeed's formulas, transcribed from stage_1_and_2.py / stage3.py (one GPU per node)
    assert deepspeed_zero2_estimate(psi, 1, n) == {"gpu": 2 * psi + int(18 * psi / n), "cpu": int(psi * 4 * 1.5)}
    assert deepspeed_zero3_estimate(psi, 10**8, 1, n, cpu_offload=True) == {
        "gpu": 4 * 10**8 + int(2 * psi / n), "cpu": int(psi * 16 / n * 1.5)}
    assert est.deepspeed()["gpu"] == int(18 * psi / n)      # no layer known for a bare count
    # offload moves the optimizer state and masters off the device
    off = estimate_memory(psi, [shard_zero(3), offload("cpu"), mixed_precision()], n)
    assert off.host == est.optimizer + est.master - off.optimizer and off.master == 0


def test_formulas_equal_deepspeeds_own():
    """The transcriptions against DeepSpeed's functions (when DeepSpeed is installed)."""
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e .[deepspeed])")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
    for psi, layer, per_node, nodes in [(7_000_000_000, 202_000_000, 8, 1), (7_000_000_000, 202_000_000, 8, 8),
                                        (1_234_567, 4321, 2, 3)]:
        for off in (False, True):
            cpu, gpu = z2(psi, per_node, nodes, cpu_offload=off)
            assert deepspeed_zero2_estimate(psi, per_node, nodes, cpu_offload=off) == {"gpu": gpu, "cpu": cpu}
            for off_p in (False, True):
                for init in (False, True):
                    cpu, gpu, _ = z3(psi, layer, per_node, nodes, cpu_offload=off, cpu_offload_params=off_p,
                                     zero_init=init)
                    assert deepspeed_zero3_estimate(psi, layer, per_node, nodes, off, off_p, init) == {
                        "gpu": gpu, "cpu": cpu}


def test_header_names_small_models_params_in_a_readable_unit():
    """A 50k-parameter model's header said "0.000B params"."""
    import torch
    from dsfn.estimate import _count
    assert (_count(7_241_732_096), _count(15_300_000), _count(50_244), _count(840)) == ("7.24B", "15.3M", "50.2K", "840")
    est = estimate_memory(torch.nn.Linear(100, 500), (), 1)
    assert "(50.5K params, world 1" in str(est), str(est)


# -- hybrid sharding and hpZ (world 4, 2 ranks per node) -----------------------------------------
HYBRID = {
    "zero3 hybrid": lambda: [shard_zero(3, shard_group="node")],
    "zero1 hybrid+bf16": lambda: [shard_zero(1, shard_group="node"), mixed_precision()],
    "zero3 hpz+bf16": lambda: [shard_zero(3, hpz="node"), mixed_precision()],
}


def _measure_hybrid():
    """On each rank: (measured state fields, the secondary gauge's peak over a step, the
    estimate, the estimate given ranks_per_node explicitly, its printed lines) per stack."""
    from dsfn.runtime import collectives as C
    out = {}
    for name, make in HYBRID.items():
        init_mesh()
        torch.manual_seed(0)
        model = GPT(CONF)
        apply_fn, params = dsfn.functionalize(model)
        tx = dsfn.optim.adamw(1e-3)
        step = dsfn.compose(*make())(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, tx))
        batch = token_batches(1, 4, 16, VOCAB)[0]
        expl = step.explain(state, batch)
        C.reset_gauges()
        state, _ = step(state, batch)
        secondary = C.gauge_max.get("zero3.secondary_bytes", 0)
        with torch.device("meta"):
            meta = GPT(CONF)
        est = estimate_memory(meta, make(), 4, tx=tx)                  # ranks per node: the launcher's
        given = estimate_memory(meta, make(), 4, tx=tx, ranks_per_node=2)
        out[name] = (measured_state_bytes(expl), secondary, {k: getattr(est, k) for k in FIELDS + ("secondary",)},
                     {k: getattr(given, k) for k in FIELDS + ("secondary",)}, str(est))
    return out


def test_hybrid_and_hpz_estimates_match_explain_and_the_secondary_gauge():
    """State 1/k of the shard group (k = 2 ranks per node), not 1/4, within 5% of explain's
    leaves; hpZ's secondary shards within 5% of the gauge's peak; both stated when printed.
    Negative controls: the flat estimate misses the hybrid state; the secondary is not zero."""
    results = run_on_ranks(_measure_hybrid, 4, timeout=300, ranks_per_node=2)
    for rank, res in enumerate(results):
        for name, (measured, secondary, est, given, text) in res.items():
            assert est == given, (name, est, given)
            assert _close(est, measured), (rank, name, est, measured)
            if "hpz" in name:
                assert secondary > 0 and math.isclose(est["secondary"], secondary, rel_tol=0.05), \
                    (rank, name, est["secondary"], secondary)
                assert "hpZ: each gathered unit keeps a secondary shard over 2 ranks" in text
                assert "secondary" in text.splitlines()[-2]
            else:
                assert est["secondary"] == 0 and secondary == 0, (name, est["secondary"], secondary)
                assert "shard groups of 2 of the 4 dp ranks (1/2 per rank, not 1/4) and replicated 2 times" in text
    with torch.device("meta"):
        meta = GPT(CONF)
    flat = estimate_memory(meta, [shard_zero(3)], 4)
    measured = results[0]["zero3 hybrid"][0]
    assert not _close({k: getattr(flat, k) for k in FIELDS}, measured)


def test_node_groups_need_the_ranks_per_node_of_another_world():
    with torch.device("meta"):
        meta = GPT(CONF)
    with pytest.raises(dsfn.errors.ConfigError, match="pass ranks_per_node="):
        estimate_memory(meta, [shard_zero(3, shard_group="node")], 64)
    est = estimate_memory(meta, [shard_zero(3, shard_group="node")], 64, ranks_per_node=8)
    flat = estimate_memory(meta, [shard_zero(3)], 64)
    assert est.shard_group == 8 and est.optimizer > 7 * flat.optimizer      # 1/8 instead of 1/64
    assert estimate_memory(meta, [shard_zero(3, shard_group=8)], 64).shard_group == 8


# -- pipeline parallel: the rank's stages only; activations held under the schedule ---------------
PCONF = GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=4, n_head=4, d_model=36)
PBATCH = (8, 16)          # rows x tokens of the step's batch
STATE = ("params", "optimizer")


def _pipe_model(family, device=None):
    from dsfn.testing.models import make_tiny_causal_lm
    with torch.device(device or "cpu"):
        return GPT(PCONF) if family == "gpt" else make_tiny_causal_lm("llama", num_hidden_layers=4)


def _measure_pipeline(families, mesh, zero):
    """On each rank, per model family: (measured state fields, explain's estimate fields, a
    standalone estimate's fields (meta model, this rank given), the old every-parameter
    estimate's fields, this rank's pipeline index, explain's text)."""
    from dsfn.runtime import current_mesh
    from dsfn.transforms import pipeline_parallel
    out = {}
    for family in families:
        init_mesh(**mesh)
        torch.manual_seed(0)
        model = _pipe_model(family)
        apply_fn, params = dsfn.functionalize(model)
        tx = dsfn.optim.adamw(1e-3)
        make = lambda m: ([shard_zero(zero)] if zero else []) + [pipeline_parallel("1f1b", 4, model=m)]
        step = dsfn.compose(*make(model))(train_step_for(apply_fn, lm_loss))
        state = step.place(dsfn.TrainState.create(params, tx))
        vocab = model.config.vocab_size
        expl = step.explain(state, token_batches(1, PBATCH[0], PBATCH[1], vocab)[0])
        world, rank = math.prod(mesh.values()), current_mesh().local_rank("pp")
        meta = _pipe_model(family, "meta")
        est = estimate_memory(meta, make(meta), world, tx=tx, pp=2, pp_rank=rank, batch=PBATCH)
        old = estimate_memory(meta, [shard_zero(zero)] if zero else [], world // 2 if zero else 1, tx=tx)
        fields = lambda e: {k: getattr(e, k) for k in FIELDS}
        out[family] = (measured_state_bytes(expl), fields(expl.estimate), fields(est), fields(old), rank, str(expl),
                       expl.estimate.pp_rank)
    return out


def _check_pipeline(results):
    for res in results:
        for family, (measured, via_explain, est, old, rank, text, est_rank) in res.items():
            assert measured["params"] > 0 and est_rank == rank
            for k in STATE:      # exactly the rank's leaves: its stages' whole tensors (ZeRO-1: 1/dp of the
                # moments; ZeRO-3: 1/dp of everything)
                assert via_explain[k] == measured[k] == est[k], (family, rank, k, via_explain[k], est[k], measured[k])
            # negative control: every parameter on every rank (the estimate before pipelines were read)
            assert old["params"] > 1.5 * measured["params"] and old["optimizer"] > 1.5 * measured["optimizer"]
            assert f"schedule '1f1b', 4 micro-batches, pp 2; pipeline rank {rank} holds stage {rank}" in text, text
            assert f"peak {2 - rank} micro-batch" in text and "activations" in text, text


def test_pipeline_estimate_counts_the_ranks_stages_only():
    """pp 2: GPT (untied) and a tiny Llama (its tied embedding on both ends) — params and
    optimizer state equal the measured leaves on each rank, via explain and standalone."""
    _check_pipeline(run_on_ranks(_measure_pipeline, 2, ["gpt", "llama"], {"pp": 2}, 0, timeout=300))


@pytest.mark.parametrize("zero", [1, 3])
def test_pipeline_estimate_with_zero_outside(zero):
    """pp 2 x dp 2 (world 4), shard_zero(1) outside: the stage's optimizer state 1/2 per rank;
    shard_zero(3): its parameters and optimizer state 1/2 per rank."""
    _check_pipeline(run_on_ranks(_measure_pipeline, 4, ["llama"], {"pp": 2, "dp": 2}, zero, timeout=300))


@pytest.mark.parametrize("schedule, p, m", [("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 2, 4), ("gpipe", 4, 2),
                                            ("interleaved", 2, 4), ("zbv", 2, 4)])
def test_pipeline_activation_peak_is_the_schedules(schedule, p, m):
    """The peak in micro-batches is the simulator's (1F1B: p - rank; GPipe: m); the bytes are
    the modelled micro-batch activations walked through the rank's order."""
    from dsfn.engines.pipeline.schedules import build_schedule, simulate
    from dsfn.estimate import ACT_VALUES_PER_LAYER
    from dsfn.transforms import pipeline_parallel
    meta = _pipe_model("gpt", "meta")
    pipe = pipeline_parallel(schedule, m, model=meta)
    sim = simulate(build_schedule(schedule, p, m, pipe.virtual))
    tokens, h = PBATCH[0] // m * PBATCH[1], PCONF.d_model
    per = {r: estimate_memory(meta, [pipe], p, pp=p, pp_rank=r, batch=PBATCH) for r in range(p)}
    for r, est in per.items():
        assert est.peak_microbatches == sim.peak_activations[r]
        if schedule == "1f1b":
            assert est.peak_microbatches == p - r
        if schedule == "gpipe":
            assert est.peak_microbatches == m
        if pipe.virtual == 1:        # one stage: peak x that stage's micro-batch, the model by hand
            layers = PCONF.n_layer // p
            values = layers * ACT_VALUES_PER_LAYER * tokens * h + (tokens * h if r == 0 else 0) \
                + (tokens * VOCAB if r == p - 1 else 0)
            assert est.microbatch_activations == values * 4
            assert est.activations == est.peak_microbatches * est.microbatch_activations
        assert est.activations > 0 and f"under '{schedule}'" in str(est) and "modelled" in str(est)
        assert f"peak {sim.peak_activations[r]:g} micro-batch" in str(est), str(est)
    heaviest = estimate_memory(meta, [pipe], p, pp=p, batch=PBATCH)       # no pp_rank: the largest device peak
    assert heaviest.device == max(e.device for e in per.values())
    if schedule in ("1f1b", "gpipe"):   # GPipe: every rank holds m; 1F1B: rank 0 holds the most
        assert per[0].activations > per[p - 1].activations or schedule == "gpipe"


def test_pipeline_estimate_needs_the_model_and_a_rank_in_range():
    from dsfn.transforms import pipeline_parallel
    meta = _pipe_model("gpt", "meta")
    shapes = {n: tuple(x.shape) for n, x in meta.named_parameters()}
    with pytest.raises(dsfn.errors.ConfigError, match="needs the model's layers"):
        estimate_memory(shapes, [pipeline_parallel("1f1b", 4)], 2)
    with pytest.raises(dsfn.errors.ConfigError, match="pp_rank=2"):
        estimate_memory(meta, [pipeline_parallel("1f1b", 4, model=meta)], 2, pp_rank=2)
    est = estimate_memory(shapes, [pipeline_parallel("1f1b", 4, model=meta)], 2, pp_rank=1)
    assert est.activations == 0 and "pass batch=(rows, seq_len)" in str(est) and est.peak_microbatches == 1
    with pytest.raises(dsfn.errors.ConfigError, match="do not split into 1 dp rank x 3 micro-batches"):
        estimate_memory(meta, [pipeline_parallel("gpipe", 3, model=meta)], 2, batch=(8, 16))


# -- the estimate is the stack's own placement of a meta state on a virtual mesh -----------------
def _placed_vs_estimate(names):
    """On each rank of world 2: per stack, (the state fields of step.place's state, of
    step.init_state's, the estimate's)."""
    from dsfn.estimate import state_fields
    from dsfn.state.layout import leaf_records
    out = {}
    for name in names:
        tp = 2 if "tp" in name else 1
        init_mesh(dp=2 // tp, tp=tp)
        torch.manual_seed(0)
        model = GPT(CONF)
        apply_fn, params = dsfn.functionalize(model)
        tx = dsfn.optim.adamw(1e-3)
        step = dsfn.compose(*STACKS[name](model))(train_step_for(apply_fn, lm_loss))
        placed = state_fields(leaf_records(step.place(dsfn.TrainState.create(params, tx))))
        fresh = state_fields(leaf_records(step.init_state(params, tx)))
        with torch.device("meta"):
            meta = GPT(CONF)
        est = estimate_memory(meta, STACKS[name](meta), 2, tx=tx, tp=tp)
        out[name] = (placed, fresh, {k: getattr(est, k) for k in FIELDS})
    return out


def test_estimate_equals_the_placed_and_the_initialised_state_at_world_2():
    """Exactly (not within 5%): the estimate's state fields are the bytes of the leaves that
    `step.place` and `step.init_state` make on each rank."""
    for res in run_on_ranks(_placed_vs_estimate, 2, list(STACKS), timeout=300):
        for name, (placed, fresh, est) in res.items():
            assert sum(placed.values()) > 0 and est == placed == fresh, (name, est, placed, fresh)


def test_virtual_mesh_has_sizes_and_ranks_and_no_group():
    from dsfn.errors import MeshError
    from dsfn.runtime import collectives as C
    from dsfn.runtime.mesh import Mesh, current_mesh, on_virtual_mesh
    from dsfn.runtime.topology import Topology
    mesh = Mesh.virtual({"dp": 4, "tp": 2}, {"dp": 1, "tp": 1}, Topology(2, 4))
    assert (mesh.rank, mesh.size("dp"), mesh.local_rank("tp"), mesh.ranks("dp")) == (3, 4, 1, [1, 3, 5, 7])
    assert mesh.group("dp") is None and mesh.ranks_on_node("dp") == 2
    assert mesh.split("dp", 2) == ("dp_shard", "dp_replicate") and mesh.group("dp_shard") is None
    with on_virtual_mesh(mesh):
        assert current_mesh() is mesh
        with pytest.raises(MeshError, match="virtual mesh"):
            C.all_reduce_(torch.ones(2), "dp", "sum")
    assert current_mesh() is not mesh


# names a transform's options or its identity: what the estimate must not read of a transform
_TRANSFORM_ATTRS = {"stage", "axis", "reduce_bucket_size", "allgather_bucket_size", "param_persistence_threshold",
                    "units", "shard_group", "hpz", "cross_node", "param_dtype", "master_dtype", "reduce_dtype",
                    "device", "params", "policy", "modules", "offload", "partition_activations", "schedule",
                    "microbatches", "virtual", "split", "layers", "model", "bucket_mb", "name", "_module",
                    "_engine", "_replicas", "active", "wire_dtype"}
# the estimate's own objects whose attributes it reads (its MemoryEstimate, a stage plan, a schedule action)
_OWN = {"self", "est", "e", "state", "Mesh", "plan", "act", "config", "mesh", "topo", "p", "x", "t", "z", "a", "torch", "math", "tree"}


def _reads_of_transforms(source: str) -> list[str]:
    """What a module's source does that only a second model of the transforms would: import a
    transform module (but the facts, and compose's registry of explain's view), compare a `.name`, or read a transform attribute (an
    attribute named like a transform option, of anything but the estimate's own objects)."""
    import ast
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsfn.transforms") \
                and node.module not in ("dsfn.transforms.facts", "dsfn.transforms.compose"):
            bad.append(f"imports {node.module}")
        elif isinstance(node, ast.Compare) and any(isinstance(x, ast.Attribute) and x.attr == "name"
                                                   for x in [node.left, *node.comparators]):
            bad.append(f"compares .name (line {node.lineno})")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in \
                _TRANSFORM_ATTRS:
            bad.append(f"{node.func.id}(..., {node.args[1].value!r}) (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and node.attr in _TRANSFORM_ATTRS \
                and not (isinstance(node.value, ast.Name) and node.value.id in _OWN):
            bad.append(f"reads .{node.attr} (line {node.lineno})")
    return bad


def test_the_estimate_finds_no_transform_by_name_and_reads_none_of_their_attributes():
    """dsfn.estimate (and its activation model) meets the transforms only through their
    `place` and published facts. Negative control: the old estimate's ways are caught."""
    import pathlib
    root = pathlib.Path(dsfn.__file__).parent
    for module in ("estimate.py", "estimate_activations.py", "estimate_explain.py", "estimate_deepspeed.py"):
        assert _reads_of_transforms((root / module).read_text()) == [], module
    old = ("from dsfn.transforms.zero import ShardZero\n"
           "zero = next(t for t in stack if t.name == 'shard_zero')\n"
           "stage = zero.stage\nrb = getattr(zero, 'reduce_bucket_size', None)\n")
    assert len(_reads_of_transforms(old)) == 4, _reads_of_transforms(old)


def test_context_parallel_activations_are_a_cp_th_and_one_kv_block_rides_along():
    """estimate_memory(batch=) for a context-parallel stack: per-rank activations of rows (/ dp
    under a data-parallel transform) x seq / (cp x sp) tokens (1/cp of the cp-1 model's), and one K/V block [rows, Hkv/sp, seq/cp, D]
    x 2 + int64 positions in flight; dp = world / cp. The saved bytes of a real run are
    measured against it in benchmarks/context_parallel.py."""
    pytest.importorskip("transformers")
    from dsfn.estimate_activations import ring_activations
    from dsfn.testing.models import make_tiny_causal_lm
    from dsfn.transforms import context_parallel, sequence_parallel
    m = make_tiny_causal_lm("llama")
    cfg = m.config
    d = cfg.hidden_size // cfg.num_attention_heads
    by = {}
    for cp in (2, 4):
        est = estimate_memory(m, (context_parallel(),), 2 * cp, batch=(4, 64), cp=cp)
        assert est.mesh["cp"] == cp and est.mesh["dp"] == 2
        by[cp] = est
        # no data-parallel transform: every rank keeps all 4 rows
        assert est.ring_in_flight == 2 * 4 * cfg.num_key_value_heads * (64 // cp) * d * 4 + 8 * (64 // cp)
        assert "activations" in str(est) and "ring block" in str(est)
    assert by[2].activations == 2 * by[4].activations
    one = MemoryEstimate()
    ring_activations(one, m, (4, 64), 1, 1, 1, 1, 4)
    assert by[2].activations * 2 == one.activations
    est = estimate_memory(m, (context_parallel(), sequence_parallel()), 4, batch=(4, 64))
    assert est.mesh["cp"] == 2 and est.mesh["sp"] == 2 and est.activations == by[4].activations
    assert est.ring_in_flight == 2 * 4 * (cfg.num_key_value_heads // 2) * 32 * d * 4 + 8 * 32
