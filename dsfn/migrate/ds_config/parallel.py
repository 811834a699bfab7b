"""The world size and the parallel layout: `sequence_parallel_size`, `tensor_parallel` and
`pipeline.stages` -> the mesh sizes pp x dp x sp x tp."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.pipeline import read_pipeline
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import whole_number


@dataclass(frozen=True)
class ParallelLayout:
    """The mesh sizes (pp outermost, then dp, sp, tp), with the pipeline's partition method
    and activation_checkpoint_interval (read with its stage count)."""
    pp: int
    dp: int          # the data-parallel ranks (DeepSpeed's dp: the batch rule's), ep included
    sp: int
    tp: int
    partition: str
    interval: int
    ep: int = 1      # AutoEP's autoep_size: borrowed from dp (the mesh's dp is dp / ep)

    @property
    def zero_dp(self) -> int:
        """The mesh's dp axis: what ZeRO shards over (dp / ep)."""
        return self.dp // self.ep

    @property
    def mesh(self) -> dict[str, int]:
        """{"pp", "dp", "sp", "tp"} sizes (and "ep" with expert parallel), as `DsConfig.mesh`."""
        out = {"pp": self.pp, "dp": self.zero_dp, "sp": self.sp, "tp": self.tp}
        if self.ep > 1:
            out["ep"] = self.ep
        return out


def launcher_world_size(world_size: int | None) -> int:
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


def read_tensor_parallel(block: Any, report: KeyReport) -> int:
    """The tp size from the `tensor_parallel` section (`autotp_size`; absent or 0 is 1)."""
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f"ds_config tensor_parallel={block!r}: expected an object such as {{'autotp_size': 2}}")
    block = dict(block or {})
    tp = whole_number("tensor_parallel.autotp_size", block.pop("autotp_size", 0) or 0) or 1
    if block.pop("tp_overlap_comm", False):
        report.ignore("tensor_parallel.tp_overlap_comm", "communication overlap")
    for k in ("preset_model", "partition_config"):
        if block.pop(k, None) is not None:
            report.refuse(f"tensor_parallel.{k}", "dsfn applies the model's Hugging Face tp plan "
                          "(tensor_parallel('auto')); write a plan dict with tensor_parallel(plan) for other layouts")
    for k in block:
        report.refuse(f"tensor_parallel.{k}", "the legacy tp / tp_model_init settings are not read; use autotp_size")
    return tp


def read_parallel_layout(cfg: dict, world_size: int, report: KeyReport, model: Any = None) -> ParallelLayout:
    """Pop `sequence_parallel_size`, `tensor_parallel`, `pipeline` and `expert_parallel` from
    `cfg`; the data-parallel size is what the world leaves (a ConfigError when pp x sp x tp
    does not divide it, or autoep_size does not divide the data-parallel ranks)."""
    from dsfn.migrate.ds_config.expert import read_expert_parallel
    ep = read_expert_parallel(cfg.pop("expert_parallel", None), model, report)
    sp = whole_number("sequence_parallel_size", cfg.pop("sequence_parallel_size", 1) or 1)
    tp = read_tensor_parallel(cfg.pop("tensor_parallel", None), report)
    pp, partition, interval = read_pipeline(cfg.pop("pipeline", None), report)
    if world_size % (pp * sp * tp):
        what = f"pipeline.stages ({pp}) x " if pp > 1 else ""
        raise ConfigError(f"ds_config: world size {world_size} is not divisible by {what}sequence_parallel_size "
                          f"({sp}) x tensor_parallel.autotp_size ({tp}); the data-parallel size is world / "
                          f"({'pp x ' if pp > 1 else ''}sp x tp)")
    dp = world_size // (pp * sp * tp)
    if dp % ep:
        ok = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ConfigError(f"ds_config expert_parallel.autoep_size={ep} must divide the data-parallel ranks "
                          f"(world {world_size} / (pp x sp x tp) = {dp}); valid sizes: {ok}")
    return ParallelLayout(pp, dp, sp, tp, partition, interval, ep)
