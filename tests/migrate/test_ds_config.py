"""`from_ds_config`: DeepSpeed's example configs train exactly like the stack written by hand.

Each config below is one of DeepSpeed's documented examples (docs/_pages/config-json.md,
the ZeRO / offload / Muon / Ulysses tutorials), sized for 2 gloo ranks. On 2 ranks the
stack and optimizer `from_ds_config` builds and the hand-written dsfn equivalent train a
few steps with bitwise equal losses and final state. Negative controls: the same config
with its main feature switched off (fp16, bf16, offload, Muon, sequence parallel, a bf16
communication dtype) gives another stack and, where the feature changes the arithmetic by
design (another precision or optimizer), other numbers. Offload computes what the device
would (the host AdamW and the device AdamW may round the same), so its numeric control
breaks the feature instead: the offloaded optimizer state is never written back (the
update's new moments lost), and the run must miss. Unsupported keys raise
one ConfigError listing all of them (exact message); performance keys give one warning;
DeepSpeed's batch-size rule accepts every consistent combination and rejects the others
with DeepSpeed's meaning of each size.
"""
import contextlib
import copy
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import batch_sizes, from_ds_config
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.optim import WarmupDecayLR
from dsfn.runtime import init_mesh
from dsfn.testing import assert_trees_equal, run_on_ranks
from dsfn.testing.models import make_mlp, regression_batches, token_batches
from dsfn.testing.reference import lm_loss, mse_loss_fp32, train_step_for
from dsfn.transforms.offload import Offload
from dsfn.transforms import (accumulate, clip_grad_norm, loss_scale, mixed_precision, offload, sequence_parallel,
                             shard_zero)

WORLD = 2
STEPS = 3

ZERO2_FP16 = {      # config-json.md's fp16 example with its ZeRO-2 block
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
}
ZERO3_BF16_CPU = {  # the ZeRO-3 + bf16 + CPU offload config of the reference study, 2 ranks
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_min_lr": 0,
                                                      "warmup_max_lr": 3e-4, "warmup_num_steps": 2,
                                                      "warmup_type": "linear"}},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                          "stage3_param_persistence_threshold": 10, "offload_optimizer": {"device": "cpu",
                                                                                          "pin_memory": True}},
}
ZERO3_NVME = {      # ZeRO-Infinity: optimizer state and parameters on NVMe
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True,
                                                "buffer_count": 4},
                          "offload_param": {"device": "nvme", "nvme_path": "NVME", "buffer_size": 1e8}},
    "aio": {"block_size": 1048576, "queue_depth": 8},
}
MUON = {            # the Muon tutorial's config
    "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
    "optimizer": {"type": "Muon", "params": {"lr": 0.01, "momentum": 0.95, "weight_decay": 0.1, "adam_lr": 3e-3}},
    "zero_optimization": {"stage": 2},
}
FP32_COMM_BF16 = {  # fp32 training whose gradients travel in bf16 (communication_data_type)
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "communication_data_type": "bf16",
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
}
SP = {              # Ulysses: sequence_parallel_size 2 on 2 ranks (dp 1)
    "train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 1},
}


