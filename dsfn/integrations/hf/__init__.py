"""Hugging Face transformers integration: Ulysses attention for HF models, and the model's
own answers to the other transforms, reached through `HuggingFaceAdapter` (`dsfn.adapters`).

- `attention`: the "dsfn_ulysses" attention implementation (`ulysses_attention`, `NAME`),
  which `dsfn.transforms.sequence_parallel` enters around every forward;
- `losses`: the causal-LM loss as the whole batch's token mean under data parallel and
  accumulation (`token_mean_over`) and under sequence parallel (`own_loss`, `sequence_loss`);
- `router`: a mixture-of-experts router's balance loss over the whole batch
  (`global_router_balance`);
- `plan`: the model's tensor-parallel plan (`tensor_parallel_plan`, for `tensor_parallel("auto")`);
- `detect`: which modules are Hugging Face's (`is_hf_model`, `holds_hf_model`, `loss_modules`);
- `adapter`: `HuggingFaceAdapter`, registered on import.

The names are re-exported here; the adapter calls each through the module that defines it,
so a test replaces one there (`from dsfn.integrations.hf import losses; losses.own_loss = ...`).
"""
from dsfn.integrations.hf.adapter import HuggingFaceAdapter
from dsfn.integrations.hf.attention import NAME, ulysses_attention
from dsfn.integrations.hf.detect import holds_hf_model, is_hf_model, loss_modules
from dsfn.integrations.hf.losses import own_loss, sequence_loss, token_mean_over
from dsfn.integrations.hf.plan import tensor_parallel_plan
from dsfn.integrations.hf.router import global_router_balance

__all__ = ["NAME", "HuggingFaceAdapter", "global_router_balance", "holds_hf_model", "is_hf_model", "loss_modules",
           "own_loss", "sequence_loss", "tensor_parallel_plan", "token_mean_over", "ulysses_attention"]
