"""`activation_checkpointing` -> `remat(offload="cpu" if cpu_checkpointing, partition_activations=)`."""
from __future__ import annotations

from typing import Any

from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import build, flag, section


def read_activation_checkpointing(block: Any, report: KeyReport) -> list:
    """The `remat` transform (a list of none or one): only cpu_checkpointing / partition_activations make one."""
    from dsfn import transforms as T
    if not block:
        return []
    b = section("activation_checkpointing", block)
    cpu = flag("activation_checkpointing.cpu_checkpointing", b.pop("cpu_checkpointing", False))
    part = flag("activation_checkpointing.partition_activations", b.pop("partition_activations", False))
    for k in ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary", "profile"):
        if k in b:
            b.pop(k)
            report.ignore(f"activation_checkpointing.{k}", "checkpointing tuning")
    for k in b:
        report.refuse(f"activation_checkpointing.{k}", "not a DeepSpeed 0.19 activation_checkpointing key")
    if not (cpu or part):
        return []
    return [build("activation_checkpointing", T.remat, offload="cpu" if cpu else None, partition_activations=part)]


def pipeline_remat(pp: int, interval: int, remat: list) -> list:
    """`remat()` for `pipeline.activation_checkpoint_interval: 1` (every layer of each stage
    checkpointed) when `activation_checkpointing` made none; else `remat` as given."""
    from dsfn import transforms as T
    if pp > 1 and interval == 1 and not remat:
        return [build("pipeline.activation_checkpoint_interval", T.remat)]
    return remat