def _hand(name, model, tmp):
    """The dsfn stack and optimizer one would write by hand for each config."""
    if name == "zero2_fp16":
        return ([shard_zero(2, reduce_bucket_size=200_000_000, allgather_bucket_size=200_000_000),
                 mixed_precision(torch.float16), loss_scale(init_scale=2.0**16, window=1000, hysteresis=2, min_scale=1),
                 clip_grad_norm(1.0)],                           # DeepSpeed's default gradient_clipping is 1.0
                dsfn.optim.adamw(1e-3, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7))   # "Adam" is AdamW
    if name == "zero3_bf16_cpu":
        lr = WarmupDecayLR(total_num_steps=100, warmup_min_lr=0, warmup_max_lr=3e-4, warmup_num_steps=2,
                           warmup_type="linear")
        return ([shard_zero(3, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000,
                            param_persistence_threshold=10), accumulate(2), offload("cpu"),
                 mixed_precision(torch.bfloat16), clip_grad_norm(1.0)],
                dsfn.optim.adamw(lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    if name == "zero3_nvme":
        return ([shard_zero(3, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000),
                 offload("nvme", params=True, path=tmp), clip_grad_norm(0.5)],
                dsfn.optim.adamw(1e-3, weight_decay=0.0))         # FusedAdam / CPU Adam default: no decay
    if name == "muon":
        return ([shard_zero(2, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000),
                 clip_grad_norm(1.0)], dsfn.optim.muon(0.01, momentum=0.95, weight_decay=0.1, adam_lr=3e-3))
    if name == "fp32_comm_bf16":
        return ([shard_zero(2, reduce_bucket_size=500_000_000, allgather_bucket_size=500_000_000),
                 mixed_precision(torch.float32, reduce_dtype=torch.bfloat16), clip_grad_norm(1.0)],
                dsfn.optim.adamw(1e-3, weight_decay=0.0))         # FusedAdam default: no decay
    if name == "sp":
        return ([sequence_parallel(), shard_zero(1, reduce_bucket_size=500_000_000,
                                                 allgather_bucket_size=500_000_000), clip_grad_norm(1.0)],
                dsfn.optim.adamw(1e-3, weight_decay=0.01))
    raise KeyError(name)


CONFIGS = {"zero2_fp16": (ZERO2_FP16, "fp16"), "zero3_bf16_cpu": (ZERO3_BF16_CPU, "bf16"),
           "zero3_nvme": (ZERO3_NVME, "offload"), "muon": (MUON, "optimizer"), "sp": (SP, "sequence_parallel_size"),
           "fp32_comm_bf16": (FP32_COMM_BF16, "communication_data_type")}
EXPECTED = {   # transform names, outermost first
    "zero2_fp16": ["shard_zero", "mixed_precision", "loss_scale", "clip_grad_norm"],
    "zero3_bf16_cpu": ["shard_zero", "accumulate", "offload", "mixed_precision", "clip_grad_norm"],
    "zero3_nvme": ["shard_zero", "offload", "clip_grad_norm"],
    "muon": ["shard_zero", "clip_grad_norm"],
    "sp": ["sequence_parallel", "shard_zero", "clip_grad_norm"],
    "fp32_comm_bf16": ["shard_zero", "mixed_precision", "clip_grad_norm"],
}


def _switched_off(name):
    cfg, key = copy.deepcopy(CONFIGS[name][0]), CONFIGS[name][1]
    if key == "offload":
        del cfg["zero_optimization"]["offload_optimizer"], cfg["zero_optimization"]["offload_param"]
    elif key == "optimizer":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}
    else:
        del cfg[key]
    return cfg


def _with_path(cfg, tmp):
    cfg = copy.deepcopy(cfg)
    for k in ("offload_optimizer", "offload_param"):
        block = cfg.get("zero_optimization", {}).get(k)
        if block and "nvme_path" in block:
            block["nvme_path"] = tmp
    return cfg


@contextlib.contextmanager
def _offloaded_state_never_written():
    """The offload's update runs, but its new optimizer state is dropped: every step starts
    again from the state placed at the start (the moments written to host memory / NVMe lost)."""
    orig = Offload.handle_apply_gradients

    def lossy(self, call_next, state, grads):
        return orig(self, call_next, state, grads).replace(opt_state=state.opt_state)
    with mock.patch.object(Offload, "handle_apply_gradients", lossy):
        yield


def _train(name, how, tmp):
    """Losses and the final logical state of config `name` built `how` ("config", "hand", "off",
    "broken": the config with its offload's state never written)."""
    if how == "broken":
        with _offloaded_state_never_written():
            return _train(name, "config", tmp)
    sp = name == "sp" and how != "off"
    init_mesh(dp=1, sp=2) if sp else init_mesh(dp=WORLD)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, seq_len=16, n_layer=2, n_head=4, d_model=32)) if name == "sp" \
        else make_mlp([6, 16, 16, 3])
    batches = (token_batches(STEPS, 4, 16, 61, seed=2) if name == "sp" else regression_batches(STEPS, 8, 6, 3, seed=2))
    apply_fn, params = dsfn.functionalize(model)
    if how == "hand":
        transforms, tx = _hand(name, model, tmp)
    else:
        cfg = _with_path(CONFIGS[name][0] if how == "config" else _switched_off(name), tmp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = from_ds_config(cfg, model=model, world_size=WORLD)
        transforms, tx = got.transforms, got.tx
        if how == "config":
            assert got.mesh == ({"pp": 1, "dp": 1, "sp": 2, "tp": 1} if sp else {"pp": 1, "dp": WORLD, "sp": 1, "tp": 1})
    names = [t.name for t in transforms]
    loss = lm_loss if name == "sp" else mse_loss_fp32
    step = dsfn.compose(*transforms)(train_step_for(apply_fn, loss))
    state = step.place(dsfn.TrainState.create(params, tx))
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    full = step.gather(state)
    return names, {"losses": torch.stack(losses), "params": full.params, "opt_state": full.opt_state,
                   "step": full.step}


def _all(tmp):
    return {name: {how: _train(name, how, f"{tmp}/{name}-{how}")
                   for how in ("config", "hand", "off") + (("broken",) if CONFIGS[name][1] == "offload" else ())}
            for name in CONFIGS}


def test_example_configs_train_like_the_hand_written_stack(tmp_path):
    for rank_result in run_on_ranks(_all, WORLD, str(tmp_path), timeout=300):
        for name, runs in rank_result.items():
            (names, got), (hand_names, hand), (off_names, off) = runs["config"], runs["hand"], runs["off"]
            assert names == hand_names == EXPECTED[name], (name, names)
            assert_trees_equal(got, hand, msg=name)
            # negative control: the feature switched off changes the stack, and the numbers where the
            # feature changes the arithmetic by design (precision, optimizer)
            assert off_names != names or name == "muon", name      # Muon -> AdamW: the same stack, other tx
            if CONFIGS[name][1] in ("fp16", "bf16", "optimizer", "communication_data_type"):
                with pytest.raises(AssertionError):
                    assert_trees_equal(off, hand)
            if "broken" in runs:      # offload: its state never written back must be seen
                with pytest.raises(AssertionError):
                    assert_trees_equal(runs["broken"][1], hand)


def test_unsupported_keys_are_listed_in_one_error():
    cfg = {**copy.deepcopy(ZERO2_FP16), "amp": {"enabled": True},
           "pipeline": {"stages": 2, "activation_checkpoint_interval": 3}, "gradient_allreduce_op": "sum"}
    cfg["zero_optimization"].update(zero_quantized_gradients=True, zero_hpz_partition_size=8)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "ratio": 0.3}
    cfg["optimizer"]["params"]["torch_adam"] = True
    cfg["bf16"] = {"enabled": False}
    with pytest.raises(ConfigError) as e:
        from_ds_config(cfg, world_size=4)
    assert str(e.value) == (
        "ds_config has 7 setting(s) dsfn does not reproduce; remove them (or change them as noted) and call "
        "from_ds_config again:\n"
        "  - pipeline.activation_checkpoint_interval: 3: DeepSpeed checkpoints groups of 3 layers; dsfn's remat() "
        "checkpoints each layer of a stage: set 1 (every layer; the same numbers) or 0\n"
        "  - gradient_accumulation_steps: 1 with pipeline.stages 2: the accumulation steps are the pipeline's "
        "micro-batches, and dsfn's 1F1B needs at least one per stage; set it >= 2 (and train_batch_size to match)\n"
        "  - zero_optimization.offload_optimizer.ratio: partial (Twin-Flow) offload: dsfn offloads all of the "
        "optimizer state; use 1.0\n"
        "  - zero_optimization.zero_hpz_partition_size: DeepSpeed reads it only at ZeRO stage 3; set stage 3 (then "
        "it is shard_zero(3, hpz=2)), or remove it\n"
        "  - zero_optimization.zero_quantized_gradients: DeepSpeed quantizes ZeRO-3's gradient reduce-scatter; set "
        "stage 3 (then it is shard_zero(3, quantize_grads='int4')), or remove it\n"
        "  - amp: use bf16/fp16 (dsfn's mixed_precision) instead\n"
        "  - gradient_allreduce_op: 'sum': dsfn averages gradients over data parallel (DeepSpeed's 'mean')")
    # negative control: without those keys the same config is accepted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert from_ds_config(ZERO2_FP16, world_size=2).gradient_accumulation_steps == 1


