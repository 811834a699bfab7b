"""`"auto"` values (Hugging Face Trainer's configs): `hf_trainer_auto` and filling a config's "auto" entries.

`"auto"` values are filled from `auto=` (dotted key -> value; `hf_trainer_auto(training_args)`
gives what HF Trainer would fill), the bucket sizes from the model's hidden size as HF does
(reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
stage3_param_persistence_threshold = 10*h), the third batch size from the other two, the
scheduler's warmup_min_lr as 0 and warmup_max_lr as the optimizer's lr; what is left is
listed in one ConfigError.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Mapping

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.batch import BATCH_KEYS
from dsfn.migrate.ds_config.tuning_keys import is_ignored_path

# the keys HF Trainer fills, and where it takes the value from
_TA = "HF Trainer: TrainingArguments."
HF_AUTO = {
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
    """The value at the dotted `path` of `cfg`, or None."""
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(cfg: dict, path: str, value: Any) -> None:
    """Set the value at the dotted `path` of `cfg` (its parents exist)."""
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


def _given_values(cfg: dict, auto: Any, paths: list[str]) -> dict[str, Any]:
    """Check `auto=` and write its values into `cfg`'s "auto" entries; returns {path: value} written."""
    if auto is None:
        auto = {}
    if not isinstance(auto, Mapping) or not all(isinstance(k, str) for k in auto):
        raise ConfigError(f"from_ds_config(auto={auto!r}): a dict of dotted ds_config keys -> values, e.g. "
                          "{'optimizer.params.lr': 3e-4}, or dsfn.migrate.hf_trainer_auto(training_args)")
    stray = sorted(k for k in auto if k not in paths and k not in HF_AUTO)
    if stray:
        raise ConfigError(f"from_ds_config(auto=...): {stray} match no \"auto\" value of this ds_config (its "
                          f"\"auto\" keys: {paths}); auto= fills only entries written \"auto\"")
    filled: dict[str, Any] = {}
    for path in paths:
        if path in auto:
            filled[path] = copy.deepcopy(auto[path])
            _set(cfg, path, filled[path])
    return filled


def _fill_defaults(cfg: dict, paths: list[str], filled: dict, model: Any) -> list[tuple[str, str]]:
    """Fill the "auto" entries `auto=` left that dsfn fills itself (bucket sizes from the
    model's hidden size, warmup_min_lr); returns (path, where HF takes it) for those left."""
    stage = _get(cfg, "zero_optimization.stage")
    hidden = _hidden_size(model)
    missing: list[tuple[str, str]] = []
    for path in paths:
        if path in filled:
            continue
        where = HF_AUTO.get(path, "not filled by HF Trainer: give a value")
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
        elif path in BATCH_KEYS:
            continue                                           # after the others: any two give the third
        elif is_ignored_path(path):
            continue                                           # accepted without being read
        elif path == "pipeline.stages":
            continue                                           # DeepSpeed's own default: no pipeline here
        elif path.count(".") and _get(cfg, path.split(".")[0] + ".enabled") is False:
            continue                                           # a disabled block's keys do nothing
        else:
            missing.append((path, where))
    return missing


def _fill_warmup_max_lr(cfg: dict, paths: list[str], filled: dict,
                        missing: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """An "auto" warmup_max_lr is the optimizer's lr (as HF fills it); returns `missing` updated."""
    lr = _get(cfg, "optimizer.params.lr")
    if "scheduler.params.warmup_max_lr" in paths and "scheduler.params.warmup_max_lr" not in filled:
        missing = [m for m in missing if m[0] != "scheduler.params.warmup_max_lr"]
        if lr is not None and lr != "auto":
            filled["scheduler.params.warmup_max_lr"] = lr      # HF: learning_rate, the optimizer's lr
            _set(cfg, "scheduler.params.warmup_max_lr", lr)
        else:
            missing.append(("scheduler.params.warmup_max_lr", HF_AUTO["scheduler.params.warmup_max_lr"]
                            + " (the optimizer's lr, which is \"auto\" or absent too)"))
    return missing


def _leave_batch_sizes(cfg: dict, paths: list[str], filled: dict, missing: list[tuple[str, str]]) -> None:
    """An "auto" batch size becomes None for DeepSpeed's rule when two are known, else it is missing."""
    batch_auto = [k for k in BATCH_KEYS if k in paths and k not in filled]
    if batch_auto:
        known = [k for k in BATCH_KEYS if cfg.get(k) is not None and cfg.get(k) != "auto"]
        if len(known) >= 2:
            for k in batch_auto:
                cfg[k] = None                                  # DeepSpeed's rule derives it
        else:
            missing += [(k, HF_AUTO[k]) for k in batch_auto]


def _raise_missing(paths: list[str], missing: list[tuple[str, str]]) -> None:
    """One ConfigError listing every "auto" nothing fills, and how to supply it."""
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


def resolve_auto(cfg: dict, auto: Any, model: Any) -> dict:
    """Fill every "auto" of `cfg` in place (module docstring); the batch sizes still unknown
    are left None for DeepSpeed's rule. Returns {path: value} of what was filled. Raises one
    ConfigError listing every "auto" that nothing fills, and how to supply it."""
    paths = _autos(cfg)
    filled = _given_values(cfg, auto, paths)
    missing = _fill_defaults(cfg, paths, filled, model)
    missing = _fill_warmup_max_lr(cfg, paths, filled, missing)
    _leave_batch_sizes(cfg, paths, filled, missing)
    if missing:
        _raise_missing(paths, missing)
    return filled
