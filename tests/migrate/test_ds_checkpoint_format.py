"""The DeepSpeed checkpoint reader on files laid out as DeepSpeed 0.19 writes them, without DeepSpeed.

`test_ds_checkpoint.py` reads checkpoints of a real DeepSpeed run (and needs DeepSpeed);
this file builds the same layouts itself from known tensors — ZeRO-1/2 flat groups padded to
2 x dp and cut into dp parts (two param groups, alignment padding), ZeRO-3 per-parameter
ceil(numel / dp) partitions over two sub-groups, ZeRO-0 model states, and a universal
checkpoint's per-parameter folders — with a `deepspeed.*` class inside the pickles (read as
an inert stand-in), so it runs wherever dsfn does. Each layout reads back bitwise; a
checkpoint whose rank files are swapped reads back wrong (negative control).
"""
import importlib.util
import math
import os
import sys
import types

import pytest
import torch

import dsfn
from dsfn.errors import CheckpointError, ConfigError
from dsfn.migrate import load_deepspeed, read_deepspeed

SHAPES = [{"a.weight": (5, 3), "a.bias": (5,)}, {"b.weight": (2, 5), "b.bias": (2,)}]   # two param groups
NAMES = [n for g in SHAPES for n in g]


def _values(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for grp in SHAPES for n, s in grp.items()}


def _fake_deepspeed_class():
    """A class pickled as `deepspeed.runtime.fp16.loss_scaler.LossScaler` (then unimportable)."""
    mod = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")

    class LossScaler:
        def __init__(self, scale):
            self.cur_scale = scale
    LossScaler.__module__ = mod.__name__
    LossScaler.__qualname__ = "LossScaler"
    mod.LossScaler = LossScaler
    return mod, LossScaler


def _save(obj, path):
    mod, _ = _fake_deepspeed_class()
    saved = {k: sys.modules.get(k) for k in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
                                             mod.__name__)}
    for k in saved:
        sys.modules[k] = mod if k == mod.__name__ else types.ModuleType(k)
    try:
        scaler = mod.LossScaler(1024.0)
        obj = {**obj, "loss_scaler": scaler} if "optimizer_state_dict" not in obj else obj
        torch.save(obj, path)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _model_states(path, stage, dp, steps=7):
    name = "zero_pp_rank_{r}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    for r in range(dp if stage == 3 else 1):
        _save({"module": {}, "param_shapes": [{n: torch.Size(s) for n, s in g.items()} for g in SHAPES],
               "global_steps": steps, "skipped_steps": 1, "lr_scheduler": {"last_batch_iteration": steps - 2},
               "dp_world_size": dp}, os.path.join(path, name.format(r=r)))


