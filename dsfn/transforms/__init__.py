"""Transforms: each module holds one; `compose` stacks them around a train step.

Canonical order, outermost first: compose(sequence_parallel(), shard_zero(s) | data_parallel(),
tensor_parallel(plan), expert_parallel(...), remat(...), accumulate(n),
offload(...), mixed_precision(...), loss_scale(), clip_grad_norm(c), zenflow(...)); async_checkpoint
may sit anywhere; pipeline_parallel(...) sits inside every transform that handles the
gradient (it runs the differentiated function itself, micro-batch by micro-batch).

This package exports the factories (and `compose`, `Step`, the `Transform` base for new
transforms), as optax's top level does. Mechanisms live where they belong: primitives
and `bind` in `dsfn.effects`, plan helpers beside their transform
(`dsfn.transforms.tensor_parallel.packed`), stack facts in `dsfn.transforms.facts`.
"""
from dsfn.transforms.accumulate import accumulate
from dsfn.transforms.async_checkpoint import async_checkpoint
from dsfn.transforms.clip import clip_grad_norm
from dsfn.transforms.compile_units import compile_units
from dsfn.transforms.compose import Step, compose
from dsfn.transforms.context_parallel import context_parallel
from dsfn.transforms.core import Transform
from dsfn.transforms.data_parallel import data_parallel
from dsfn.transforms.expert_parallel import expert_parallel
from dsfn.transforms.loss_scale import loss_scale
from dsfn.transforms.offload import offload
from dsfn.transforms.pipeline_parallel import pipeline_parallel
from dsfn.transforms.mixed_precision import mixed_precision
from dsfn.transforms.remat import remat
from dsfn.transforms.sequence_parallel import sequence_parallel
from dsfn.transforms.tensor_parallel import tensor_parallel
from dsfn.transforms.zenflow import zenflow
from dsfn.transforms.zero import shard_zero

__all__ = ["Step", "Transform", "accumulate", "async_checkpoint", "clip_grad_norm", "compile_units", "compose",
           "context_parallel",
           "data_parallel", "expert_parallel", "loss_scale", "mixed_precision", "offload", "pipeline_parallel", "remat",
           "sequence_parallel", "shard_zero", "tensor_parallel", "zenflow"]
