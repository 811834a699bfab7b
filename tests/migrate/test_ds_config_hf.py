"""`from_ds_config` on Hugging Face Trainer's DeepSpeed configs, and on any value of any key (issue 25, item 3).

Z2 and Z3 are HF's published configs (transformers `tests/deepspeed/ds_config_zero2.json`
and `ds_config_zero3.json`, the ones its DeepSpeed guide launches), with "auto" for the
values Trainer fills. dsfn lists every "auto" in one ConfigError, and `auto=` (or
`hf_trainer_auto(...)`, the values Trainer would fill) plus `model=` resolve them: the
resolved config equals what HF's own `HfTrainerDeepSpeedConfig` makes of the same JSON,
TrainingArguments and model. A hypothesis property feeds strings, None, lists, negative,
huge and non-finite numbers, objects and "auto" into every key and block of full
configs: only a ConfigError naming the key (or its block) or a result comes out.
Negative controls: the values that used to escape as raw ValueError / TypeError /
AttributeError / OverflowError are listed and checked one by one, and `bf16.enabled:
"auto"` (which was taken as true) gives no mixed precision with HF's default bf16=False.
"""
import copy
import math
import types
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.errors import ConfigError
from dsfn.migrate import from_ds_config, hf_trainer_auto

Z2 = {  # transformers tests/deepspeed/ds_config_zero2.json
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
Z3 = {  # transformers tests/deepspeed/ds_config_zero3.json
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e14, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_fp16_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
PUBLISHED = {"zero2": Z2, "zero3": Z3}


def _auto_paths(node, prefix=""):
    out = []
    for k, v in node.items():
        if v == "auto":
            out.append(prefix + k)
        elif isinstance(v, dict):
            out += _auto_paths(v, prefix + k + ".")
    return out


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _llama():
    pytest.importorskip("transformers", reason="the hf extra gives a model with config.hidden_size")
    from dsfn.testing.models import make_tiny_causal_lm
    return make_tiny_causal_lm("llama")          # hidden_size 64


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_auto_is_listed_in_one_error(name):
    cfg = PUBLISHED[name]
    with pytest.raises(ConfigError) as e:
        from_ds_config(cfg, world_size=2)
    msg = str(e.value)
    paths = [p for p in _auto_paths(cfg) if p != "scheduler.params.warmup_min_lr"]   # 0, as HF fills it
    assert len(paths) >= 12 and f'has {len(paths)} "auto" value(s)' in msg
    for p in paths:
        assert f"\n  - {p}: " in msg, p
    assert "warmup_min_lr" not in msg
    assert "auto={" in msg and "hf_trainer_auto(training_args)" in msg and "model=" in msg
    # with the model only the bucket sizes are filled; the rest is still listed in one error
    with pytest.raises(ConfigError) as e:
        from_ds_config(cfg, model=_llama(), world_size=2)
    assert "reduce_bucket_size" not in str(e.value) and "optimizer.params.lr" in str(e.value)


def _training_args(**over):
    """TrainingArguments' fields that HF's DeepSpeed integration reads (defaults overridden)."""
    f = {**dict(learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5, bf16=False,
                fp16=False, bf16_full_eval=False, fp16_full_eval=False, warmup_steps=10, max_steps=100, world_size=1,
                save_on_each_node=False), **over}
    args = types.SimpleNamespace(**f)
    args.get_warmup_steps = lambda n: int(args.warmup_steps) if args.warmup_steps >= 1 \
        else math.ceil(n * args.warmup_steps)
    return args


@pytest.mark.parametrize("name", PUBLISHED)
def test_filled_as_hf_trainer_fills_them(name):
    hf_ds = pytest.importorskip("transformers.integrations.deepspeed")
    pytest.importorskip("deepspeed")
    model, cfg = _llama(), PUBLISHED[name]
    args = _training_args()
    hf = hf_ds.HfTrainerDeepSpeedConfig(copy.deepcopy(cfg))
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model, args.max_steps)
    got = from_ds_config(cfg, model=model, world_size=1, auto=hf_trainer_auto(args))
    assert got.resolved == hf.config                         # HF's own filling of the same JSON
    assert got.config == cfg and "auto" in str(got.config)   # the config as given is kept
    zero = got.transforms[0]
    assert (zero.stage, zero.reduce_bucket_size) == ((2, 200_000_000) if name == "zero2" else (3, 64 * 64))
    if name == "zero3":
        assert zero.param_persistence_threshold == 10 * 64
        assert got.resolved["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    names = [t.name for t in got.transforms]
    assert (got.train_batch_size, got.micro_batch_size, got.gradient_accumulation_steps) == (8, 4, 2)
    assert names[-1] == "clip_grad_norm" and got.transforms[-1].max_norm == 0.5 and "accumulate" in names
    # TrainingArguments' bf16 / fp16 default off: "auto" is fp32 (it used to be taken as enabled)
    assert "mixed_precision" not in names and "loss_scale" not in names
    fp16 = from_ds_config(cfg, model=model, world_size=1, auto=hf_trainer_auto(args, fp16=True))
    assert {"mixed_precision", "loss_scale"} <= {t.name for t in fp16.transforms}   # control: asked for, it is on


@pytest.mark.slow
def test_hf_trainer_auto_reads_training_arguments(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, adam_beta2=0.95,
                                          per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                          max_steps=100, warmup_steps=10, max_grad_norm=0.5, report_to=[])
    assert hf_trainer_auto(args) == hf_trainer_auto(_training_args(adam_epsilon=1e-8, weight_decay=0.0))


def test_hf_trainer_auto_defaults_and_fields():
    d = hf_trainer_auto()
    assert d["optimizer.params.lr"] == 5e-5 and d["optimizer.params.betas"] == [0.9, 0.999]
    assert d["train_micro_batch_size_per_gpu"] == 8 and d["bf16.enabled"] is False and d["fp16.enabled"] is False
    assert d["scheduler.params.warmup_num_steps"] == 1 and "scheduler.params.total_num_steps" not in d
    r = hf_trainer_auto(warmup_steps=0.1, max_steps=50)           # a float < 1 is a ratio of the steps
    assert (r["scheduler.params.warmup_num_steps"], r["scheduler.params.total_num_steps"]) == (5, 50)
    with pytest.raises(ConfigError, match="learning_rat"):
        hf_trainer_auto(learning_rat=1e-3)


def test_auto_argument_is_checked():
    full = hf_trainer_auto(max_steps=10)
    with pytest.raises(ConfigError, match="optimizer.lr"):       # a typo matches no "auto"
        from_ds_config(Z2, world_size=2, auto={**full, "optimizer.lr": 1e-3})
    with pytest.raises(ConfigError, match="optimizer.params.lr"):
        from_ds_config(Z2, world_size=2, auto={**full, "optimizer.params.lr": "fast"})
    with pytest.raises(ConfigError, match="auto="):
        from_ds_config(Z2, world_size=2, auto=[("optimizer.params.lr", 1e-3)])
    got = from_ds_config(Z3, world_size=2, auto={**full, "zero_optimization.reduce_bucket_size": 1000,
                                                  "zero_optimization.stage3_prefetch_bucket_size": 900,
                                                  "zero_optimization.stage3_param_persistence_threshold": 10})
    assert (got.transforms[0].reduce_bucket_size, got.transforms[0].param_persistence_threshold) == (1000, 10)
    assert got.train_batch_size == 8 * 1 * 2                     # micro 8 x accumulation 1 x dp 2


# values that escaped as raw exceptions before (ValueError from float("auto"), AttributeError from
# .get on a string, TypeError from tuple(5), OverflowError from 2.0 ** 5000, ...): each is now a
# ConfigError naming its key
BASE = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0, "sequence_parallel_size": 1, "communication_data_type": "fp16",
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1, "consecutive_hysteresis": False},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "amsgrad": False, "bias_correction": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                      "warmup_num_steps": 10, "total_num_steps": 100}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                          "stage3_param_persistence_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                          "overlap_comm": True, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
    "tensor_parallel": {"autotp_size": 1},
    "checkpoint": {"writer": {"decoupled": True}},
    "datastates_ckpt": {"host_cache_size": 1},
    "steps_per_print": 10, "wall_clock_breakdown": False,
}
BASE_MUON = {
    "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Muon", "params": {"lr": 0.01, "momentum": 0.95, "weight_decay": 0.1, "adam_lr": 3e-3,
                                             "betas": [0.9, 0.95], "eps": 1e-8}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0.5},
                          "zenflow": {"topk_ratio": 0.05, "select_strategy": "step", "select_interval": 8,
                                      "update_interval": 4, "full_warm_up_rounds": 2, "overlap_step": False}},
}
BASE_SGD = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                                          "nesterov": True}}}
BASES = [BASE, BASE_MUON, BASE_SGD]


