"""`bf16` / `fp16` / `communication_data_type` -> `mixed_precision(dtype, reduce_dtype=)` and fp16's `loss_scale(...)`.

`bf16.enabled` / `fp16.enabled` is `mixed_precision(torch.bfloat16 / torch.float16,
reduce_dtype=communication_data_type)`; `communication_data_type` bf16 / fp16 without
either (fp32 training) is `mixed_precision(torch.float32, reduce_dtype=...)`, where only
the gradient reductions run in it; fp16's loss_scale, initial_scale_power,
loss_scale_window, hysteresis, consecutive_hysteresis and min_loss_scale are
`loss_scale(init_scale=2**p, window, hysteresis, min_scale, static=loss_scale if > 0,
consecutive_hysteresis)`.
"""
from __future__ import annotations

import torch

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import build, flag, number, section, whole_number

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_DYNAMIC_SCALE_KEYS = {"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale",
                       "consecutive_hysteresis"}


def _half_blocks(cfg: dict) -> tuple[dict, dict]:
    """(fp16, bf16) popped from `cfg`, each with a checked `enabled` (default false)."""
    fp16, bf16 = section("fp16", cfg.pop("fp16", None)), section("bf16", cfg.pop("bf16", None))
    for name, block in (("fp16", fp16), ("bf16", bf16)):
        block["enabled"] = flag(f"{name}.enabled", block.get("enabled", False))
    if bf16["enabled"] and fp16["enabled"]:
        raise ConfigError("ds_config enables both fp16 and bf16; DeepSpeed (and dsfn) use one: keep one enabled")
    return fp16, bf16


def _communication_dtype(cfg: dict) -> str | None:
    """`communication_data_type` (popped): fp32, fp16, bf16 (or their long names), or None."""
    comm = cfg.pop("communication_data_type", None)
    if comm is not None and not (isinstance(comm, str) and comm in _DTYPES):
        raise ConfigError(f"ds_config communication_data_type={comm!r}: use one of fp32, fp16, bf16 (or null)")
    return comm


def _read_bf16_keys(bf16: dict, report: KeyReport) -> None:
    """An enabled bf16 block's keys besides `enabled`: listed, or ignored where they only tune."""
    for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16.pop(k, False):
            report.refuse(f"bf16.{k}", "dsfn keeps fp32 master weights and optimizer state with mixed_precision")
    for k in ("immediate_grad_update", "check_grad_overflow"):
        if k in bf16:
            bf16.pop(k)
            report.ignore(f"bf16.{k}", "bf16 steps are never skipped in dsfn")
    for k in bf16:
        report.refuse(f"bf16.{k}", "not a DeepSpeed 0.19 bf16 key")


def _fp16_loss_scale(fp16: dict, report: KeyReport) -> object:
    """The `loss_scale` transform of an enabled fp16 block (its `enabled` already popped); its other keys listed."""
    from dsfn import transforms as T
    given = set(fp16)
    scale = number("fp16.loss_scale", fp16.pop("loss_scale", 0))
    power = whole_number("fp16.initial_scale_power", fp16.pop("initial_scale_power", 16))
    if power > 1000:
        raise ConfigError(f"ds_config fp16.initial_scale_power={power}: the scale 2**power must fit a float "
                          "(DeepSpeed's default is 16)")
    kw = dict(init_scale=2.0 ** power,
              window=whole_number("fp16.loss_scale_window", fp16.pop("loss_scale_window", 1000)),
              hysteresis=whole_number("fp16.hysteresis", fp16.pop("hysteresis", 2)),
              min_scale=number("fp16.min_loss_scale", fp16.pop("min_loss_scale", 1), above=True),
              consecutive_hysteresis=flag("fp16.consecutive_hysteresis", fp16.pop("consecutive_hysteresis", False)))
    if scale:       # a static scale never changes: DeepSpeed ignores the dynamic keys, loss_scale refuses them
        for k in sorted(given & _DYNAMIC_SCALE_KEYS):
            report.ignore(f"fp16.{k}", "a static loss_scale never changes")
        kw = {"static": scale}
    scaler = build("fp16", T.loss_scale, **kw)
    for k in ("auto_cast", "fp16_master_weights_and_grads"):
        if fp16.pop(k, False):
            report.refuse(f"fp16.{k}", "dsfn casts the whole model with mixed_precision and keeps fp32 masters")
    for k in fp16:
        report.refuse(f"fp16.{k}", "not a DeepSpeed 0.19 fp16 key")
    return scaler


def read_precision(cfg: dict, report: KeyReport) -> tuple[list, list]:
    """([mixed_precision] or [], [loss_scale] or []) from `bf16`, `fp16` and `communication_data_type` (popped)."""
    from dsfn import transforms as T
    fp16, bf16 = _half_blocks(cfg)
    comm = _communication_dtype(cfg)
    half = None
    precision, scaler = [], []
    for name, block in (("bf16", bf16), ("fp16", fp16)):
        if not block.get("enabled", False):      # a disabled block's other keys do nothing, as in DeepSpeed
            for k in block:
                if k != "enabled":
                    report.ignore(f"{name}.{k}", f"{name} is disabled")
    if bf16.pop("enabled", False):
        half = torch.bfloat16
        _read_bf16_keys(bf16, report)
    if fp16.get("enabled", False):
        fp16.pop("enabled")
        half = torch.float16
        scaler.append(_fp16_loss_scale(fp16, report))
    if half is not None:
        precision.append(build("bf16" if half == torch.bfloat16 else "fp16", T.mixed_precision, half,
                               reduce_dtype=_DTYPES[comm] if comm else None))
    elif comm is not None and _DTYPES[comm] != torch.float32:
        # fp32 training whose gradients travel in bf16/fp16: parameters, optimizer state and
        # accumulation stay fp32, the gradient reductions run in the given dtype
        precision.append(build("communication_data_type", T.mixed_precision, torch.float32,
                               reduce_dtype=_DTYPES[comm]))
    return precision, scaler
