"""`from_ds_config`: a ds_config read section by section, then assembled into a `DsConfig`."""
from __future__ import annotations

import os
from typing import Any, Mapping

from dsfn.migrate.ds_config.activation_checkpointing import pipeline_remat, read_activation_checkpointing
from dsfn.migrate.ds_config.auto import resolve_auto
from dsfn.migrate.ds_config.batch import BATCH_KEYS, read_batch_sizes
from dsfn.migrate.ds_config.checkpoint import read_checkpointing
from dsfn.migrate.ds_config.loading import json_copy, load_config
from dsfn.migrate.ds_config.optimizer import read_gradient_clipping, read_optimizer
from dsfn.migrate.ds_config.parallel import launcher_world_size, read_parallel_layout
from dsfn.migrate.ds_config.pipeline import check_pipeline_limits
from dsfn.migrate.ds_config.precision import read_precision
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.result import DsConfig
from dsfn.migrate.ds_config.stack import assemble_stack
from dsfn.migrate.ds_config.top_level import sort_remaining_keys
from dsfn.migrate.ds_config.zero import read_zero


def from_ds_config(config: str | os.PathLike | Mapping, model: Any = None, world_size: int | None = None,
                   checkpoint_dir: str | os.PathLike | None = None, save_every: int | None = None,
                   auto: Mapping[str, Any] | None = None, tx: Any = None,
                   micro_batch_size: int | None = None) -> DsConfig:
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
        tx: the client optimizer, for a config with no `optimizer` block (what
            `deepspeed.initialize(model, optimizer=...)` takes): a dsfn optimizer, a torch.optim
            class, instance or factory `f(params)`, or "hf" (Hugging Face Trainer's AdamW from
            `auto=hf_trainer_auto(args)`). The config's scheduler drives its lr and its
            gradient_clipping applies around it, as in DeepSpeed
            (`dsfn.migrate.ds_config.client_optimizer`).
        micro_batch_size: rows per rank per forward (the data loader's batch size), for a
            config with neither train_batch_size nor train_micro_batch_size_per_gpu (as
            accelerate fills it); the rest by DeepSpeed's rule. Must agree with a config that
            gives its own.
    Raises:
        ConfigError: one error listing every key dsfn does not reproduce, one listing every
            `"auto"` nothing fills, or a value (named by its key) or batch-size combination
            DeepSpeed itself rejects.
    """
    cfg = load_config(config)
    raw = json_copy(cfg)
    report = KeyReport()
    world_size = launcher_world_size(world_size)
    resolve_auto(cfg, auto, model)
    resolved = json_copy(cfg)

    # each section's keys are popped from cfg; what none reads is sorted last
    layout = read_parallel_layout(cfg, world_size, report, model)
    tb, mb, gas = read_batch_sizes(cfg, layout.dp, micro_batch_size)
    if layout.pp > 1:
        check_pipeline_limits(layout.pp, gas, report)
    resolved.update(zip(BATCH_KEYS, (tb, mb, gas)))
    zero = read_zero(cfg.pop("zero_optimization", None), layout.zero_dp, layout.sp * layout.tp, report)
    precision, scaler = read_precision(cfg, report)
    clip = read_gradient_clipping(cfg)
    tx = read_optimizer(cfg.pop("optimizer", None), cfg.pop("scheduler", None), model, report, tx, auto)
    remat = pipeline_remat(layout.pp, layout.interval,
                           read_activation_checkpointing(cfg.pop("activation_checkpointing", None), report))
    ckpt, ckpt_transforms = read_checkpointing(cfg, report, checkpoint_dir, save_every)
    sort_remaining_keys(cfg, report)
    report.raise_or_warn(stacklevel=3)          # the warning points at from_ds_config's caller

    stack = assemble_stack(layout, gas, zero, remat, precision + scaler, clip, ckpt_transforms, model)
    return DsConfig(stack, tx, tb, mb, gas, world_size, layout.mesh, ckpt, tuple(k for k, _ in report.ignored),
                    raw, resolved)
