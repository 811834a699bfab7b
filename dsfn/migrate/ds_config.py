"""`from_ds_config(config, model=...)`: a DeepSpeed `ds_config.json` as a dsfn stack, optimizer and batch.

    cfg = dsfn.from_ds_config("ds_config.json", model=model)   # world size: the launcher's group
    cfg.init_mesh()                                   # pp x dp x sp x tp from the config and the world size
    step = cfg.compose(train_step)                    # dsfn.compose(*cfg.transforms, donate=True)(train_step)
    state = step.init_state(params, cfg.tx)
    for batch in loader(cfg.train_batch_size):        # the global batch: micro * accumulation * dp rows
        state, metrics = step(state, batch)

Keys and defaults are DeepSpeed 0.19's (`deepspeed/runtime/config.py`, `zero/config.py`,
`zero/offload_config.py`, `precision_config.py`, `zenflow/zenflow_config.py`;
/work/shared/reference/deepspeed_features.md). Mapping (stack in canonical order):

| ds_config | dsfn |
|---|---|
| `sequence_parallel_size: N` (> 1) | `sequence_parallel()`, mesh sp = N |
| `zero_optimization.stage` s (default 0) | `shard_zero(s, reduce_bucket_size, allgather_bucket_size (s >= 1), param_persistence_threshold (s = 3))` (DeepSpeed's defaults 5e8, 5e8, 1e5 for stage 3) |
| `zero_optimization.mics_shard_size: k` (> 0, stage 3) | `shard_zero(3, shard_group=k, cross_node=True)` (MiCS: state sharded over blocks of k ranks, replicated across them) |
| `zero_optimization.zero_hpz_partition_size: k` (> 1, stage 3) | `shard_zero(3, hpz=min(k, dp))` (ZeRO++ hpZ) |
| `tensor_parallel.autotp_size: N` (> 1) | `tensor_parallel("auto", model=model)`, mesh tp = N (with a pipeline: inside it) |
| `activation_checkpointing.cpu_checkpointing` / `partition_activations` | `remat(offload="cpu")` / `remat(partition_activations=True)` |
| `gradient_accumulation_steps: n` (> 1) | `accumulate(n)` (without a pipeline) |
| `pipeline.stages: P` (> 1) | `pipeline_parallel("1f1b", microbatches=gradient_accumulation_steps, model=model)` innermost, mesh pp = P; no `accumulate` (the pipeline's micro-batches are the accumulation) |
| `pipeline.activation_checkpoint_interval: 1` | `remat()` (each layer of a stage checkpointed); > 1 is listed (dsfn does not checkpoint groups of layers) |
| `pipeline.partition` "uniform" / absent or "best" / "parameters" / "type:regex" | the even split by layer count / the same / `split=` balancing each stage's parameter count (embeddings counted on the first stage, final norm and head on the last) / `split=` balancing the layers whose class name matches |
| `offload_optimizer.device` cpu / nvme (+ `offload_param` on the same device) | `offload(device, params=, path=nvme_path, pin_memory=, overlap=super_offload, cores=cpuadam_cores_perc)` |
| `bf16.enabled` / `fp16.enabled` | `mixed_precision(torch.bfloat16 / torch.float16, reduce_dtype=communication_data_type)` |
| `communication_data_type` bf16 / fp16 without bf16/fp16 (fp32 training) | `mixed_precision(torch.float32, reduce_dtype=...)`: only the gradient reductions run in it |
| `fp16` loss_scale, initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale | `loss_scale(init_scale=2**p, window, hysteresis, min_scale, static=loss_scale if > 0, consecutive_hysteresis)` |
| `gradient_clipping` (default **1.0**; 0 disables) | `clip_grad_norm(c)` |
| `zero_optimization.zenflow` | `zenflow(topk_ratio, update_interval, select_interval, full_warm_up_rounds, overlap=overlap_step)` |
| `datastates_ckpt.host_cache_size` (GB), `checkpoint.writer.decoupled` | `async_checkpoint(dir, every, host_cache_size=bytes)` when `checkpoint_dir=` is given (else `cfg.checkpoint`) |
| `optimizer` Adam / AdamW / Muon / SGD / other `torch.optim` types | `adamw` (Adam with `adam_w_mode` true, DeepSpeed's default) / `adam` / `muon` / `sgd` / `from_torch` |
| `scheduler` | `dsfn.optim.schedules.from_config` as the lr |

Batch sizes follow DeepSpeed's rule train_batch_size = micro * accumulation * dp world
(dp world = world / (pp * sp * tp)): any two give the third, all three must agree
(`batch_sizes`). The world size is the launcher's: without `world_size=`, a process
started by torchrun / `dsfn.launch` joins its process group first (as a Step does), so
the sizes are those DeepSpeed derives on the same ranks.

`"auto"` values (Hugging Face Trainer's configs) are filled from `auto=` (dotted key ->
value; `hf_trainer_auto(training_args)` gives what HF Trainer would fill), the bucket
sizes from the model's hidden size as HF does (reduce_bucket_size = h*h,
stage3_prefetch_bucket_size = 0.9*h*h, stage3_param_persistence_threshold = 10*h), the
third batch size from the other two, the scheduler's warmup_min_lr as 0 and
warmup_max_lr as the optimizer's lr; what is left is listed in one ConfigError.
Every value is type-checked: a wrong one is a ConfigError naming its key.

Pipeline parallelism. In DeepSpeed it is a `PipelineModule` passed to `initialize`; its
config's `"pipeline"` section (`get_pipeline_config`) is where dsfn reads it: `stages` > 1
builds `pipeline_parallel("1f1b", microbatches=gradient_accumulation_steps, model=model)`
(DeepSpeed's engine runs 1F1B, with the accumulation steps as its micro-batches) over a
"pp" mesh axis laid out outermost, as DeepSpeed's pipe-data(-model) topology is. `stages`
absent, "auto" (DeepSpeed's default) or 1 is no pipeline: the other pipeline keys then do
nothing and are named in the warning. ZeRO stage 2/3 with a pipeline, which DeepSpeed's
pipeline engine refuses, is mapped: `shard_zero(2|3)` around it (each micro-batch's backward
a round of gradient buckets); `sequence_parallel_size` > 1 keeps `sequence_parallel()`
outermost and `autotp_size` > 1 puts `tensor_parallel("auto")` inside the pipeline (each
stage split over its tp group); `activation_checkpoint_interval: 1` is `remat()` (each layer
of a stage checkpointed; DeepSpeed's `activation_checkpointing` options, when given, shape
that remat), a larger interval (groups of layers) is listed, and so are fewer accumulation
steps than stages (dsfn's 1F1B needs m >= P); `pipe_partitioned` / `grad_partitioned` (partitioned
p2p of tensor-parallel activations: communication only, and DeepSpeed applies them only
under model parallelism), `use_reentrant` and `seed_layers` (DeepSpeed's engine takes it
from PipelineModule, and dsfn trains the parameters the model already holds) are accepted
and named in the warning. The split into stages changes where layers run, not the numbers.

Keys dsfn does not reproduce raise one `ConfigError` listing all of them;
keys that only tune performance or logging (bucket and prefetch tuning, aio, monitors, ...)
are named in one `UserWarning` (`cfg.ignored` lists them). Defaults that differ from
dsfn's own are DeepSpeed's here: gradient clipping 1.0, the optimizer's weight decay 0
(FusedAdam / CPU Adam; torch's 0.01 with `torch_adam: true` for AdamW), Adam meaning AdamW.
"""
from __future__ import annotations

import copy
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from dsfn.errors import ConfigError, DsfnError

__all__ = ["DsConfig", "batch_sizes", "from_ds_config", "hf_trainer_auto"]

