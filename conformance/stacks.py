"""The conformance matrix's stacks: `STACKS` (name -> `StackSpec`: the transforms for a model,
the mesh for a world size, the reference's transforms, the worlds it runs at, its tolerance).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

from torch import nn

from conformance.models import ModelSpec


@dataclasses.dataclass(frozen=True)
class StackSpec:
    make: Callable[[nn.Module, ModelSpec, str], list]      # (model, spec, tmpdir) -> transforms
    mesh: Callable[[int], dict] = lambda w: {"dp": w}
    reference: Callable[[], list] = lambda: []
    worlds: tuple[int, ...] = (1, 2, 4)
    rtol: float = 1e-5
    atol: float = 1e-6
    resume: bool = False            # checkpoint at step 2, resume a fresh state from it
    mixed: bool = False             # bf16 compute, fp32 master: compared by the update (see `compare`)
    clipped: bool = False           # a clip below the gradient norm normalises every update
    nodes: int | None = None        # the ranks spread over this many nodes (launcher topology; None: one)
    also_sampled: tuple[int, ...] = ()   # more worlds the default sample runs it at (one row each)
    models: tuple[str, ...] = ()    # models the default sample also runs it with (one row each, full world)
    update_rel: float | None = None  # quantized rows: each leaf within this fraction of the reference's
    #                                  change (L2, as mixed precision's MP_REL), losses at `rtol`
    min_ratio: float | None = None   # below compare.MIN_RATIO where a format's error is a large part of an
    #                                  update (int4 gradients): the row still sees a lost or 2x update
    skip_optimizers: tuple[str, ...] = ()   # not run with these (the matrix leaves them out; said why below)

    def ranks_per_node(self, world: int) -> int | None:
        return world // self.nodes if self.nodes and world > 1 else None

    def axes(self, world: int) -> dict[str, int]:
        """The mesh at `world` ranks ({} at world 1: no process group axes)."""
        return dict(self.mesh(world)) if world > 1 else {}

    def full_world(self) -> int:
        """The smallest world size of this stack at which every parallel axis is > 1."""
        return min(w for w in self.worlds if w > 1 and all(n > 1 for n in self.mesh(w).values()))


def _T():
    import dsfn.transforms as T
    return T


def _gpt_plan(model):
    from dsfn.models.gpt import tp_plan
    return tp_plan()


def _ep(model, spec):
    return _T().expert_parallel(spec.experts or "auto", model=model)


def _cp(model, spec):
    """Context parallel: a model's own loss (labels= its inputs) shifts over the whole sequence;
    the other losses' labels are each position's target already."""
    from conformance.models import _hf_labels_loss
    T = _T()
    if spec.loss is _hf_labels_loss:       # labels=batch["hf_labels"], else the input ids themselves
        return T.context_parallel(labels_key="hf_labels" if "hf_labels" in spec.batches()[0] else "input_ids")
    return T.context_parallel(shift_labels=False)


def _tp(model, spec):
    T = _T()
    if spec.tp == "gpt":
        return T.tensor_parallel(_gpt_plan(model), model=model)
    return T.tensor_parallel("auto", model=model)


MASKS = ("llama", "mistral", "llama+packed")      # causal, a sliding window, packed documents

STACKS: dict[str, StackSpec] = {
    "data_parallel": StackSpec(lambda m, s, d: [_T().data_parallel()]),
    "zero0": StackSpec(lambda m, s, d: [_T().shard_zero(0)]),
    "zero1": StackSpec(lambda m, s, d: [_T().shard_zero(1)]),
    "zero2": StackSpec(lambda m, s, d: [_T().shard_zero(2)]),
    "zero3": StackSpec(lambda m, s, d: [_T().shard_zero(3)]),
    "zero3+offload_cpu": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().offload("cpu")]),
    "zero2+offload_nvme": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().offload("nvme", path=d)]),
    "zero3+accumulate": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().accumulate(2)],
                                  reference=lambda: [_T().accumulate(2)]),
    "zero2+clip_grad_norm": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().clip_grad_norm(0.05)],
                                      reference=lambda: [_T().clip_grad_norm(0.05)], clipped=True),
    # the reference is the same precision and the same casts: bf16 compute and gradients, fp32
    # master weights, each rank's rows a bf16 micro-batch (see `_reference`). Worlds 1 and 2
    # only: the mean of 2 bf16 gradients is the reference's micro-batch sum to the bit (measured
    # on every LM but GPT, <= 3.3% of the update there), while 4 ranks' bf16 reduce-scatter sums
    # in another order than any single process, which measured 8-17% of the update on the
    # Adam / Muon rows: above the 1/10 of the update that `MP_REL` allows.
    "zero3+mixed_precision": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().mixed_precision()],
                                       reference=lambda: [_T().mixed_precision()], mixed=True, worlds=(1, 2)),
    "tp": StackSpec(lambda m, s, d: [_tp(m, s)], mesh=lambda w: {"tp": w}, worlds=(2, 4)),
    "zero1+tp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _tp(m, s)], mesh=lambda w: {"dp": w // 2, "tp": 2},
                          worlds=(2, 4)),
    "sp+zero3": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _T().shard_zero(3)],
                          mesh=lambda w: {"dp": w // 2, "sp": 2}, worlds=(2, 4)),
    "zero1+tp+offload_cpu": StackSpec(lambda m, s, d: [_T().shard_zero(1), _tp(m, s), _T().offload("cpu")],
                                      mesh=lambda w: {"dp": w // 2, "tp": 2}, worlds=(2, 4)),
    "zero3+remat": StackSpec(lambda m, s, d: [_T().shard_zero(3), _T().remat()]),
    "zero2+remat_offload": StackSpec(lambda m, s, d: [_T().shard_zero(2), _T().remat(offload="cpu")]),
    "zero2+async_checkpoint+resume": StackSpec(
        lambda m, s, d: [_T().shard_zero(2), _T().async_checkpoint(os.path.join(d, "ckpt"), every=2)], resume=True),
    # beyond one node: the ranks on 2 nodes (the launcher's topology); hybrid sharding shards
    # over a node's dp ranks and replicates across the nodes (world 4: 2 groups x 2; world 8:
    # 2 x 4, and with tp 2 inside each node 2 x 2); hpZ shards over all and re-gathers in a node
    "hsdp1": StackSpec(lambda m, s, d: [_T().shard_zero(1, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "hsdp2": StackSpec(lambda m, s, d: [_T().shard_zero(2, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "hsdp3": StackSpec(lambda m, s, d: [_T().shard_zero(3, shard_group="node")], worlds=(4, 8), nodes=2,
                       also_sampled=(8,)),
    "zero3+hpz": StackSpec(lambda m, s, d: [_T().shard_zero(3, hpz="node")], worlds=(4, 8), nodes=2,
                           also_sampled=(8,)),
    # pipeline parallel: each schedule at pp 2 (4 micro-batches of the 8 rows), and with ZeRO-1
    # over dp (2 micro-batches of each dp rank's 4 rows); interleaved and ZBV run 4 stages
    "pp_gpipe": StackSpec(lambda m, s, d: [_T().pipeline_parallel("gpipe", 4, model=m)], mesh=lambda w: {"pp": w},
                          worlds=(2,)),
    "pp_1f1b": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m)], mesh=lambda w: {"pp": w},
                         worlds=(2,)),
    "pp4_1f1b": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m)], mesh=lambda w: {"pp": w},
                          worlds=(4,)),
    "pp_interleaved": StackSpec(lambda m, s, d: [_T().pipeline_parallel("interleaved", 4, model=m)],
                                mesh=lambda w: {"pp": w}, worlds=(2,)),
    "pp_zbv": StackSpec(lambda m, s, d: [_T().pipeline_parallel("zbv", 4, model=m)], mesh=lambda w: {"pp": w},
                        worlds=(2,)),
    # activation checkpointing inside the stages (the hf_ckpt models, their own, run in every
    # pipelined row too): each micro-batch's layers recomputed in its backward
    "pp_1f1b+remat": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m), _T().remat()],
                               mesh=lambda w: {"pp": w}, worlds=(2,)),
    "zero1+pp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    # ZeRO-2/3 around the pipeline: a round of gradient buckets per micro-batch's backward;
    # small buckets, so a stage's gradients fill several and rounds matter
    "zero2+pp": StackSpec(lambda m, s, d: [_T().shard_zero(2, reduce_bucket_size=3000),
                                           _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    "zero3+pp": StackSpec(lambda m, s, d: [_T().shard_zero(3, reduce_bucket_size=3000),
                                           _T().pipeline_parallel("1f1b", 2, model=m)],
                          mesh=lambda w: {"dp": w // 2, "pp": 2}, worlds=(4,)),
    # tensor parallel inside each pipeline stage (Megatron's TP x PP, x DP with ZeRO-1): a stage's
    # parameters split over its tp group, nothing on the other stages; every axis 2
    "pp+tp": StackSpec(lambda m, s, d: [_T().pipeline_parallel("1f1b", 4, model=m), _tp(m, s)],
                       mesh=lambda w: {"pp": 2, "tp": w // 2}, worlds=(4,)),
    "zero1+pp+tp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _T().pipeline_parallel("1f1b", 2, model=m),
                                              _tp(m, s)],
                             mesh=lambda w: {"dp": w // 4, "pp": 2, "tp": 2}, worlds=(8,)),
    # sequence parallel (Ulysses) outside the pipeline: each sp rank's sequence slice crosses the
    # stage boundary to the same sp rank of the next stage
    "sp+pp": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _T().pipeline_parallel("1f1b", 2, model=m)],
                       mesh=lambda w: {"sp": 2, "pp": w // 2}, worlds=(4,)),
    # expert parallel: the experts over ep (its ranks also split the batch), the rest replicated;
    # with ZeRO-3 over dp the expert pieces are sharded over the ranks holding the same experts
    "ep": StackSpec(lambda m, s, d: [_ep(m, s)], mesh=lambda w: {"ep": w}, worlds=(2, 4)),
    "zero3+ep": StackSpec(lambda m, s, d: [_T().shard_zero(3), _ep(m, s)], mesh=lambda w: {"dp": w // 2, "ep": 2},
                          worlds=(4,)),
    # tensor parallel of the attention (and dense, shared-expert) layers inside expert parallel:
    # each tp group runs the same routed experts; zero1 over dp around both at world 8
    "ep+tp": StackSpec(lambda m, s, d: [_ep(m, s), _tp(m, s)], mesh=lambda w: {"ep": 2, "tp": w // 2}, worlds=(4,)),
    "zero1+ep+tp": StackSpec(lambda m, s, d: [_T().shard_zero(1), _ep(m, s), _tp(m, s)],
                             mesh=lambda w: {"dp": w // 4, "ep": 2, "tp": 2}, worlds=(8,)),
    # MoE layers inside pipeline stages: each stage's experts over its ep ranks (the pipeline
    # innermost: it runs the differentiated function), ZeRO-3 over dp around both at world 8
    "ep+pp": StackSpec(lambda m, s, d: [_ep(m, s), _T().pipeline_parallel("1f1b", 4, model=m)],
                       mesh=lambda w: {"pp": 2, "ep": w // 2}, worlds=(4,)),
    "zero3+ep+pp": StackSpec(lambda m, s, d: [_T().shard_zero(3, reduce_bucket_size=3000), _ep(m, s),
                                              _T().pipeline_parallel("1f1b", 2, model=m)],
                             mesh=lambda w: {"dp": w // 4, "pp": 2, "ep": 2}, worlds=(8,)),
    "sp+ep": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _ep(m, s)], mesh=lambda w: {"sp": 2, "ep": w // 2},
                       worlds=(4,)),
    "sp+zero3+ep": StackSpec(lambda m, s, d: [_T().sequence_parallel(), _T().shard_zero(3), _ep(m, s)],
                             mesh=lambda w: {"dp": w // 4, "sp": 2, "ep": 2}, worlds=(8,)),
    "zero3+ep+offload_cpu": StackSpec(lambda m, s, d: [_T().shard_zero(3), _ep(m, s), _T().offload("cpu")],
                                      mesh=lambda w: {"dp": w // 2, "ep": 2}, worlds=(4,)),
    "zero2+ep+offload_nvme": StackSpec(lambda m, s, d: [_T().shard_zero(2), _ep(m, s), _T().offload("nvme", path=d)],
                                       mesh=lambda w: {"dp": w // 2, "ep": 2}, worlds=(4,)),
    "zero2+ep+async_checkpoint+resume": StackSpec(
        lambda m, s, d: [_T().shard_zero(2), _ep(m, s), _T().async_checkpoint(os.path.join(d, "ckpt"), every=2)],
        mesh=lambda w: {"dp": w // 2, "ep": 2}, worlds=(4,), resume=True),
    # context parallel: ring attention over cp, the sequence in head and tail chunks
    # (each with a causal, a windowed and a packed-documents model too)
    "cp": StackSpec(lambda m, s, d: [_cp(m, s)], mesh=lambda w: {"cp": w}, worlds=(2, 4), models=MASKS),
    "cp+zero3": StackSpec(lambda m, s, d: [_cp(m, s), _T().shard_zero(3)], mesh=lambda w: {"dp": w // 2, "cp": 2},
                          worlds=(4,), models=MASKS),
    # 2-D (USP): Ulysses over sp inside each cp rank's chunks, the ring over cp across
    "cp+sp": StackSpec(lambda m, s, d: [_cp(m, s), _T().sequence_parallel()], mesh=lambda w: {"cp": 2, "sp": w // 2},
                       worlds=(4,), models=MASKS),
    # the ring inside each pipeline stage
    "cp+pp": StackSpec(lambda m, s, d: [_cp(m, s), _T().pipeline_parallel("1f1b", 2, model=m)],
                       mesh=lambda w: {"cp": 2, "pp": w // 2}, worlds=(4,), models=MASKS),
    # ZeRO++ quantized communication (small blocks, so the tiny models' tensors quantize),
    # compared as mixed precision is: each leaf of the final state within `update_rel` of what
    # the reference's 3 updates changed in it (L2), losses at `rtol`. The formats' error moves
    # the updates by (measured, worst leaf over gpt / llama / qwen2 and sgd / groups / adamw /
    # muon): int8 weight gathers (each weight within absmax / 254 of its block) 2-4% under
    # SGD, 13-15% under AdamW and Muon (scale-blind updates amplify gradient changes near 0);
    # int4 gradients (within absmax / 14 per quantization, two on an element's path) 7-14%
    # under SGD, 20-36% under AdamW. Tolerances sit ~1.3x above those; a lost update, a 2x
    # update, a scale not gathered or codes read without their scales move leaves by their
    # whole update. Muon with int4 gradients is left out: it orthogonalizes the update, so
    # the noise in the small singular directions is scaled up to the signal's size (measured
    # 0.6-0.97 of the update; use quantize_grads="int8" with Muon)
    "zero3+qwz": StackSpec(lambda m, s, d: [_T().shard_zero(3, quantize_weights="int8", quantize_block=64)],
                           worlds=(4,), rtol=5e-3, update_rel=0.2, min_ratio=4.5, models=("gpt", "llama")),
    "hsdp3+qwz+qgz": StackSpec(lambda m, s, d: [_T().shard_zero(3, shard_group="node", quantize_weights="int8",
                                                                quantize_block=64, quantize_grads="int4",
                                                                quantize_grads_block=32)],
                               worlds=(4,), nodes=2, rtol=2e-2, update_rel=0.45, min_ratio=2.0,
                               skip_optimizers=("muon",), models=("gpt", "llama")),
    "hsdp3+tp": StackSpec(lambda m, s, d: [_T().shard_zero(3, shard_group="node"), _tp(m, s)],
                          mesh=lambda w: {"dp": w // 2, "tp": 2}, worlds=(8,), nodes=2),
}
