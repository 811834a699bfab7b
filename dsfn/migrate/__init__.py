"""Migrating from DeepSpeed: `ds_config.json` -> a dsfn stack, DeepSpeed checkpoints -> dsfn states.

    cfg = dsfn.from_ds_config("ds_config.json", model=model)    # HF configs: auto=hf_trainer_auto(args)
    step = cfg.compose(train_step)                              # donates its input state
    state = step.place(load_deepspeed("ckpt/", like=dsfn.TrainState.create(params, cfg.tx), trust_pickle=True))

`ds_config` (the config block by block, a module per section), `ds_moe` (the arguments of
DeepSpeed's `MoE(...)` layer as expert_parallel options), `ds_checkpoint` (ZeRO 0-3
and universal checkpoints; pickles, behind `trust_pickle=True`, found and unpickled by
`ds_files`). See docs/migration.md.
"""
from dsfn.migrate.ds_checkpoint import DeepSpeedCheckpoint, convert_deepspeed, load_deepspeed, read_deepspeed
from dsfn.migrate.ds_config import DsConfig, batch_sizes, from_ds_config, hf_trainer_auto
from dsfn.migrate.ds_moe import from_ds_moe

__all__ = ["DeepSpeedCheckpoint", "DsConfig", "batch_sizes", "convert_deepspeed", "from_ds_config",
           "from_ds_moe", "hf_trainer_auto", "load_deepspeed", "read_deepspeed"]
