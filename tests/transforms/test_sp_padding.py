"""Padding masks under sequence parallel: a Hugging Face model given an attention_mask with
left padding (or holes) trains as the single-process HF run with that mask.

Inside Ulysses attention each rank holds the whole sequence for its heads; the transform
sees a 0 in the whole batch's attention_mask, the model's mask function hands on this rank's
slice, and dsfn all-gathers it and masks the pad keys (with the causal and window masks).
Rows: left padding of different lengths (one crossing the sp=2 boundary), a hole, none;
labels -100 at the pads. Equality: SGD-momentum, fp32 rtol 1e-5 (losses and state).
Negative control: the padding mask not applied (every rank's attention causal only) gives
a different run.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.transforms import compose, sequence_parallel, shard_zero

pytest.importorskip("transformers")

VOCAB, T, ROWS = 101, 16, 4


def make_batches(steps=3, seed=5):
    out = []
    for i in range(steps):
        ids = token_batches(1, ROWS, T, VOCAB, seed=seed + i)[0]["input_ids"]
        mask = torch.ones(ROWS, T, dtype=torch.long)
        mask[0, :3] = 0                          # left padding
        mask[1, :9] = 0                          # left padding past the sp=2 boundary (T/2 = 8)
        mask[2, 5:7] = 0                         # a hole
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def loss_fn(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"]).loss


def train(family, attn, make_transforms, mesh=None, sabotage=False, cfg=None, device="cpu", dtype=torch.float32):
    if mesh:
        init_mesh(**mesh)
    if sabotage:                                 # the padding mask never handed on
        from dsfn.integrations.hf import attention
        attention._no_mask = lambda *a, **k: None
        from transformers.masking_utils import AttentionMaskInterface
        AttentionMaskInterface._global_mapping[attention.NAME] = attention._no_mask
    model = make_tiny_causal_lm(family, attn_implementation=attn, **(cfg or {})).to(device, dtype)
    model.train()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p: loss_fn(apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads), {"loss": loss}
    step = compose(*make_transforms())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    losses = []
    for b in make_batches():
        state, m = step(state, {k: v.to(device) for k, v in b.items()})
        losses.append(float(m["loss"]))
    assert all(x == x for x in losses), losses   # no NaN from fully masked pad queries
    s = step.gather(state)
    return losses, {"params": s.params, "opt_state": s.opt_state}


CASES = [("llama", "sdpa", {"sp": 2}, False, None), ("llama", "eager", {"sp": 2}, False, None),
         ("gemma2", "eager", {"sp": 2}, False, {"sliding_window": 5}),      # window + padding
         ("llama", "sdpa", {"sp": 4}, False, None), ("qwen2", "sdpa", {"dp": 2, "sp": 2}, True, None)]


@pytest.mark.parametrize("family,attn,mesh,zero,cfg", CASES, ids=lambda v: str(v))
def test_padding_mask_under_sp_equals_single_process(family, attn, mesh, zero, cfg):
    ref_losses, ref_state = train(family, attn, lambda: (), cfg=cfg)
    world = 1
    for v in mesh.values():
        world *= v
    make = (lambda: (sequence_parallel(), shard_zero(3))) if zero else (lambda: (sequence_parallel(),))
    for losses, state in run_on_ranks(train, world, family, attn, make, mesh, False, cfg, timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_negative_control_without_the_padding_mask_the_run_differs():
    ref_losses, _ = train("llama", "sdpa", lambda: ())
    for losses, _ in run_on_ranks(train, 2, "llama", "sdpa", lambda: (sequence_parallel(),), {"sp": 2}, True,
                                  timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) > 1e-3, (losses, ref_losses)


def _flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    from transformers.utils import is_flash_attn_2_available
    return is_flash_attn_2_available()


@pytest.mark.skipif(not _flash_available(), reason="flash-attn is not installed (it needs CUDA): the flash path "
                    "(the 2-D padding mask, whole position_ids and cu_seq_lens passed through) runs only where it is")
def test_flash_attention_padding_under_sp_equals_single_process():
    """flash_attention_2 unpads by the gathered 2-D mask itself; bf16 on one GPU, 2 ranks over gloo."""
    kw = dict(device="cuda", dtype=torch.bfloat16)
    ref_losses, _ = train("llama", "flash_attention_2", lambda: (), **kw)
    for losses, _ in run_on_ranks(train, 2, "llama", "flash_attention_2", lambda: (sequence_parallel(),),
                                  {"sp": 2}, False, None, kw["device"], kw["dtype"], timeout=300):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=2e-2)


def _llama4_under_sp():
    import transformers
    init_mesh(sp=2)
    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        vocab_size=VOCAB, num_local_experts=2, attention_chunk_size=4,
                                        max_position_embeddings=64)
    torch.manual_seed(0)
    apply_fn, params = dsfn.functionalize(transformers.Llama4ForCausalLM(cfg))

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(lambda p: apply_fn(p, input_ids=batch["input_ids"],
                                                              labels=batch["input_ids"]).loss)(state.params)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(sequence_parallel())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.1))
    step(state, {"input_ids": token_batches(1, 2, T, VOCAB, seed=0)[0]["input_ids"]})


def test_chunked_attention_under_sp_is_refused():
    """Llama4's chunked attention (tokens attend within their chunk) is not built by Ulysses
    attention: refused by name, never a mask that attends across chunks."""
    from dsfn.errors import RankFailure
    with pytest.raises(RankFailure, match=r"ConfigError: sequence_parallel: Llama4ForCausalLM uses chunked attention "
                                          r"\(attention_chunk_size=4"):
        run_on_ranks(_llama4_under_sp, 2, timeout=120)