# top-level keys that only tune speed, memory or logging: accepted, named in one warning
_IGNORED_TOP = {
    "steps_per_print": "logging", "wall_clock_breakdown": "logging", "memory_breakdown": "logging",
    "flops_profiler": "profiling", "tensorboard": "logging", "wandb": "logging", "csv_monitor": "logging",
    "comet": "logging", "comms_logger": "logging", "log_level": "logging", "dump_state": "logging",
    "timers": "logging", "dataloader_drop_last": "data loading is the caller's",
    "zero_allow_untested_optimizer": "dsfn runs any dsfn.optim optimizer under ZeRO",
    "zero_force_ds_cpu_optimizer": "offload runs the host AdamW kernel by itself", "aio": "NVMe I/O tuning",
    "prescale_gradients": "reduction tuning", "gradient_predivide_factor": "reduction tuning",
    "seq_parallel_communication_data_type": "sp all-to-alls travel in the compute dtype",
}
_ZERO_PERF = {"contiguous_gradients", "reduce_scatter", "overlap_comm", "use_multi_rank_bucket_allreduce",
              "allgather_partitions", "round_robin_gradients", "ignore_unused_parameters", "load_from_fp32_weights",
              "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_max_live_parameters",
              "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
              "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
              "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
              "stage3_allgather_sequential", "memory_efficient_linear", "override_module_apply", "elastic_checkpoint",
              "save_muon_momentum_buffer_in_memory", "compute_grad_norm", "parameter_alignment",
              "log_trace_cache_warnings"}
_OFFLOAD_PERF = {"buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline_read", "pipeline_write",
                 "pipeline"}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class DsConfig:
    """What a ds_config means in dsfn (see the module docstring).

    `transforms`: the stack, outermost first (`compose(*transforms)`); `tx`: the optimizer
    (its lr the scheduler when one is given); batch sizes per DeepSpeed's rule; `mesh`:
    {"pp", "dp", "sp", "tp"} sizes for `dsfn.runtime.init_mesh` (pp outermost); `checkpoint`: async checkpoint
    settings (`host_cache_size` in bytes, `engine`); `ignored`: performance/logging keys
    accepted without effect; `config`: the config as given; `resolved`: the config with
    every `"auto"` filled and the three batch sizes set (what DeepSpeed would be given);
    `donate`: whether `compose` builds a donating Step (True: the input state's buffers
    are reused, which removes a copy of the state from the peak memory).
    """
    transforms: tuple
    tx: Any
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    mesh: dict[str, int]
    checkpoint: dict = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    resolved: dict = field(default_factory=dict)
    donate: bool = True

    def compose(self, train_step: Callable, donate: bool | None = None) -> Any:
        """`dsfn.compose(*self.transforms, donate=self.donate)(train_step)`; `donate=False`
        keeps each input state readable after its step (at the cost of a second copy)."""
        from dsfn.transforms.compose import compose
        return compose(*self.transforms, donate=self.donate if donate is None else donate)(train_step)

    def init_mesh(self) -> Any:
        """`dsfn.runtime.init_mesh(pp=, dp=, sp=, tp=)` with this config's sizes (axes of size 1 left out, dp kept)."""
        from dsfn.runtime.mesh import init_mesh
        return init_mesh(**{k: v for k, v in self.mesh.items() if v > 1 or k == "dp"})


def batch_sizes(train_batch_size: int | None, micro_batch_size: int | None, gradient_accumulation_steps: int | None,
                dp_world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro, accumulation) by DeepSpeed's rule (`DeepSpeedConfig._set_batch_related_parameters`).

    train_batch_size = micro * accumulation * dp_world_size. Given all three they must
    agree; given two the third is inferred (integer division, then checked); given
    train_batch_size alone accumulation is 1; given micro alone accumulation is 1.
    Raises ConfigError naming the sizes and DeepSpeed's meaning of each.
    """
    tb, mb, gas, w = train_batch_size, micro_batch_size, gradient_accumulation_steps, dp_world_size
    for name, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                    ("gradient_accumulation_steps", gas)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"ds_config {name}={v!r}: batch sizes are ints >= 1")
    if tb is None and mb is None:
        raise ConfigError("ds_config: either train_batch_size (the global batch per optimizer step) or "
                          "train_micro_batch_size_per_gpu (rows per rank per forward) needs to be provided")
    if tb is not None and mb is not None and gas is None:
        gas = max(tb // mb // w, 1)
    elif tb is not None and gas is not None and mb is None:
        mb = max(tb // w // gas, 1)
    elif mb is not None and gas is not None and tb is None:
        tb = mb * gas * w
    elif tb is not None and mb is None:
        gas, mb = 1, max(tb // w, 1)
    elif mb is not None and tb is None:
        gas, tb = 1, mb * w
    if tb != mb * gas * w:
        raise ConfigError(
            f"ds_config batch sizes disagree: train_batch_size ({tb}, samples per optimizer step over all ranks) "
            f"must equal train_micro_batch_size_per_gpu ({mb}, samples per rank per forward) x "
            f"gradient_accumulation_steps ({gas}, forwards per optimizer step) x data-parallel world size ({w}, "
            f"= world size / (pipeline.stages x sequence_parallel_size x autotp_size)): {mb} x {gas} x {w} = "
            f"{mb * gas * w}. "
            "Give two of the three and dsfn infers the third, or fix the one that is off")
    return tb, mb, gas


class _Collect:
    """Collects unsupported keys (one ConfigError) and ignored ones (one warning)."""

    def __init__(self) -> None:
        self.unsupported: list[tuple[str, str]] = []
        self.ignored: list[tuple[str, str]] = []

    def no(self, key: str, why: str) -> None:
        self.unsupported.append((key, why))

    def ignore(self, key: str, why: str) -> None:
        self.ignored.append((key, why))


def _load(config: str | os.PathLike | Mapping) -> dict:
    if isinstance(config, Mapping):
        try:
            out = json.loads(json.dumps(config))          # a private deep copy
        except (TypeError, ValueError) as e:
            raise ConfigError(f"ds_config: the dict holds a value JSON cannot hold ({e}); use numbers, strings, "
                              "booleans, null, lists and objects, as in ds_config.json") from None
    elif not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"ds_config {config!r}: pass a path to ds_config.json or a dict")
    elif not os.path.isfile(config):
        raise ConfigError(f"ds_config {config!r} is not a file; pass a path to ds_config.json or a dict")
    else:
        with open(config) as f:
            try:
                out = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"ds_config {config}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"ds_config: the top level is a {type(out).__name__}; it must be an object "
                          "({\"train_batch_size\": ..., ...})")
    return out


def _disabled(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("enabled", True) is False


def _int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"ds_config {key}={v!r}: expected a whole number >= 0 (e.g. 5e8)")
    return int(v)


def _float(key: str, v: Any, minimum: float = 0.0, above: bool = False) -> float:
    """A finite number >= minimum (> with `above`), or a ConfigError naming the key."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < minimum or (above and v == minimum):
        raise ConfigError(f"ds_config {key}={v!r}: expected a number {'>' if above else '>='} {minimum:g}")
    return float(v)


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise ConfigError(f"ds_config {key}={v!r}: expected true or false")


def _block(key: str, v: Any) -> dict:
    """An object (a private dict copy); null is an empty one."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"ds_config {key}={v!r}: expected an object ({{...}}) or null")
    return dict(v)


def _betas(key: str, v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(f"ds_config {key}={v!r}: expected two numbers in [0, 1), e.g. [0.9, 0.999]")
    out = tuple(_float(f"{key}[{i}]", b) for i, b in enumerate(v))
    if not all(b < 1 for b in out):
        raise ConfigError(f"ds_config {key}={v!r}: each beta is in [0, 1)")
    return out


def _make(key: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a transform, optimizer or schedule built from the block `key`);
    an error it raises on a value becomes a ConfigError naming the block."""
    try:
        return fn(*args, **kwargs)
    except (DsfnError, TypeError, ValueError, OverflowError, KeyError, AttributeError) as e:
        raise ConfigError(f"ds_config {key}: {e}") from None



