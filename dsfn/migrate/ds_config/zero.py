"""The `zero_optimization` section -> `shard_zero(stage, ...)`, with its offload and ZenFlow transforms.

`stage` s (default 0) is `shard_zero(s, reduce_bucket_size, allgather_bucket_size (s >= 1),
param_persistence_threshold (s = 3))` with DeepSpeed's defaults (5e8, 5e8, 1e5);
`mics_shard_size` / `zero_hpz_partition_size` are hybrid sharding (`_hybrid`); the
communication / memory tuning keys are named in the warning; ZeRO++'s quantized keys (stage
3, as DeepSpeed reads them) are `shard_zero(3, ...)` options (`_quantized`); `leaf_module`
is listed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.offload import read_offload
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.tuning_keys import ZERO_PERF
from dsfn.migrate.ds_config.values import flag, whole_number
from dsfn.migrate.ds_config.zenflow import read_zenflow

# ZeRO++'s quantized keys -> (shard_zero's option, its value, what DeepSpeed quantizes), `_quantized`
_QUANTIZED = {"zero_quantized_weights": ("quantize_weights", "int8", "ZeRO-3's weight gathers"),
              "zero_quantized_gradients": ("quantize_grads", "int4", "ZeRO-3's gradient reduce-scatter"),
              "zero_quantized_nontrainable_weights": ("quantize_frozen", "int8", "ZeRO-3's frozen weight shards")}


@dataclass
class ZeroSettings:
    """What `zero_optimization` builds: `shard_zero(stage, **shard_kwargs)`, and the offload /
    zenflow transforms (lists of none or one) it places in the stack."""
    stage: int
    shard_kwargs: dict
    offload: list = field(default_factory=list)
    zenflow: list = field(default_factory=list)


def _stage(zero: dict) -> int:
    """`stage` (popped; default 0): DeepSpeed's 0, 1, 2 or 3."""
    stage = zero.pop("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"ds_config zero_optimization.stage={stage!r}: DeepSpeed's stages are 0, 1, 2, 3")
    return stage


def _bucket_sizes(zero: dict, stage: int, given: set, report: KeyReport) -> dict:
    """shard_zero's reduce_bucket_size, allgather_bucket_size (stage >= 1) and
    param_persistence_threshold (stage 3), popped from `zero` (DeepSpeed's defaults)."""
    kw = dict(reduce_bucket_size=max(whole_number("zero_optimization.reduce_bucket_size",
                                                  zero.pop("reduce_bucket_size", 5e8)), 1),
              allgather_bucket_size=max(whole_number("zero_optimization.allgather_bucket_size",
                                                     zero.pop("allgather_bucket_size", 5e8)), 1))
    if stage == 0:      # stage 0 all-gathers nothing (shard_zero(0) refuses the key); DeepSpeed ignores it
        kw.pop("allgather_bucket_size")
        if "allgather_bucket_size" in given:
            report.ignore("zero_optimization.allgather_bucket_size", "stage 0 all-gathers nothing")
    threshold = zero.pop("stage3_param_persistence_threshold", zero.pop("param_persistence_threshold", 1e5))
    if stage == 3:
        kw["param_persistence_threshold"] = whole_number("zero_optimization.stage3_param_persistence_threshold",
                                                         threshold)
    return kw


def _hybrid(zero: dict, stage: int, dp: int, model_parallel: int, report: KeyReport) -> dict:
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
    hier = flag("zero_optimization.mics_hierarchical_params_gather",
                zero.pop("mics_hierarchical_params_gather", False))
    if mics is None or (isinstance(mics, int) and not isinstance(mics, bool) and mics <= 0):
        mics = -1                      # DeepSpeed builds MiCS only for mics_shard_size > 0
    mics = whole_number("zero_optimization.mics_shard_size", mics) if mics != -1 else -1
    hpz = min(1 if hpz is None else whole_number("zero_optimization.zero_hpz_partition_size", hpz), dp)
    for key, on, spelled in (("mics_shard_size", mics > 0, f"shard_group={mics}, cross_node=True"),
                             ("zero_hpz_partition_size", hpz > 1, f"hpz={hpz}")):
        if not on:
            continue
        if stage != 3:
            report.refuse(f"zero_optimization.{key}", f"DeepSpeed reads it only at ZeRO stage 3; set stage 3 (then it "
                          f"is shard_zero(3, {spelled})), or remove it")
        elif model_parallel > 1:
            report.refuse(f"zero_optimization.{key}", "DeepSpeed forms its groups over the whole world (pure data "
                          "parallelism); with sequence / tensor parallelism write shard_zero(3, "
                          f"{spelled.split(',')[0]}) by hand (groups of the data-parallel ranks)")
    if mics > 0 and hpz > 1:
        report.refuse("zero_optimization.zero_hpz_partition_size", "with mics_shard_size: hybrid sharding already "
                      "gathers inside its shard group in forward and backward; keep one of the two")
    if hier and not mics > 0:
        report.refuse("zero_optimization.mics_hierarchical_params_gather", "it is MiCS's two-stage gather of a shard "
                      "group spanning nodes, and no mics_shard_size is set: set mics_shard_size, or remove the key")
    if stage == 3 and model_parallel == 1:
        if mics > 0:
            out.update(shard_group=mics, cross_node=True)
            if hier:
                out["hierarchical_gather"] = True
        elif hpz > 1:
            out["hpz"] = hpz
    return out


def _other_zero_keys(zero: dict, report: KeyReport) -> None:
    """The keys of `zero` no reader above took: tuning (ignored), off switches, or listed."""
    for k in list(zero):
        v = zero.pop(k)
        if k in ZERO_PERF:
            report.ignore(f"zero_optimization.{k}", "communication / memory tuning")
        elif k == "leaf_module" and not v:
            continue
        elif k == "leaf_module":
            report.refuse("zero_optimization.leaf_module", "use shard_zero(3, units=[module name patterns]) instead")
        else:
            report.refuse(f"zero_optimization.{k}", "not a DeepSpeed 0.19 zero_optimization key dsfn knows")


def _quantized(zero: dict, stage: int, report: KeyReport) -> dict:
    """ZeRO++'s quantized keys (popped), each read by DeepSpeed's stage 3 only:
    `zero_quantized_weights` (qwZ: int8 block-wise weight gathers) -> quantize_weights="int8",
    `zero_quantized_gradients` (qgZ: int4 hierarchical all-to-all reduction) ->
    quantize_grads="int4", `zero_quantized_nontrainable_weights` (frozen weights held in
    int8) -> quantize_frozen="int8"; dsfn's block sizes (2048 weights, 32 gradients)."""
    out = {}
    for key, (option, fmt, what) in _QUANTIZED.items():
        on = zero.pop(key, False)
        if not isinstance(on, bool):
            raise ConfigError(f"ds_config zero_optimization.{key}={on!r}: expected true or false")
        if not on:
            continue
        if stage != 3:
            report.refuse(f"zero_optimization.{key}", f"DeepSpeed quantizes {what}; set stage 3 (then it is "
                          f"shard_zero(3, {option}='{fmt}')), or remove it")
            continue
        out[option] = fmt
    return out


def read_zero(block: Any, dp: int, model_parallel: int, report: KeyReport) -> ZeroSettings:
    """The `zero_optimization` section (popped by the caller; None when absent) as ZeroSettings."""
    if block is not None and not isinstance(block, Mapping):
        raise ConfigError(f"ds_config zero_optimization={block!r}: expected an object such as {{'stage': 2}}")
    zero = dict(block or {})
    given = set(zero)
    stage = _stage(zero)
    shard_kwargs = _bucket_sizes(zero, stage, given, report)
    offload = read_offload(zero, stage, report)
    zenflow = read_zenflow(zero.pop("zenflow", None), report)
    shard_kwargs.update(_hybrid(zero, stage, dp, model_parallel, report))
    shard_kwargs.update(_quantized(zero, stage, report))
    _other_zero_keys(zero, report)
    return ZeroSettings(stage, shard_kwargs, offload, zenflow)
