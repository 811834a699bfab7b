"""Fused kernels, each with a plain-torch reference of the same signature; `dispatch`
picks the Triton kernel on CUDA and the reference elsewhere (see `dsfn.ops.dispatch`).

- `adamw_update`: one pass over (param, grad, exp_avg, exp_avg_sq), lr/step as tensors,
  optional low-precision (bf16/fp16) copy of the new param written in the same pass.
  `dsfn.optim.adamw` runs this kernel for fp32 params where dispatch picks Triton (CUDA by
  default) but never asks for the low-precision copy (it passes no `lowp_dtype`); that
  copy is for callers of `adamw_update` itself.
- `linear_cross_entropy`: cross-entropy fused with the LM head over vocabulary tiles;
  never materialises [tokens, vocab] logits, forward or backward.
- `rms_norm`: RMSNorm forward and backward.
- `sequence_tiled_compute` / `TiledMLP` / `tile_mlps` / `tiled_loss`: per-token functions
  (MLPs, LM head + loss) over sequence tiles, recomputed tile by tile in backward
  (DeepSpeed ALST's TiledMLP): peak activation is one tile's, not the whole sequence's.
"""
from dsfn.ops.adamw import (
           AdamWUpdate,
           adamw_update,
           adamw_update_torch,
           adamw_update_triton,
)
from dsfn.ops.cross_entropy import (
           linear_cross_entropy,
           linear_cross_entropy_torch,
           linear_cross_entropy_triton,
)
from dsfn.ops.rmsnorm import rms_norm, rms_norm_torch, rms_norm_triton
from dsfn.ops.tiled import (
           TiledMLP,
           sequence_tiled_compute,
           tile_mlps,
           tiled_loss,
           untile_mlps,
)

__all__ = ["AdamWUpdate", "adamw_update", "adamw_update_torch", "adamw_update_triton", "linear_cross_entropy",
           "linear_cross_entropy_torch", "linear_cross_entropy_triton", "rms_norm", "rms_norm_torch",
           "rms_norm_triton"]
__all__ += ["TiledMLP", "sequence_tiled_compute", "tile_mlps", "tiled_loss", "untile_mlps"]