# -- "auto" values (Hugging Face Trainer's configs) -------------------------------------------
# the keys HF Trainer fills, and where it takes the value from
_TA = "HF Trainer: TrainingArguments."
_HF_AUTO = {
    "train_micro_batch_size_per_gpu": _TA + "per_device_train_batch_size",
    "gradient_accumulation_steps": _TA + "gradient_accumulation_steps",
    "train_batch_size": "HF Trainer: world size x per_device_train_batch_size x gradient_accumulation_steps "
                        "(dsfn derives it from the other two)",
    "gradient_clipping": _TA + "max_grad_norm",
    "optimizer.params.lr": _TA + "learning_rate",
    "optimizer.params.betas": _TA + "adam_beta1, adam_beta2",
    "optimizer.params.eps": _TA + "adam_epsilon",
    "optimizer.params.weight_decay": _TA + "weight_decay",
    "scheduler.params.warmup_min_lr": "HF Trainer: 0",
    "scheduler.params.warmup_max_lr": _TA + "learning_rate",
    "scheduler.params.warmup_num_steps": _TA + "warmup_steps (at least 1)",
    "scheduler.params.total_num_steps": "HF Trainer: the number of training steps (TrainingArguments.max_steps)",
    "fp16.enabled": _TA + "fp16 (default false)",
    "bf16.enabled": _TA + "bf16 (default false)",
    "zero_optimization.reduce_bucket_size": "HF Trainer: hidden_size * hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "HF Trainer: 0.9 * hidden_size * hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "HF Trainer: 10 * hidden_size",
}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_HIDDEN_KEYS = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
                "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
# TrainingArguments fields hf_trainer_auto reads, with TrainingArguments' defaults
_HF_FIELDS = {"learning_rate": 5e-5, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
              "weight_decay": 0.0, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
              "max_grad_norm": 1.0, "bf16": False, "fp16": False, "bf16_full_eval": False, "fp16_full_eval": False,
              "warmup_steps": 0, "warmup_ratio": 0.0, "max_steps": -1}


def hf_trainer_auto(training_args: Any = None, *, num_training_steps: int | None = None,
                    **fields: Any) -> dict[str, Any]:
    """The values Hugging Face Trainer fills into a ds_config's `"auto"` entries, as the
    `auto=` argument of `from_ds_config` (dotted key -> value).

    `training_args`: a `transformers.TrainingArguments` (or any object with its field
    names); `fields`: the same fields as keywords (they win), e.g.
    `hf_trainer_auto(learning_rate=3e-4, per_device_train_batch_size=4, bf16=True,
    max_steps=1000)`. Fields not given take TrainingArguments' defaults (learning_rate
    5e-5, betas (0.9, 0.999), eps 1e-8, weight_decay 0, per_device_train_batch_size 8,
    gradient_accumulation_steps 1, max_grad_norm 1.0, bf16 / fp16 off, no warmup).
    `num_training_steps` (else `max_steps` when > 0) fills the scheduler's
    total_num_steps and a warmup given as a ratio; HF computes it from the dataset when
    max_steps is not set. `train_batch_size` is left to DeepSpeed's rule (micro x
    accumulation x data-parallel world), which is HF's value when there is no sp or tp.
    The bucket sizes come from `from_ds_config(..., model=)`'s hidden size.
    """
    unknown = sorted(set(fields) - set(_HF_FIELDS))
    if unknown:
        raise ConfigError(f"hf_trainer_auto: unknown field(s) {unknown}; it reads {sorted(_HF_FIELDS)}")
    v = {k: fields[k] if k in fields else getattr(training_args, k, d) for k, d in _HF_FIELDS.items()}
    lr = v["learning_rate"]
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": v["per_device_train_batch_size"],
        "gradient_accumulation_steps": v["gradient_accumulation_steps"],
        "gradient_clipping": v["max_grad_norm"],
        "optimizer.params.lr": lr, "optimizer.params.betas": [v["adam_beta1"], v["adam_beta2"]],
        "optimizer.params.eps": v["adam_epsilon"], "optimizer.params.weight_decay": v["weight_decay"],
        "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": lr,
        "fp16.enabled": bool(v["fp16"] or v["fp16_full_eval"]), "bf16.enabled": bool(v["bf16"] or v["bf16_full_eval"]),
    }
    steps = num_training_steps
    if steps is None and isinstance(v["max_steps"], int) and not isinstance(v["max_steps"], bool) \
            and v["max_steps"] > 0:
        steps = v["max_steps"]
    if steps is not None:
        out["scheduler.params.total_num_steps"] = steps
    warm, ratio = v["warmup_steps"], v["warmup_ratio"]
    if isinstance(warm, (int, float)) and not isinstance(warm, bool) and isinstance(ratio, (int, float)):
        frac = warm if 0 < warm < 1 else ratio           # a float warmup_steps < 1 is a ratio (transformers 5)
        if warm >= 1:                                    # TrainingArguments.get_warmup_steps, then HF's max(1, .)
            out["scheduler.params.warmup_num_steps"] = int(warm)
        elif not frac:
            out["scheduler.params.warmup_num_steps"] = 1
        elif isinstance(steps, int):
            out["scheduler.params.warmup_num_steps"] = max(1, math.ceil(steps * frac))
    return out


