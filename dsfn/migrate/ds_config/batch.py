"""The three batch sizes (`train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`).

Batch sizes follow DeepSpeed's rule train_batch_size = micro * accumulation * dp world
(dp world = world / (pp * sp * tp)): any two give the third, all three must agree
(`batch_sizes`). The world size is the launcher's: without `world_size=`, a process
started by torchrun / `dsfn.launch` joins its process group first (as a Step does), so
the sizes are those DeepSpeed derives on the same ranks.
"""
from __future__ import annotations

from dsfn.errors import ConfigError

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


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


def read_batch_sizes(cfg: dict, dp_world_size: int, micro_batch_size: int | None = None) -> tuple[int, int, int]:
    """Pop the three batch keys of `cfg` and return (train_batch_size, micro, accumulation) by
    `batch_sizes`. `micro_batch_size`: the caller's rows per rank per forward (its data
    loader's batch size), which fills a config that gives neither train_batch_size nor
    train_micro_batch_size_per_gpu, as accelerate fills it from the loader; given with a
    config that has its own, the two must agree."""
    tb, mb = cfg.pop("train_batch_size", None), cfg.pop("train_micro_batch_size_per_gpu", None)
    gas = cfg.pop("gradient_accumulation_steps", None)
    if micro_batch_size is not None and (isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int)
                                         or micro_batch_size < 1):
        raise ConfigError(f"from_ds_config(micro_batch_size={micro_batch_size!r}): rows per rank per forward, an "
                          "int >= 1")
    if tb is None and mb is None:
        if micro_batch_size is None:
            raise ConfigError("ds_config gives neither train_batch_size (the global batch per optimizer step) nor "
                              "train_micro_batch_size_per_gpu (rows per rank per forward), and DeepSpeed needs one: "
                              "accelerate fills the micro batch from the data loader's batch_size, HF Trainer from "
                              "per_device_train_batch_size. Pass yours: from_ds_config(..., micro_batch_size=N) (or "
                              "auto=hf_trainer_auto(args) for an 'auto' entry), or add one of the keys")
        mb = micro_batch_size
    out = batch_sizes(tb, mb, gas, dp_world_size)
    if micro_batch_size is not None and out[1] != micro_batch_size:
        raise ConfigError(f"from_ds_config(micro_batch_size={micro_batch_size}) disagrees with the config's batch "
                          f"sizes, whose micro batch per rank is {out[1]} (train_batch_size {out[0]}, "
                          f"gradient_accumulation_steps {out[2]}, data-parallel world {dp_world_size}); drop one")
    return out