def _paths(node, prefix=""):
    out = []
    for k, v in node.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += _paths(v, prefix + k + ".")
    return out


def _with(base, path, value):
    cfg = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[leaf] = value
    return cfg


def _outcome(cfg, path):
    """None for success, else the ConfigError's message; anything else escapes (the failure)."""
    try:
        from_ds_config(cfg, world_size=2)
    except ConfigError as e:
        msg = str(e)
        top, leaf = path.split(".")[0], path.split(".")[-1]
        assert leaf in msg or top in msg, (path, msg)            # the message names the key or its block
        return msg
    return None


def test_bases_are_accepted():
    for base in BASES:
        assert _outcome(base, "optimizer") is None


@pytest.mark.parametrize("path,value", [
    ("optimizer.params.lr", "auto"), ("optimizer.params.lr", "1e-3"), ("optimizer.params.eps", None),
    ("optimizer.params.weight_decay", [0.1]), ("optimizer.params.betas", 5), ("optimizer.params.betas", "ab"),
    ("optimizer.params", "x"), ("optimizer", "AdamW"), ("fp16", "yes"), ("fp16.enabled", "auto"),
    ("fp16.initial_scale_power", 5000), ("fp16.loss_scale", "dynamic"), ("fp16.loss_scale_window", 1.5),
    ("communication_data_type", [1]), ("zero_optimization.offload_optimizer", "cpu"),
    ("zero_optimization.offload_param.device", 3), ("zero_optimization.stage", True),
    ("datastates_ckpt.host_cache_size", float("nan")), ("checkpoint.writer", "fast"),
    ("activation_checkpointing", ["cpu"]), ("scheduler.params", "x"), ("scheduler.type", ["WarmupLR"]),
    ("scheduler.params.total_num_steps", "many"), ("gradient_clipping", float("inf")),
    ("gradient_clipping", True), ("train_batch_size", "16"),
])
def test_values_that_escaped_raw_are_config_errors(path, value):
    assert _outcome(_with(BASE, path, value), path) is not None


_VALUES = st.one_of(
    st.none(), st.booleans(), st.just("auto"), st.text(max_size=6), st.integers(-10**6, 10**6),
    st.integers(-2**80, 2**80), st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.text(max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_value_of_any_key_is_a_config_error_or_a_config(data):
    base = data.draw(st.sampled_from(BASES))
    path = data.draw(st.sampled_from(_paths(base)))
    _outcome(_with(base, path, data.draw(_VALUES)), path)