def _autos(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every "auto" value (ZenFlow's own "auto" modes excepted)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            path = f"{prefix}{k}"
            if path == "zero_optimization.zenflow":
                continue
            if isinstance(v, str) and v == "auto":
                out.append(path)
            else:
                out += _autos(v, path + ".")
    return out


def _get(cfg: dict, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(cfg: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    node[leaf] = value


def _hidden_size(model: Any) -> int | None:
    """The model's hidden size as HF Trainer reads it (config.hidden_size, the largest of
    hidden_sizes, or the same in text_config)."""
    for conf in (getattr(model, "config", None), getattr(getattr(model, "config", None), "text_config", None)):
        if conf is None:
            continue
        h = getattr(conf, "hidden_size", None)
        if h is None and getattr(conf, "hidden_sizes", None):
            h = max(conf.hidden_sizes)
        if isinstance(h, int) and not isinstance(h, bool) and h > 0:
            return h
    return None


def _ignored_path(path: str) -> bool:
    """A key dsfn accepts without reading its value (performance / logging tuning)."""
    parts = path.split(".")
    if parts[0] in _IGNORED_TOP:
        return True
    if parts[0] == "zero_optimization" and len(parts) == 2:
        return parts[1] in _ZERO_PERF or parts[1] in ("stage3_gather_16bit_weights_on_model_save",)
    if parts[0] == "zero_optimization" and len(parts) == 3 and parts[1] in ("offload_optimizer", "offload_param"):
        return parts[2] in _OFFLOAD_PERF
    return False


def _resolve_auto(cfg: dict, auto: Any, model: Any) -> dict:
    """Fill every "auto" of `cfg` in place (module docstring); the batch sizes still unknown
    are left None for DeepSpeed's rule. Returns {path: value} of what was filled. Raises one
    ConfigError listing every "auto" that nothing fills, and how to supply it."""
    if auto is None:
        auto = {}
    if not isinstance(auto, Mapping) or not all(isinstance(k, str) for k in auto):
        raise ConfigError(f"from_ds_config(auto={auto!r}): a dict of dotted ds_config keys -> values, e.g. "
                          "{'optimizer.params.lr': 3e-4}, or dsfn.migrate.hf_trainer_auto(training_args)")
    paths = _autos(cfg)
    stray = sorted(k for k in auto if k not in paths and k not in _HF_AUTO)
    if stray:
        raise ConfigError(f"from_ds_config(auto=...): {stray} match no \"auto\" value of this ds_config (its "
                          f"\"auto\" keys: {paths}); auto= fills only entries written \"auto\"")
    filled: dict[str, Any] = {}
    for path in paths:
        if path in auto:
            filled[path] = copy.deepcopy(auto[path])
            _set(cfg, path, filled[path])
    stage = _get(cfg, "zero_optimization.stage")
    hidden = _hidden_size(model)
    missing: list[tuple[str, str]] = []
    for path in paths:
        if path in filled:
            continue
        where = _HF_AUTO.get(path, "not filled by HF Trainer: give a value")
        if path in _HIDDEN_KEYS:
            if path != "zero_optimization.reduce_bucket_size" and stage != 3:
                _get(cfg, path.rpartition(".")[0]).pop(path.rpartition(".")[2])   # unused below stage 3
            elif hidden is not None:
                filled[path] = _HIDDEN_KEYS[path](hidden)
                _set(cfg, path, filled[path])
            else:
                missing.append((path, f"{where}: pass model= (a Hugging Face model whose config has hidden_size)"))
        elif path == "scheduler.params.warmup_min_lr":
            filled[path] = 0                                   # HF Trainer's constant
            _set(cfg, path, 0)
        elif path in _BATCH_KEYS:
            continue                                           # after the others: any two give the third
        elif _ignored_path(path):
            continue                                           # accepted without being read
        elif path == "pipeline.stages":
            continue                                           # DeepSpeed's own default: no pipeline here
        elif path.count(".") and _get(cfg, path.split(".")[0] + ".enabled") is False:
            continue                                           # a disabled block's keys do nothing
        else:
            missing.append((path, where))
    lr = _get(cfg, "optimizer.params.lr")
    if "scheduler.params.warmup_max_lr" in paths and "scheduler.params.warmup_max_lr" not in filled:
        missing = [m for m in missing if m[0] != "scheduler.params.warmup_max_lr"]
        if lr is not None and lr != "auto":
            filled["scheduler.params.warmup_max_lr"] = lr      # HF: learning_rate, the optimizer's lr
            _set(cfg, "scheduler.params.warmup_max_lr", lr)
        else:
            missing.append(("scheduler.params.warmup_max_lr", _HF_AUTO["scheduler.params.warmup_max_lr"]
                            + " (the optimizer's lr, which is \"auto\" or absent too)"))
    batch_auto = [k for k in _BATCH_KEYS if k in paths and k not in filled]
    if batch_auto:
        known = [k for k in _BATCH_KEYS if cfg.get(k) is not None and cfg.get(k) != "auto"]
        if len(known) >= 2:
            for k in batch_auto:
                cfg[k] = None                                  # DeepSpeed's rule derives it
        else:
            missing += [(k, _HF_AUTO[k]) for k in batch_auto]
    if missing:
        missing.sort(key=lambda m: paths.index(m[0]))            # in the config's order
        lines = "\n".join(f"  - {k}: {why}" for k, why in missing)
        example = ", ".join(f"{k!r}: ..." for k, _ in missing[:2])
        raise ConfigError(
            f"ds_config has {len(missing)} \"auto\" value(s) that dsfn cannot fill by itself (Hugging Face Trainer "
            f"fills them from its TrainingArguments and the model):\n{lines}\n"
            f"Supply them with from_ds_config(config, auto={{{example}}}) (dotted keys as listed), or "
            "auto=dsfn.migrate.hf_trainer_auto(training_args) for the values HF Trainer would use (a "
            "TrainingArguments, or its fields as keywords: learning_rate=, per_device_train_batch_size=, bf16=, "
            "max_steps=, ...); bucket sizes come from model=; or write the values into the config")
    return filled


def _world_size(world_size: int | None) -> int:
    """`world_size`, else the launcher's: the process group is joined first (as a Step
    does), so a launched rank never reads 1 before its group exists."""
    from dsfn.runtime import env
    env.ensure_distributed()
    group = env.world_size() if env.is_distributed() else None
    if world_size is None:
        return env.world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"from_ds_config(world_size={world_size!r}): the number of ranks, an int >= 1")
    if group is not None and group != world_size:
        raise ConfigError(f"from_ds_config(world_size={world_size}) but this process is one of {group} ranks; "
                          "leave world_size out to use the process group's")
    return world_size


def from_ds_config(config: str | os.PathLike | Mapping, model: Any = None, world_size: int | None = None,
                   checkpoint_dir: str | os.PathLike | None = None, save_every: int | None = None,
                   auto: Mapping[str, Any] | None = None) -> DsConfig:
    """The dsfn stack, optimizer and batch settings that reproduce a DeepSpeed run.

    Args:
        config: a path to ds_config.json, or the dict.
        model: the nn.Module (needed for `tensor_parallel.autotp_size`, `pipeline.stages`
            > 1 and Muon's `per_head_muon`).
        world_size: ranks in the run. Default: the launcher's; under torchrun /
            `dsfn.launch` (WORLD_SIZE > 1) the process group is initialised now, as a Step
            would, and its size used (1 only for a single process). Given while a group
            exists, it must equal the group's. The batch-size rule uses world / (pp * sp * tp).
        checkpoint_dir, save_every: with `datastates_ckpt` / `checkpoint.writer`, add
            `async_checkpoint(checkpoint_dir, save_every, host_cache_size=...)`.
        auto: values for the config's `"auto"` entries, dotted key -> value (e.g.
            `{"optimizer.params.lr": 3e-4, "train_micro_batch_size_per_gpu": 4}`), or
            `hf_trainer_auto(training_args)`: the values HF Trainer would fill.
    Raises:
        ConfigError: one error listing every key dsfn does not reproduce, one listing every
            `"auto"` nothing fills, or a value (named by its key) or batch-size combination
            DeepSpeed itself rejects.
    """
    from dsfn import transforms as T
    cfg = _load(config)
    raw = json.loads(json.dumps(cfg))
    c = _Collect()
    world_size = _world_size(world_size)
    _resolve_auto(cfg, auto, model)
    resolved = json.loads(json.dumps(cfg))

    sp = _int("sequence_parallel_size", cfg.pop("sequence_parallel_size", 1) or 1)
    tp = _tensor_parallel(cfg.pop("tensor_parallel", None), c)
    pp, partition, interval = _pipeline(cfg.pop("pipeline", None), c)
    if world_size % (pp * sp * tp):
        what = f"pipeline.stages ({pp}) x " if pp > 1 else ""
        raise ConfigError(f"ds_config: world size {world_size} is not divisible by {what}sequence_parallel_size "
                          f"({sp}) x tensor_parallel.autotp_size ({tp}); the data-parallel size is world / "
                          f"({'pp x ' if pp > 1 else ''}sp x tp)")
    dp = world_size // (pp * sp * tp)
    tb, mb, gas = batch_sizes(cfg.pop("train_batch_size", None), cfg.pop("train_micro_batch_size_per_gpu", None),
                              cfg.pop("gradient_accumulation_steps", None), dp)
    if pp > 1:
        _pipeline_limits(pp, gas, sp, tp, c)

    for k, v in zip(_BATCH_KEYS, (tb, mb, gas)):
        resolved[k] = v
    zero = cfg.pop("zero_optimization", None)
    if zero is not None and not isinstance(zero, Mapping):
        raise ConfigError(f"ds_config zero_optimization={zero!r}: expected an object such as {{'stage': 2}}")
    zero = dict(zero or {})
    zero_in = set(zero)
    stage = zero.pop("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config zero_optimization.stage={stage!r}: DeepSpeed's stages are 0, 1, 2, 3")
    zero_kw = dict(reduce_bucket_size=max(_int("zero_optimization.reduce_bucket_size",
                                                   zero.pop("reduce_bucket_size", 5e8)), 1),
                   allgather_bucket_size=max(_int("zero_optimization.allgather_bucket_size",
                                                  zero.pop("allgather_bucket_size", 5e8)), 1))
    if stage == 0:      # stage 0 all-gathers nothing (shard_zero(0) refuses the key); DeepSpeed ignores it
        zero_kw.pop("allgather_bucket_size")
        if "allgather_bucket_size" in zero_in:
            c.ignore("zero_optimization.allgather_bucket_size", "stage 0 all-gathers nothing")
    threshold = zero.pop("stage3_param_persistence_threshold", zero.pop("param_persistence_threshold", 1e5))
    if stage == 3:
        zero_kw["param_persistence_threshold"] = _int("zero_optimization.stage3_param_persistence_threshold",
                                                      threshold)
    offload_t = _offload(zero, stage, c)
    zenflow_t = _zenflow(zero.pop("zenflow", None), c)
    zero_kw.update(_hybrid(zero, stage, dp, sp * tp, c))
    _zero_rest(zero, c)

    fp16, bf16 = _block("fp16", cfg.pop("fp16", None)), _block("bf16", cfg.pop("bf16", None))
    for name, block in (("fp16", fp16), ("bf16", bf16)):
        block["enabled"] = _bool(f"{name}.enabled", block.get("enabled", False))
    half = None
    if bf16["enabled"] and fp16["enabled"]:
        raise ConfigError("ds_config enables both fp16 and bf16; DeepSpeed (and dsfn) use one: keep one enabled")
    comm = cfg.pop("communication_data_type", None)
    if comm is not None and not (isinstance(comm, str) and comm in _DTYPES):
        raise ConfigError(f"ds_config communication_data_type={comm!r}: use one of fp32, fp16, bf16 (or null)")
    precision, scaler = [], []
    for name, block in (("bf16", bf16), ("fp16", fp16)):
        if not block.get("enabled", False):      # a disabled block's other keys do nothing, as in DeepSpeed
            for k in block:
                if k != "enabled":
                    c.ignore(f"{name}.{k}", f"{name} is disabled")
    if bf16.pop("enabled", False):
        half = torch.bfloat16
        for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if bf16.pop(k, False):
                c.no(f"bf16.{k}", "dsfn keeps fp32 master weights and optimizer state with mixed_precision")
        for k in ("immediate_grad_update", "check_grad_overflow"):
            if k in bf16:
                bf16.pop(k)
                c.ignore(f"bf16.{k}", "bf16 steps are never skipped in dsfn")
        for k in bf16:
            c.no(f"bf16.{k}", "not a DeepSpeed 0.19 bf16 key")
    if fp16.get("enabled", False):
        fp16.pop("enabled")
        given = set(fp16)
        half = torch.float16
        scale = _float("fp16.loss_scale", fp16.pop("loss_scale", 0))
        power = _int("fp16.initial_scale_power", fp16.pop("initial_scale_power", 16))
        if power > 1000:
            raise ConfigError(f"ds_config fp16.initial_scale_power={power}: the scale 2**power must fit a float "
                              "(DeepSpeed's default is 16)")
        kw = dict(init_scale=2.0 ** power,
                  window=_int("fp16.loss_scale_window", fp16.pop("loss_scale_window", 1000)),
                  hysteresis=_int("fp16.hysteresis", fp16.pop("hysteresis", 2)),
                  min_scale=_float("fp16.min_loss_scale", fp16.pop("min_loss_scale", 1), above=True),
                  consecutive_hysteresis=_bool("fp16.consecutive_hysteresis",
                                               fp16.pop("consecutive_hysteresis", False)))
        if scale:       # a static scale never changes: DeepSpeed ignores the dynamic keys, loss_scale refuses them
            for k in sorted(given & {"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                                     "consecutive_hysteresis"}):
                c.ignore(f"fp16.{k}", "a static loss_scale never changes")
            kw = {"static": scale}
        scaler.append(_make("fp16", T.loss_scale, **kw))
        for k in ("auto_cast", "fp16_master_weights_and_grads"):
            if fp16.pop(k, False):
                c.no(f"fp16.{k}", "dsfn casts the whole model with mixed_precision and keeps fp32 masters")
        for k in fp16:
            c.no(f"fp16.{k}", "not a DeepSpeed 0.19 fp16 key")
    if half is not None:
        precision.append(_make("bf16" if half == torch.bfloat16 else "fp16", T.mixed_precision, half,
                               reduce_dtype=_DTYPES[comm] if comm else None))
    elif comm is not None and _DTYPES[comm] != torch.float32:
        # fp32 training whose gradients travel in bf16/fp16: parameters, optimizer state and
        # accumulation stay fp32, the gradient reductions run in the given dtype
        precision.append(_make("communication_data_type", T.mixed_precision, torch.float32,
                               reduce_dtype=_DTYPES[comm]))

    clip = cfg.pop("gradient_clipping", 1.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise ConfigError(f"ds_config gradient_clipping={clip!r}: a max norm >= 0 (0 disables; DeepSpeed's "
                          "default is 1.0)")
    tx = _optimizer(cfg.pop("optimizer", None), cfg.pop("scheduler", None), model, c)
    remat_t = _activation_checkpointing(cfg.pop("activation_checkpointing", None), c)
    if pp > 1 and interval == 1 and not remat_t:     # every layer of each stage checkpointed
        remat_t = [_make("pipeline.activation_checkpoint_interval", T.remat)]
    ckpt, ckpt_t = _checkpointing(cfg, c, checkpoint_dir, save_every)
    _top_rest(cfg, c)

    if c.unsupported:
        lines = "\n".join(f"  - {k}: {why}" for k, why in c.unsupported)
        raise ConfigError(f"ds_config has {len(c.unsupported)} setting(s) dsfn does not reproduce; remove them "
                          f"(or change them as noted) and call from_ds_config again:\n{lines}")
    if c.ignored:
        warnings.warn("ds_config keys that only tune performance or logging are ignored by dsfn: "
                      + ", ".join(f"{k} ({why})" for k, why in c.ignored), UserWarning, stacklevel=2)

    stack: list = []
    if sp > 1:
        stack.append(T.sequence_parallel())
    stack.append(_make("zero_optimization", T.shard_zero, stage, **zero_kw))
    if tp > 1 and model is None:
        raise ConfigError("ds_config tensor_parallel.autotp_size > 1 needs the model: "
                          "from_ds_config(config, model=model)")
    if tp > 1 and pp == 1:
        stack.append(T.tensor_parallel("auto", model=model))
    stack += remat_t
    if gas > 1 and pp == 1:
        stack.append(T.accumulate(gas))
    stack += offload_t + precision + scaler
    if clip > 0:
        stack.append(_make("gradient_clipping", T.clip_grad_norm, float(clip)))
    stack += zenflow_t + ckpt_t
    if pp > 1:          # innermost: it runs the differentiated function itself, micro-batch by micro-batch
        if model is None:
            raise ConfigError("ds_config pipeline.stages > 1 needs the model (its layers are cut into stages): "
                              "from_ds_config(config, model=model)")
        split = _pipeline_split(model, pp, partition)
        stack.append(_make("pipeline", T.pipeline_parallel, "1f1b", microbatches=gas, model=model, split=split))
        if tp > 1:      # inside the pipeline: each stage's parameters split over its tp group
            stack.append(T.tensor_parallel("auto", model=model))
    return DsConfig(tuple(stack), tx, tb, mb, gas, world_size, {"pp": pp, "dp": dp, "sp": sp, "tp": tp}, ckpt,
                    tuple(k for k, _ in c.ignored), raw, resolved)


# -- pipeline parallelism ----------------------------------------------------------------------
_PIPE_COMM = {"pipe_partitioned": "partitioned p2p of tensor-parallel activations",
              "grad_partitioned": "partitioned p2p of tensor-parallel activation gradients"}


def _pipeline(block: Any, c: _Collect) -> tuple[int, str, int]:
    """(pp size, partition method, activation_checkpoint_interval) from the `pipeline` section (module docstring); its
    keys are popped and each one checked, listed or named as ignored."""
    if block is None:
        return 1, "uniform", 0
    b = _block("pipeline", block)
    stages = b.pop("stages", "auto")
    if stages is None or (isinstance(stages, str) and stages == "auto"):
        pp = 1
    else:
        pp = _int("pipeline.stages", stages)
        if pp < 1:
            raise ConfigError(f"ds_config pipeline.stages={stages!r}: the number of pipeline stages, an int >= 1 "
                              "(PipelineModule's num_stages)")
    if pp == 1:
        if b:
            c.ignore("pipeline", f"{sorted(b)} with no pipeline.stages > 1: DeepSpeed takes the stage count from "
                     "PipelineModule(num_stages=); set pipeline.stages to it for pipeline_parallel (without it the "
                     "accumulation steps run as accumulate(n): the same numbers)")
        return 1, "uniform", 0
    partition = b.pop("partition", "best")
    if not isinstance(partition, str):
        raise ConfigError(f"ds_config pipeline.partition={partition!r}: 'uniform', 'parameters' or 'type:<regex>'")
    low = partition.lower()
    if low in ("best", "uniform"):
        partition = "uniform"
    elif low == "parameters":
        partition = "parameters"
    elif low.startswith("type:"):
        partition = "type:" + partition[5:]
    else:
        c.no("pipeline.partition", f"{partition!r}: dsfn cuts the model's decoder layers 'uniform' (by count), by "
             "'parameters' or by 'type:<regex>' (DeepSpeed's 'profile' is not implemented there either)")
    interval = _int("pipeline.activation_checkpoint_interval", b.pop("activation_checkpoint_interval", 0))
    if interval > 1:
        c.no("pipeline.activation_checkpoint_interval", f"{interval}: DeepSpeed checkpoints groups of {interval} "
             "layers; dsfn's remat() checkpoints each layer of a stage: set 1 (every layer; the same numbers) or 0")
    if "use_reentrant" in b:
        _bool("pipeline.use_reentrant", b.pop("use_reentrant"))
        c.ignore("pipeline.use_reentrant", "it picks the checkpoint function; dsfn's remat is non-reentrant (the "
                 "same numbers)" if interval else "it picks the checkpoint function of "
                 "activation_checkpoint_interval, which is off")
    for k, what in _PIPE_COMM.items():
        if k in b:
            _bool(f"pipeline.{k}", b.pop(k))
            c.ignore(f"pipeline.{k}", f"{what}: communication only, and DeepSpeed applies it only under tensor "
                     "parallelism, which does not run inside a dsfn pipeline stage")
    if "seed_layers" in b and _bool("pipeline.seed_layers", b.pop("seed_layers")):
        c.ignore("pipeline.seed_layers", "it seeds PipelineModule's layer construction (DeepSpeed's engine reads "
                 "it from PipelineModule, not the config); dsfn trains the parameters the model already holds")
    for k in b:
        c.no(f"pipeline.{k}", "not a DeepSpeed 0.19 pipeline key (stages, partition, seed_layers, "
             "activation_checkpoint_interval, pipe_partitioned, grad_partitioned, use_reentrant)")
    return pp, partition, interval


def _pipeline_limits(pp: int, gas: int, sp: int, tp: int, c: _Collect) -> None:
    """What a dsfn pipeline does not combine with (listed, as DeepSpeed's own limits are)."""
    if gas < pp:
        c.no("gradient_accumulation_steps", f"{gas} with pipeline.stages {pp}: the accumulation steps are the "
             f"pipeline's micro-batches, and dsfn's 1F1B needs at least one per stage; set it >= {pp} (and "
             "train_batch_size to match)")


def _pipeline_split(model: Any, pp: int, partition: str) -> list[int] | None:
    """`pipeline_parallel(split=)` for a partition method: None (the even split by layer
    count) for 'uniform', else each stage's layer count balancing a weight per layer as
    DeepSpeed's `partition_balanced` does: its parameter count ('parameters'; the modules
    before the layer list, embeddings, counted on the first stage, those after it on the
    last, a tied weight once, where it first appears) or 1 for a layer whose class name
    matches the regex ('type:<regex>', case-insensitive as in DeepSpeed)."""
    import re
    from dsfn.engines.pipeline_stages import plan_stages
    if partition == "uniform":
        return None
    names = [n for n, _ in model.named_parameters()]
    plan = _make("pipeline", plan_stages, model, names, 1)
    layers, prefix = plan.layers, plan.layers_path + "."
    first = last = 0
    if partition == "parameters":
        weights = [0] * len(layers)
        order = {name: k for k, (name, _) in enumerate(model.named_modules())}
        at = order[plan.layers_path]
        for name, p in model.named_parameters():
            if name.startswith(prefix):
                weights[int(name[len(prefix):].split(".", 1)[0])] += p.numel()
            elif order.get(name.rsplit(".", 1)[0] if "." in name else "", -1) < at:
                first += p.numel()
            else:
                last += p.numel()
    else:
        try:
            regex = re.compile(partition[5:], re.IGNORECASE)
        except re.error as e:
            raise ConfigError(f"ds_config pipeline.partition={partition!r}: not a regular expression ({e})") from None
        weights = [1 if regex.search(type(layer).__name__) else 0 for layer in layers]
        if not any(weights):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ConfigError(f"ds_config pipeline.partition={partition!r}: no layer of the model's layer list "
                              f"({plan.layers_path}: {kinds}) matches; name one of those classes, or use 'uniform'")
    return balanced_split(weights, pp, first, last)


def balanced_split(weights: list[int], parts: int, first: int = 0, last: int = 0) -> list[int]:
    """Consecutive layer counts (each >= 1) cutting `weights` into `parts` stages whose
    largest total (`first` added to the first stage, `last` to the last) is the least
    possible; of those, the one whose earlier stages hold the most layers (equal weights
    give the even split, the first stages taking one more)."""
    n = len(weights)
    if n < parts:
        raise ConfigError(f"ds_config pipeline.stages={parts}: the model has {n} layers, fewer than the stages")
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)

    def cost(s: int, a: int, b: int) -> int:
        return pre[b] - pre[a] + (first if s == 0 else 0) + (last if s == parts - 1 else 0)

    inf = float("inf")
    # best[s][a]: the least largest total of stages s.. over layers a..
    best = [[inf] * (n + 1) for _ in range(parts)]
    for a in range(n):
        best[parts - 1][a] = cost(parts - 1, a, n)
    for s in range(parts - 2, -1, -1):
        for a in range(s, n - (parts - 1 - s)):
            best[s][a] = min(max(cost(s, a, b), best[s + 1][b]) for b in range(a + 1, n - (parts - 2 - s)))
    cap, counts, a = best[0][0], [], 0
    for s in range(parts - 1):
        b = max(b for b in range(a + 1, n - (parts - 2 - s)) if cost(s, a, b) <= cap and best[s + 1][b] <= cap)
        counts.append(b - a)
        a = b
    counts.append(n - a)
    return counts


def _tensor_parallel(block: Any, c: _Collect) -> int:
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f"ds_config tensor_parallel={block!r}: expected an object such as {{'autotp_size': 2}}")
    block = dict(block or {})
    tp = _int("tensor_parallel.autotp_size", block.pop("autotp_size", 0) or 0) or 1
    if block.pop("tp_overlap_comm", False):
        c.ignore("tensor_parallel.tp_overlap_comm", "communication overlap")
    for k in ("preset_model", "partition_config"):
        if block.pop(k, None) is not None:
            c.no(f"tensor_parallel.{k}", "dsfn applies the model's Hugging Face tp plan (tensor_parallel('auto')); "
                 "write a plan dict with tensor_parallel(plan) for other layouts")
    for k in block:
        c.no(f"tensor_parallel.{k}", "the legacy tp / tp_model_init settings are not read; use autotp_size")
    return tp


def _offload(zero: dict, stage: int, c: _Collect) -> list:
    from dsfn import transforms as T
    opt = zero.pop("offload_optimizer", None)
    par = zero.pop("offload_param", None)
    if zero.pop("cpu_offload", False):                    # deprecated alias
        opt = opt or {"device": "cpu"}
    if zero.pop("cpu_offload_param", False):
        par = par or {"device": "cpu"}
    opt = _block("zero_optimization.offload_optimizer", opt)
    par = _block("zero_optimization.offload_param", par)
    dev = opt.pop("device", "none") or "none"
    pdev = par.pop("device", "none") or "none"
    for key, d in (("offload_optimizer", dev), ("offload_param", pdev)):
        if not (isinstance(d, str) and d in ("none", "cpu", "nvme")):
            raise ConfigError(f"ds_config zero_optimization.{key}.device={d!r}: use none, cpu or nvme")
    for k in (_OFFLOAD_PERF & set(opt)):
        opt.pop(k)
        c.ignore(f"zero_optimization.offload_optimizer.{k}", "I/O tuning")
    for k in (_OFFLOAD_PERF & set(par)):
        par.pop(k)
        c.ignore(f"zero_optimization.offload_param.{k}", "I/O tuning")
    if dev not in ("none", "cpu", "nvme"):
        raise ConfigError(f"ds_config zero_optimization.offload_optimizer.device={dev!r}: use none, cpu or nvme")
    ratio = opt.pop("ratio", 1.0)
    if ratio != 1.0:
        c.no("zero_optimization.offload_optimizer.ratio", "partial (Twin-Flow) offload: dsfn offloads all of "
             "the optimizer state; use 1.0")
    super_offload = _bool("zero_optimization.offload_optimizer.super_offload", opt.pop("super_offload", False))
    cores = opt.pop("cpuadam_cores_perc", None)
    if cores is not None:
        cores = _float("zero_optimization.offload_optimizer.cpuadam_cores_perc", cores, above=True)
    path = opt.pop("nvme_path", None)
    pin = _bool("zero_optimization.offload_optimizer.pin_memory", opt.pop("pin_memory", True))
    if path is not None and not isinstance(path, str):
        raise ConfigError(f"ds_config zero_optimization.offload_optimizer.nvme_path={path!r}: a directory path")
    ppath = par.pop("nvme_path", None)
    par.pop("pin_memory", None)
    for k in opt:
        c.no(f"zero_optimization.offload_optimizer.{k}", "not a DeepSpeed 0.19 offload_optimizer key")
    for k in par:
        c.no(f"zero_optimization.offload_param.{k}", "not a DeepSpeed 0.19 offload_param key")
    if pdev != "none":
        if stage != 3:
            c.no("zero_optimization.offload_param", "parameter offload needs ZeRO stage 3 (as in DeepSpeed)")
        elif pdev != dev:
            c.no("zero_optimization.offload_param", f"dsfn offloads parameters to where the optimizer state lives; "
                 f"set offload_optimizer.device to {pdev!r} too")
        elif pdev == "nvme" and ppath not in (None, path):
            c.no("zero_optimization.offload_param.nvme_path", "one nvme_path for parameters and optimizer state")
    if dev == "none":
        return []
    if dev == "nvme" and not path:
        raise ConfigError("ds_config offload_optimizer.device='nvme' needs offload_optimizer.nvme_path "
                          "(a directory on a fast local disk)")
    return [_make("zero_optimization.offload_optimizer", T.offload, dev, params=pdev == dev and stage == 3,
                  path=path if dev == "nvme" else None, pin_memory=pin, overlap=super_offload, cores=cores)]


def _zenflow(block: Any, c: _Collect) -> list:
    from dsfn import transforms as T
    if not block:
        return []
    z = _block("zero_optimization.zenflow", block)
    kw = {"topk_ratio": z.pop("topk_ratio", 0.1), "full_warm_up_rounds": z.pop("full_warm_up_rounds", 0),
          "overlap": _bool("zero_optimization.zenflow.overlap_step", z.pop("overlap_step", False))}
    for key, arg in (("update_interval", "update_interval"), ("select_interval", "select_interval")):
        v = z.pop(key, "auto")
        if isinstance(v, str) and v == "auto":
            if key == "update_interval":
                c.no("zero_optimization.zenflow.update_interval", "'auto' (adaptive) is not supported; give an int")
        else:
            kw[arg] = v
    kw.setdefault("update_interval", 4)
    strategy = z.pop("select_strategy", "auto")
    if not (isinstance(strategy, str) and strategy == "step"):
        c.no("zero_optimization.zenflow.select_strategy", f"{strategy!r}: dsfn re-selects every select_interval "
             "updates (DeepSpeed's 'step'); set 'step'")
    z.pop("auto_ratio", None)
    if _bool("zero_optimization.zenflow.offload", z.pop("offload", False)):
        c.no("zero_optimization.zenflow.offload", "the selected columns' moments stay on the device")
    if "pt_reserved_cores_perc" in z:
        z.pop("pt_reserved_cores_perc")
        c.ignore("zero_optimization.zenflow.pt_reserved_cores_perc", "core pinning")
    for k in z:
        c.no(f"zero_optimization.zenflow.{k}", "not a DeepSpeed 0.19 zenflow key")
    return [_make("zero_optimization.zenflow", T.zenflow, **kw)]


def _hybrid(zero: dict, stage: int, dp: int, model_parallel: int, c: _Collect) -> dict:
    """shard_zero's hybrid-sharding options from MiCS's and ZeRO++ hpZ's keys (popped from `zero`).

    - `mics_shard_size: k` (k > 0; DeepSpeed's -1 default is off) -> `shard_group=k,
      cross_node=True`: the state is sharded over blocks of k consecutive ranks and
      replicated across the blocks, and (as in MiCS) a block may span nodes;
    - `zero_hpz_partition_size: k` (k > 1; 1, DeepSpeed's default, is off, and so is 0) ->
      `hpz=k`, with k clamped to the data-parallel size as DeepSpeed clamps it to the world.

    Both are stage 3 in DeepSpeed (MiCS is built only in its stage-3 branch, hpZ partitions
    parameters): at stages 1-2 DeepSpeed would not shard by them, so each is a listed
    error there rather than a silent change. DeepSpeed forms both groups over the global
    ranks (pure data parallelism); dsfn's shard groups are blocks of the "dp" axis, so with
    sequence or tensor parallelism the key is listed (write `shard_zero` by hand).
    `mics_hierarchical_params_gather: true` -> `hierarchical_gather=True` (with MiCS only:
    without a shard group it is listed): a shard group spanning nodes gathers its
    parameters across nodes first, then inside each node (`explain` says when the group
    fits in a node, where there is nothing to do in two stages, as DeepSpeed logs).
    """
    out: dict[str, Any] = {}
    mics = zero.pop("mics_shard_size", -1)
    hpz = zero.pop("zero_hpz_partition_size", 1)
    hier = _bool("zero_optimization.mics_hierarchical_params_gather",
                 zero.pop("mics_hierarchical_params_gather", False))
    if mics is None or (isinstance(mics, int) and not isinstance(mics, bool) and mics <= 0):
        mics = -1                      # DeepSpeed builds MiCS only for mics_shard_size > 0
    mics = _int("zero_optimization.mics_shard_size", mics) if mics != -1 else -1
    hpz = min(1 if hpz is None else _int("zero_optimization.zero_hpz_partition_size", hpz), dp)
    for key, on, spelled in (("mics_shard_size", mics > 0, f"shard_group={mics}, cross_node=True"),
                             ("zero_hpz_partition_size", hpz > 1, f"hpz={hpz}")):
        if not on:
            continue
        if stage != 3:
            c.no(f"zero_optimization.{key}", f"DeepSpeed reads it only at ZeRO stage 3; set stage 3 (then it is "
                 f"shard_zero(3, {spelled})), or remove it")
        elif model_parallel > 1:
            c.no(f"zero_optimization.{key}", "DeepSpeed forms its groups over the whole world (pure data "
                 "parallelism); with sequence / tensor parallelism write shard_zero(3, "
                 f"{spelled.split(',')[0]}) by hand (groups of the data-parallel ranks)")
    if mics > 0 and hpz > 1:
        c.no("zero_optimization.zero_hpz_partition_size", "with mics_shard_size: hybrid sharding already gathers "
             "inside its shard group in forward and backward; keep one of the two")
    if hier and not mics > 0:
        c.no("zero_optimization.mics_hierarchical_params_gather", "it is MiCS's two-stage gather of a shard group "
             "spanning nodes, and no mics_shard_size is set: set mics_shard_size, or remove the key")
    if stage == 3 and model_parallel == 1:
        if mics > 0:
            out.update(shard_group=mics, cross_node=True)
            if hier:
                out["hierarchical_gather"] = True
        elif hpz > 1:
            out["hpz"] = hpz
    return out


def _zero_rest(zero: dict, c: _Collect) -> None:
    for k in list(zero):
        v = zero.pop(k)
        if k in _ZERO_PERF:
            c.ignore(f"zero_optimization.{k}", "communication / memory tuning")
        elif k in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights") \
                and not v:
            continue
        elif k == "leaf_module" and not v:
            continue
        elif k in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
            c.no(f"zero_optimization.{k}", "ZeRO++ quantized communication")
        elif k == "leaf_module":
            c.no("zero_optimization.leaf_module", "use shard_zero(3, units=[module name patterns]) instead")
        else:
            c.no(f"zero_optimization.{k}", "not a DeepSpeed 0.19 zero_optimization key dsfn knows")


def _optimizer(block: Any, sched: Any, model: Any, c: _Collect) -> Any:
    from dsfn import optim
    from dsfn.optim.schedules import from_config
    if block is None:
        raise ConfigError("ds_config has no 'optimizer' block; dsfn needs one (e.g. {'type': 'AdamW', 'params': "
                          "{'lr': 3e-4}}) — a client optimizer passed to deepspeed.initialize becomes dsfn's tx")
    block = _block("optimizer", block)
    kind = block.get("type", "")
    if not isinstance(kind, str):
        raise ConfigError(f"ds_config optimizer.type={kind!r}: a name such as 'AdamW'")
    p = _block("optimizer.params", block.get("params"))
    if "max_grad_norm" in p:
        raise ConfigError("ds_config optimizer.params.max_grad_norm is not supported (DeepSpeed rejects it too): "
                          "use the top-level gradient_clipping")
    lr_of = lambda base: _make("scheduler", from_config, sched, optimizer_lr=base) if sched else base
    low = kind.lower()
    if low in ("adam", "adamw"):
        torch_adam = _bool("optimizer.params.torch_adam", p.pop("torch_adam", False))
        w_mode = low == "adamw" or _bool("optimizer.params.adam_w_mode", p.pop("adam_w_mode", True))
        p.pop("adam_w_mode", None)
        p.pop("fp32_optimizer_states", None)
        p.pop("foreach", None)
        if not _bool("optimizer.params.bias_correction", p.pop("bias_correction", True)):
            c.no("optimizer.params.bias_correction", "false: dsfn's Adam always corrects the bias")
        lr = _float("optimizer.params.lr", p.pop("lr", 1e-3))
        wd = _float("optimizer.params.weight_decay", p.pop("weight_decay", 0.01 if (torch_adam and w_mode) else 0.0))
        kw = dict(betas=_betas("optimizer.params.betas", p.pop("betas", (0.9, 0.999))),
                  eps=_float("optimizer.params.eps", p.pop("eps", 1e-8)), weight_decay=wd,
                  amsgrad=_bool("optimizer.params.amsgrad", p.pop("amsgrad", False)))
        for k in p:
            c.no(f"optimizer.params.{k}", f"not a parameter of DeepSpeed's {kind}")
        return _make("optimizer", optim.adamw if w_mode else optim.adam, lr_of(lr), **kw)
    if low == "muon":
        p.pop("adam_w_mode", None)
        lr = p.pop("lr", None)
        kw: dict = {}
        for src, dst in (("momentum", "momentum"), ("weight_decay", "weight_decay"), ("ns_method", "ns_method"),
                         ("betas", "adam_betas"), ("eps", "adam_eps")):
            if src in p:
                v = p.pop(src)
                key = f"optimizer.params.{src}"
                kw[dst] = _betas(key, v) if src == "betas" else v if src == "ns_method" else _float(key, v)
        for k in ("muon_lr", "adam_lr"):
            if k in p:
                kw[k] = lr_of(_float(f"optimizer.params.{k}", p.pop(k)))
        if _bool("optimizer.params.per_head_muon", p.pop("per_head_muon", False)):
            conf = getattr(model, "config", None)
            heads = getattr(conf, "num_attention_heads", None)
            if heads is None:
                c.no("optimizer.params.per_head_muon", "needs from_ds_config(..., model=a Hugging Face model) to "
                     "read num_attention_heads")
            else:
                kw["num_heads"] = heads
                kw["num_kv_heads"] = getattr(conf, "num_key_value_heads", None) or heads
        for k in p:
            c.no(f"optimizer.params.{k}", "not a parameter of DeepSpeed's Muon")
        lr = _float("optimizer.params.lr", lr) if lr is not None else None
        return _make("optimizer", optim.muon, lr_of(lr) if lr is not None else (lr_of(0.02) if sched else None), **kw)
    if low == "sgd":
        lr = _float("optimizer.params.lr", p.pop("lr", 1e-3))
        kw = {k: (_bool if k == "nesterov" else _float)(f"optimizer.params.{k}", p.pop(k))
              for k in ("momentum", "dampening", "nesterov", "weight_decay") if k in p}
        for k in p:
            c.no(f"optimizer.params.{k}", "not a parameter of torch.optim.SGD")
        return _make("optimizer", optim.sgd, lr_of(lr), **kw)
    if kind in ("Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lion", "MuAdam", "MuAdamW", "MuSGD",
                "Adagrad", "CPUAdagrad") or not hasattr(torch.optim, kind):
        c.no("optimizer.type", f"{kind!r}: dsfn has AdamW, Adam, Muon, SGD and elementwise torch.optim optimizers "
             "(from_torch)")
        return optim.adamw(1e-3)         # placeholder; the ConfigError listing follows
    lr = _float("optimizer.params.lr", p.pop("lr", 1e-3))
    return _make("optimizer", optim.from_torch, getattr(torch.optim, kind), lr=lr_of(lr), **p)


def _activation_checkpointing(block: Any, c: _Collect) -> list:
    from dsfn import transforms as T
    if not block:
        return []
    b = _block("activation_checkpointing", block)
    cpu = _bool("activation_checkpointing.cpu_checkpointing", b.pop("cpu_checkpointing", False))
    part = _bool("activation_checkpointing.partition_activations", b.pop("partition_activations", False))
    for k in ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        if k in b:
            b.pop(k)
            c.ignore(f"activation_checkpointing.{k}", "checkpointing tuning")
    for k in b:
        c.no(f"activation_checkpointing.{k}", "not a DeepSpeed 0.19 activation_checkpointing key")
    if not (cpu or part):
        return []
    return [_make("activation_checkpointing", T.remat, offload="cpu" if cpu else None, partition_activations=part)]


def _checkpointing(cfg: dict, c: _Collect, directory: Any, every: Any) -> tuple[dict, list]:
    from dsfn import transforms as T
    out: dict = {}
    block = _block("checkpoint", cfg.pop("checkpoint", None))
    for k in ("tag_validation", "load_universal", "use_node_local_storage", "checkpoint_serialization",
              "parallel_write"):
        if k in block:
            block.pop(k)
            c.ignore(f"checkpoint.{k}", "dsfn checkpoints are universal, tag-free, pickle-free")
    writer = block.pop("writer", None)
    if writer:
        writer = _block("checkpoint.writer", writer)
        out["engine"] = "async" if _bool("checkpoint.writer.decoupled", writer.get("decoupled", False)) else "sync"
        c.ignore("checkpoint.writer", "I/O tuning (decoupled -> the async engine)")
    for k in block:
        c.no(f"checkpoint.{k}", "not a DeepSpeed 0.19 checkpoint key")
    ds = cfg.pop("datastates_ckpt", None)
    if ds is not None:
        ds = _block("datastates_ckpt", ds)
        size = ds.pop("host_cache_size", None)
        out["engine"] = "async"
        if size is not None:
            out["host_cache_size"] = int(_float("datastates_ckpt.host_cache_size", size) * 2**30)
        for k in ds:
            c.no(f"datastates_ckpt.{k}", "only host_cache_size is read")
    if cfg.get("nebula") is not None and not _disabled(cfg.get("nebula")):
        c.no("nebula", "Azure Nebula: use async_checkpoint (host cache + background writer)")
    cfg.pop("nebula", None)
    if directory is None or not out:
        return out, []
    if every is None:
        raise ConfigError("from_ds_config(checkpoint_dir=...) needs save_every= (save every N steps)")
    kw = {"engine": out["engine"]}
    if out["engine"] == "async" and "host_cache_size" in out:
        kw["host_cache_size"] = out["host_cache_size"]
    return out, [_make("checkpoint", T.async_checkpoint, directory, every, **kw)]


def _top_rest(cfg: dict, c: _Collect) -> None:
    for k in list(cfg):
        v = cfg.pop(k)
        if k in _IGNORED_TOP:
            c.ignore(k, _IGNORED_TOP[k])
        elif k == "gradient_allreduce_op" and v in ("mean", "avg"):
            continue
        elif k == "gradient_allreduce_op":
            c.no(k, f"{v!r}: dsfn averages gradients over data parallel (DeepSpeed's 'mean')")
        elif k == "managed_gradient_accumulation" and v is not False:
            continue
        elif k == "managed_gradient_accumulation":
            c.no(k, "false (the caller steps at the boundary): dsfn's step takes the whole global batch; "
                 "use accumulate(n)")
        elif k == "data_types" and not isinstance(v, (Mapping, type(None))):
            c.no(k, f"{v!r}: expected an object such as {{'grad_accum_dtype': 'fp32'}}")
        elif k == "data_types" and not any((v or {}).values()):
            continue
        elif k == "data_types":
            c.no(k, "grad_accum_dtype / param_dtype: dsfn accumulates in the gradient dtype; use mixed_precision's "
                 "reduce_dtype for reductions")
        elif k == "compile" and not isinstance(v, (Mapping, type(None))):
            c.no(k, f"{v!r}: expected an object; dsfn does not run DeepSpeed's compile passes")
        elif k == "compile" and not (v or {}).get("deepcompile", False) and not (v or {}).get("passes"):
            continue
        elif isinstance(v, Mapping) and _disabled(v):
            continue
        elif k in ("amp", "torch_autocast"):
            c.no(k, "use bf16/fp16 (dsfn's mixed_precision) instead")
        else:
            c.no(k, "not supported by dsfn (or not a DeepSpeed 0.19 key)")