def write_zero12(path, values, moments, dp, stage=2, align=1):
    """Flat per group, `align` zeros after each parameter, padded to 2*dp, cut into dp parts."""
    os.makedirs(path)
    _model_states(path, stage, dp)
    parts = {k: [[] for _ in range(dp)] for k in ("fp32", "exp_avg", "exp_avg_sq")}
    pads = []
    for g in SHAPES:
        for key, src in (("fp32", values), ("exp_avg", moments[0]), ("exp_avg_sq", moments[1])):
            flat = torch.cat([torch.cat([src[n].reshape(-1), torch.zeros(align)]) for n in g])
            total = math.ceil(flat.numel() / (2 * dp)) * 2 * dp
            flat = torch.cat([flat, torch.zeros(total - flat.numel())])
            for r, piece in enumerate(flat.chunk(dp)):
                parts[key][r].append(piece.clone())
        pads.append([align] * len(g))
    for r in range(dp):
        sd = {"zero_stage": stage,
              "partition_count": [dp] * len(SHAPES), "param_alignment_paddings": pads,
              "single_partition_of_fp32_groups": parts["fp32"][r],
              "base_optimizer_state": {"state": {g: {"step": torch.tensor(5.0), "exp_avg": parts["exp_avg"][r][g],
                                                     "exp_avg_sq": parts["exp_avg_sq"][r][g]}
                                                 for g in range(len(SHAPES))},
                                       "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8,
                                                         "weight_decay": 0.0, "params": [g]}
                                                        for g in range(len(SHAPES))]}}
        _save({"optimizer_state_dict": sd}, os.path.join(path, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


def write_zero3(path, values, moments, dp):
    """Every parameter cut into ceil(numel / dp) pieces; one sub-group per param group."""
    os.makedirs(path)
    _model_states(path, 3, dp)
    for r in range(dp):
        groups = {k: [] for k in ("fp32", "exp_avg", "exp_avg_sq")}
        for g in SHAPES:
            for key, src in (("fp32", values), ("exp_avg", moments[0]), ("exp_avg_sq", moments[1])):
                pieces = []
                for n in g:
                    flat = src[n].reshape(-1)
                    c = math.ceil(flat.numel() / dp)
                    flat = torch.cat([flat, torch.zeros(c * dp - flat.numel())])
                    pieces.append(flat[r * c:(r + 1) * c])
                groups[key].append(torch.cat(pieces))
        sd = {"zero_stage": 3, "partition_count": dp, "fp32_flat_groups": groups["fp32"],
              "optimizer_state_dict": {"state": {i: {"step": torch.tensor(5.0), "exp_avg": groups["exp_avg"][i],
                                                     "exp_avg_sq": groups["exp_avg_sq"][i]}
                                                 for i in range(len(SHAPES))},
                                       "param_groups": [{"lr": 0.01, "params": [i]} for i in range(len(SHAPES))]}}
        _save({"optimizer_state_dict": sd}, os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


def write_universal(path, values, moments):
    os.makedirs(os.path.join(path, "zero"))
    _model_states(path, 1, 2)
    for n in NAMES:
        d = os.path.join(path, "zero", n)
        os.makedirs(d)
        for key, src in (("fp32", values), ("exp_avg", moments[0]), ("exp_avg_sq", moments[1])):
            torch.save({"param": src[n], "cat_dim": 0}, os.path.join(d, f"{key}.pt"))
        torch.save(torch.tensor(5.0), os.path.join(d, "step.pt"))
    _save({"zero_stage": 1, "param_groups": [{"lr": 0.01, "params": [0]}]},
          os.path.join(path, "zero", "optimizer_state.pt"))


@pytest.fixture
def tensors():
    return _values(0), (_values(1), {n: v.abs() for n, v in _values(2).items()})


def _check(ds, values, moments, stage):
    assert ds.zero_stage == stage and ds.adam_step == 5 and ds.updates == 5 and ds.global_steps == 7
    assert ds.lr_last_batch_iteration == 5
    for n in NAMES:
        assert torch.equal(ds.params[n], values[n]), n
        assert torch.equal(ds.exp_avg[n], moments[0][n]), n
        assert torch.equal(ds.exp_avg_sq[n], moments[1][n]), n


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_layouts_read_back_bitwise(tmp_path, tensors, stage, dp):
    values, moments = tensors
    d = str(tmp_path / "global_step7")
    (write_zero3(d, values, moments, dp) if stage == 3 else write_zero12(d, values, moments, dp, stage))
    (tmp_path / "latest").write_text("global_step7")
    _check(read_deepspeed(str(tmp_path), trust_pickle=True), values, moments, stage)
    if dp > 1:        # negative control: rank files in the wrong order read back other tensors
        files = sorted(f for f in os.listdir(d) if "optim_states" in f)
        a, b = (os.path.join(d, f) for f in files[:2])
        os.rename(a, a + ".tmp"), os.rename(b, a), os.rename(a + ".tmp", b)
        with pytest.raises(AssertionError):
            _check(read_deepspeed(d, trust_pickle=True), values, moments, stage)


def test_universal_reads_back_and_loads_into_a_state(tmp_path, tensors):
    values, moments = tensors
    write_universal(str(tmp_path / "uc"), values, moments)
    ds = read_deepspeed(str(tmp_path / "uc"), trust_pickle=True)
    _check(ds, values, moments, 1)
    params = {n: torch.zeros(s) for g in SHAPES for n, s in g.items()}
    state = load_deepspeed(str(tmp_path / "uc"), like=dsfn.TrainState.create(params, dsfn.optim.adamw(0.01)),
                           trust_pickle=True)
    adam = state.opt_state[1]
    assert int(state.step) == 5 and int(adam.count) == 5
    for n in NAMES:
        assert torch.equal(state.params[n], values[n]) and torch.equal(adam.mu[n], moments[0][n])
    with pytest.raises(CheckpointError, match="names="):       # a parameter the checkpoint lacks
        load_deepspeed(str(tmp_path / "uc"), like=dsfn.TrainState.create({**params, "c": torch.zeros(2)},
                                                                          dsfn.optim.adamw(0.01)), trust_pickle=True)


def test_deepspeed_classes_are_inert_stand_ins(tmp_path, tensors):
    values, moments = tensors
    d = str(tmp_path / "z2")
    write_zero12(d, values, moments, 2)
    ms = os.path.join(d, "mp_rank_00_model_states.pt")
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(Exception):        # plain torch.load cannot import the class
            torch.load(ms, weights_only=False)
    from dsfn.migrate.ds_files import load_ds_file
    obj = load_ds_file(ms)
    assert type(obj["loss_scaler"]).__module__.startswith("dsfn.migrate.stub.deepspeed")
    assert obj["loss_scaler"].cur_scale == 1024.0


def test_pickles_need_explicit_trust_and_errors_name_the_problem(tmp_path, tensors):
    values, moments = tensors
    write_zero3(str(tmp_path / "z3"), values, moments, 2)
    with pytest.raises(ConfigError, match="trust_pickle=True"):
        read_deepspeed(str(tmp_path / "z3"))
    with pytest.raises(ConfigError, match="trust_pickle=True"):
        read_deepspeed(str(tmp_path / "z3"), trust_pickle="yes")
    os.remove(tmp_path / "z3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="a file is missing"):
        read_deepspeed(str(tmp_path / "z3"), trust_pickle=True)
    with pytest.raises(CheckpointError, match="holds no DeepSpeed checkpoint"):
        read_deepspeed(str(tmp_path), trust_pickle=True)


def test_a_deepspeed_moe_checkpoint_with_expert_files_is_refused_by_name(tmp_path, tensors):
    """DeepSpeed MoE writes each expert's weights to files of their own: read as a plain ZeRO
    checkpoint the experts would be missing, so the reader refuses and says what to do."""
    values, moments = tensors
    d = tmp_path / "z3"
    write_zero3(str(d), values, moments, 2)
    read_deepspeed(str(d), trust_pickle=True)                   # without expert files it reads
    torch.save({"w": torch.zeros(2)}, d / "layer_0_expert_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="MoE expert files .*layer_0_expert_0.*ds_to_universal"):
        read_deepspeed(str(d), trust_pickle=True)