def test_performance_keys_give_one_warning():
    with pytest.warns(UserWarning) as rec:
        cfg = from_ds_config(ZERO2_FP16, world_size=2)
    assert len(rec) == 1
    msg = str(rec[0].message)
    for key in ("zero_optimization.allgather_partitions", "zero_optimization.overlap_comm",
                "zero_optimization.reduce_scatter", "zero_optimization.contiguous_gradients"):
        assert key in msg and key in cfg.ignored
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # negative control: nothing to ignore, no warning
        from_ds_config({"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, world_size=2)


def test_keys_a_stage_or_a_static_scale_never_reads_are_listed_as_ignored():
    """DeepSpeed ignores allgather_bucket_size at stage 0 and the dynamic fp16 keys beside a static
    loss_scale; dsfn's transforms refuse those options (issue 31), so the converter leaves them
    out and lists them as ignored (with the one warning), rather than failing or passing them."""
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 0, "allgather_bucket_size": 2e8},
           "fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 500, "hysteresis": 1}}
    with pytest.warns(UserWarning) as rec:
        got = from_ds_config(cfg, world_size=2)
    assert len(rec) == 1
    for key in ("zero_optimization.allgather_bucket_size", "fp16.loss_scale_window", "fp16.hysteresis"):
        assert key in str(rec[0].message) and key in got.ignored
    zero, scaler = got.transforms[0], next(t for t in got.transforms if t.name == "loss_scale")
    assert zero.stage == 0 and zero.allgather_bucket_size == 50_000_000
    assert scaler.static and scaler.init_scale == 128.0
    two = from_ds_config({**cfg, "zero_optimization": {"stage": 2, "allgather_bucket_size": 2e8},
                          "fp16": {"enabled": True}}, world_size=2)
    assert two.transforms[0].allgather_bucket_size == 200_000_000      # stage 2 reads it


def test_deepspeed_defaults():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cfg = from_ds_config({"train_batch_size": 4, "optimizer": {"type": "AdamW"}}, world_size=2)
        assert [t.name for t in cfg.transforms] == ["shard_zero", "clip_grad_norm"]     # clipping 1.0 by default
        assert cfg.transforms[1].max_norm == 1.0 and cfg.transforms[0].stage == 0
        off = from_ds_config({"train_batch_size": 4, "gradient_clipping": 0, "optimizer": {"type": "AdamW"}},
                             world_size=2)
        assert [t.name for t in off.transforms] == ["shard_zero"]
        z3 = from_ds_config({"train_batch_size": 4, "optimizer": {"type": "Adam"},
                             "zero_optimization": {"stage": 3}}, world_size=2)
        assert z3.transforms[0].param_persistence_threshold == 100_000
        assert z3.transforms[0].reduce_bucket_size == 500_000_000
    with pytest.raises(ConfigError, match="gradient_clipping"):
        from_ds_config({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
                       world_size=2)


@settings(max_examples=60, deadline=None)
@given(micro=st.integers(1, 16), gas=st.integers(1, 8), world=st.integers(1, 16),
       given_=st.sampled_from(["all", "tb+mb", "tb+gas", "mb+gas", "tb", "mb"]))
def test_batch_rule_accepts_consistent_sizes(micro, gas, world, given_):
    tb = micro * gas * world
    args = {"all": (tb, micro, gas), "tb+mb": (tb, micro, None), "tb+gas": (tb, None, gas),
            "mb+gas": (None, micro, gas), "tb": (tb, None, None), "mb": (None, micro, None)}[given_]
    got = batch_sizes(*args, world)
    assert got[0] == got[1] * got[2] * world
    if given_ in ("all", "tb+mb", "tb+gas", "mb+gas"):
        assert got == (tb, micro, gas)
    elif given_ == "tb":
        assert got == (tb, micro * gas, 1)
    else:
        assert got == (micro * world, micro, 1)


@pytest.mark.parametrize("tb,mb,gas,world", [(32, 4, 2, 2), (30, 4, None, 2), (30, None, 4, 2), (6, None, None, 4)])
def test_batch_rule_rejects_inconsistent_sizes(tb, mb, gas, world):
    with pytest.raises(ConfigError) as e:
        batch_sizes(tb, mb, gas, world)
    msg = str(e.value)
    for meaning in ("samples per optimizer step over all ranks", "samples per rank per forward",
                    "forwards per optimizer step", "data-parallel world size"):
        assert meaning in msg
    assert f"train_batch_size ({tb}" in msg


def test_batch_rule_uses_the_data_parallel_world():
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": 2,
           "optimizer": {"type": "AdamW"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = from_ds_config(cfg, world_size=4)              # dp = 4 / sp 2 = 2 -> 2 accumulation steps
    assert (got.gradient_accumulation_steps, got.mesh) == (2, {"pp": 1, "dp": 2, "sp": 2, "tp": 1})
    with pytest.raises(ConfigError, match="either train_batch_size"):
        batch_sizes(None, None, 4, 2)


def test_offload_zenflow_superoffload_and_checkpoint_keys(tmp_path):
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True,
                                                                   "cpuadam_cores_perc": 0.5, "pin_memory": False},
                                 "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8,
                                             "update_interval": 4, "full_warm_up_rounds": 2, "overlap_step": True}},
           "datastates_ckpt": {"host_cache_size": 2}}
    got = from_ds_config(cfg, world_size=2, checkpoint_dir=str(tmp_path), save_every=10)
    names = [t.name for t in got.transforms]
    assert names == ["shard_zero", "offload", "clip_grad_norm", "zenflow", "async_checkpoint"]
    off, zf, ck = got.transforms[1], got.transforms[3], got.transforms[4]
    assert (off.device, off.overlap, off.cores, off.pin_memory) == ("cpu", True, 0.5, False)
    assert (zf.topk_ratio, zf.update_interval, zf.select_interval, zf.full_warm_up_rounds, zf.overlap) == (
        0.05, 4, 8, 2, True)
    assert (ck.every, ck.host_cache_size, ck.engine) == (10, 2 * 2**30, "async")
    assert got.checkpoint == {"engine": "async", "host_cache_size": 2 * 2**30}
    ck.wait()
    # negative controls: DeepSpeed's "auto" ZenFlow modes and partial offload are listed, not dropped
    bad = copy.deepcopy(cfg)
    bad["zero_optimization"]["zenflow"].update(select_strategy="auto", update_interval="auto")
    with pytest.raises(ConfigError, match="(?s)zenflow.update_interval.*zenflow.select_strategy"):
        from_ds_config(bad, world_size=2)


