"""`HuggingFaceAdapter`: Hugging Face's answers to the transforms (`dsfn.adapters.ModelAdapter`),
registered when this module is imported (`dsfn.integrations` imports it).

Each answer calls the function of the module that holds it (`detect`, `losses`, `router`,
`attention`, `plan`) looked up when called, so a test can replace one on that module.
"""
from __future__ import annotations

from typing import Any

from dsfn.adapters import register_adapter
from dsfn.integrations.hf import attention, detect, losses, plan, ring, router


class HuggingFaceAdapter:
    """Hugging Face's answers to the transforms (`dsfn.adapters.ModelAdapter`): the
    functions of this package's modules, looked up when called (so a test can replace one)."""

    def holds(self, module: Any) -> bool:
        return detect.holds_hf_model(module)

    def token_mean_over(self, module, axes, args, kwargs):
        return losses.token_mean_over(module, axes, args, kwargs)

    def own_loss(self, module, split, args, kwargs):
        return losses.own_loss(module, split, args, kwargs)

    def global_router_balance(self, module, sum_axes, mean_axes, valid=None):
        return router.global_router_balance(module, sum_axes, mean_axes, valid)

    def sequence_attention(self, module, axis, consecutive=None, padded=False):
        return attention.ulysses_attention(module, axis, consecutive, padded)

    def ring_attention(self, module, axis, positions, consecutive=None, padded=False, record=None):
        return ring.ring_attention_context(module, axis, positions, consecutive, padded, record)

    def loss_modules(self, module):
        return detect.loss_modules(module)

    def tensor_parallel_plan(self, module):
        return plan.tensor_parallel_plan(module)

    def expert_parallel_plan(self, module):
        return plan.expert_parallel_plan(module)


register_adapter(HuggingFaceAdapter())
