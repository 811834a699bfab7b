"""The stack a ds_config builds, in canonical order (outermost first).

sequence_parallel, shard_zero, tensor_parallel (without a pipeline), expert_parallel, remat, accumulate
(without a pipeline), offload, mixed_precision, loss_scale, clip_grad_norm, zenflow,
async_checkpoint, and innermost pipeline_parallel (it runs the differentiated function
itself, micro-batch by micro-batch) with tensor_parallel inside it.
"""
from __future__ import annotations

from typing import Any

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.parallel import ParallelLayout
from dsfn.migrate.ds_config.pipeline import pipeline_split
from dsfn.migrate.ds_config.values import build
from dsfn.migrate.ds_config.zero import ZeroSettings


def assemble_stack(layout: ParallelLayout, accumulation: int, zero: ZeroSettings, remat: list, precision: list,
                   clip: float, checkpoint: list, model: Any) -> tuple:
    """The transforms, outermost first, from what each section built (`precision`: the
    mixed_precision and loss_scale transforms); a ConfigError when tp or pp needs the model."""
    from dsfn import transforms as T
    pp, tp = layout.pp, layout.tp
    stack: list = []
    if layout.sp > 1:
        stack.append(T.sequence_parallel())
    stack.append(build("zero_optimization", T.shard_zero, zero.stage, **zero.shard_kwargs))
    if tp > 1 and model is None:
        raise ConfigError("ds_config tensor_parallel.autotp_size > 1 needs the model: "
                          "from_ds_config(config, model=model)")
    if tp > 1 and pp == 1:
        stack.append(T.tensor_parallel("auto", model=model))
    if layout.ep > 1:       # inside ZeRO (it shards the expert pieces over dp)
        stack.append(T.expert_parallel("auto", model=model))
    stack += remat
    if accumulation > 1 and pp == 1:
        stack.append(T.accumulate(accumulation))
    stack += zero.offload + precision
    if clip > 0:
        stack.append(build("gradient_clipping", T.clip_grad_norm, float(clip)))
    stack += zero.zenflow + checkpoint
    if pp > 1:          # innermost: it runs the differentiated function itself, micro-batch by micro-batch
        if model is None:
            raise ConfigError("ds_config pipeline.stages > 1 needs the model (its layers are cut into stages): "
                              "from_ds_config(config, model=model)")
        split = pipeline_split(model, pp, layout.partition)
        stack.append(build("pipeline", T.pipeline_parallel, "1f1b", microbatches=accumulation, model=model,
                           split=split))
        if tp > 1:      # inside the pipeline: each stage's parameters split over its tp group
            stack.append(T.tensor_parallel("auto", model=model))
    return tuple(stack)