def test_tensor_parallel_needs_the_model_and_sets_the_mesh():
    pytest.importorskip("transformers", reason="the hf extra (transformers) gives a model with a tp plan")
    from dsfn.testing.models import make_tiny_causal_lm
    cfg = {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2},
           "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 1}}
    with pytest.raises(ConfigError, match="needs the model"):
        from_ds_config(cfg, world_size=4)
    got = from_ds_config(cfg, model=make_tiny_causal_lm("llama"), world_size=4)
    assert [t.name for t in got.transforms] == ["shard_zero", "tensor_parallel", "clip_grad_norm"]
    assert got.mesh == {"pp": 1, "dp": 2, "sp": 1, "tp": 2} and got.train_batch_size == 4      # 2 x 1 x dp 2
    with pytest.raises(ConfigError, match="not divisible"):
        from_ds_config(cfg, model=make_tiny_causal_lm("llama"), world_size=3)


def test_the_built_step_donates_its_input_state():
    """`cfg.compose` donates (issue 25: without it the ZeRO-3 peak held a second copy of the state);
    the values are bitwise those of the non-donating Step, and the donated input is invalid."""
    cfg = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = from_ds_config(cfg, world_size=1)
    runs = {}
    for donate in (None, False):
        apply_fn, params = dsfn.functionalize(make_mlp([6, 16, 3]))
        step = got.compose(train_step_for(apply_fn, mse_loss_fp32), donate=donate)
        assert step.donate is (donate is None)
        state = step.place(dsfn.TrainState.create(params, got.tx))
        first = state
        for b in regression_batches(STEPS, 8, 6, 3, seed=2):
            state, _ = step(state, b)
        if donate is None:
            with pytest.raises(dsfn.errors.DonatedStateError):
                first.params
        else:                                           # control: a non-donating step leaves it readable
            assert first.params is not None
        runs[donate] = step.gather(state).params
    assert_trees_equal(runs[None], runs[False])
