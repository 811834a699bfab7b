"""dsfn.optim: functional optimizers (optax's protocol) matching torch.optim, and DeepSpeed's schedules.

    tx = dsfn.optim.chain(
        dsfn.optim.clip_by_global_norm(1.0),
        dsfn.optim.adamw(lr=dsfn.optim.WarmupLR(warmup_max_lr=3e-4, warmup_num_steps=100)))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)      # pure: inputs are not modified
    params = dsfn.optim.apply_updates(params, updates)

Modules: `base` (protocol, chain, identity, apply_updates), `transform` (primitives and
learning rates), `alias` (adamw, adam, sgd), `clip`, `masks` (masked, partition),
`schedules` (DeepSpeed's, with the count <-> last_batch_iteration mapping), `torch_optim`
(`from_torch(torch.optim.X, ...)`: any elementwise torch optimizer as a transformation).
"""
from dsfn.optim import schedules
from dsfn.optim.alias import adam, adamw, sgd
from dsfn.optim.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from dsfn.optim.clip import clip_by_global_norm, global_norm
from dsfn.optim.lamb import LambState, lamb, scale_by_lamb
from dsfn.optim.masks import MaskedState, PartitionState, by_name, by_ndim, masked, partition
from dsfn.optim.muon import (MuonState, MuonTransformation, gram_newton_schulz, muon, muon_matrix_update,
                             muon_split, newton_schulz, orthogonalize)
from dsfn.optim.torch_optim import FromTorchState, from_torch
from dsfn.optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, constant, linear
from dsfn.optim.transform import (AdamState, LearningRate, ScaleByAdamState, ScaleByLearningRateState,
                                  TraceState, adam_step, add_decayed_weights, current_lr, scale, scale_by_adam,
                                  scale_by_learning_rate, trace)

__all__ = [
    "AdamState", "EmptyState", "FromTorchState", "from_torch", "GradientTransformation", "LRRangeTest", "LearningRate", "MaskedState",
    "OneCycle", "PartitionState", "ScaleByAdamState", "ScaleByLearningRateState", "TraceState",
    "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "adam", "adam_step", "adamw", "add_decayed_weights",
    "apply_updates", "by_name", "by_ndim", "chain", "clip_by_global_norm", "constant", "current_lr",
    "global_norm", "identity", "linear", "masked", "partition", "scale", "scale_by_adam",
    "scale_by_learning_rate", "schedules", "sgd", "trace",
    "MuonState", "MuonTransformation", "gram_newton_schulz", "muon", "muon_matrix_update", "muon_split",
    "newton_schulz", "orthogonalize", "LambState", "lamb", "scale_by_lamb",
]
