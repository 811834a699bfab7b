"""sequence_parallel (Ulysses): every stack equals the single-process reference.

Batches have variable lengths (some not divisible by sp: padded) and ignored labels
spread unevenly over the sequence (so sp slices hold different counts of valid tokens:
the loss must be the token-weighted mean over the group). With dp > 1 the ignored
labels are balanced across dp halves: data parallelism averages the halves' means
(DDP's and DeepSpeed's semantics), sequence parallelism must not.
Tolerance: fp32 rtol 1e-5 (attention over gathered heads is the same math; sums over
the sequence are split over ranks). Optimizer: SGD with momentum (see
test_tensor_parallel.py on Adam and last-bit differences).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.errors import ConfigError, MeshError, RankFailure, ShapeError, StackError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import run_steps, train_step_for
from dsfn.transforms import (
    accumulate,
    async_checkpoint,
    clip_grad_norm,
    compose,
    sequence_parallel,
    shard_zero,
    tensor_parallel,
)

pytest.importorskip("transformers")
VOCAB = 101


def make_gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=4, d_model=32))


MODELS = {"gpt": make_gpt, "llama": lambda: make_tiny_causal_lm("llama"),
          "qwen2": lambda: make_tiny_causal_lm("qwen2")}


def make_batches(lengths=(12, 9, 16), rows=4, seed=0) -> list[dict]:
    out = []
    for i, t in enumerate(lengths):
        b = token_batches(1, rows, t, VOCAB, seed=seed + i)[0]
        lab = b["labels"].clone()
        for r in range(0, rows, 2):     # the same pattern in each dp half
            lab[r, :min(5, t)] = -100
            lab[r + 1, -min(3, t):] = -100
        out.append({"input_ids": b["input_ids"], "labels": lab})
    return out


def loss_fn(apply_fn, params, batch):
    logits = apply_fn(params, batch["input_ids"])
    logits = getattr(logits, "logits", logits)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                             ignore_index=-100)


def _sgd():
    return dsfn.optim.sgd(lr=0.5, momentum=0.9)


def train(make_model, make_transforms, batches, mesh=None, loss=loss_fn):
    if mesh:
        init_mesh(**mesh)
    model = make_model()
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*make_transforms(model))(train_step_for(apply_fn, loss))
    state = step.place(dsfn.TrainState.create(params, _sgd()))
    return run_steps(step, state, batches)


def check(make_model, make_transforms, mesh, batches=None, loss=loss_fn, rtol=1e-5, atol=1e-6,
          make_ref_transforms=lambda m: ()):
    batches = batches or make_batches()
    ref_losses, ref_state = train(make_model, make_ref_transforms, batches, loss=loss)
    world = 1
    for v in mesh.values():
        world *= v
    for rank, (losses, state) in enumerate(run_on_ranks(train, world, make_model, make_transforms, batches, mesh,
                                                        loss, timeout=180)):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert_trees_close(state, ref_state, rtol=rtol, atol=atol, msg=f"rank {rank} state")


@pytest.mark.parametrize("family", ["gpt", "llama", "qwen2"])
@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_equals_reference(family, sp):
    check(MODELS[family], lambda m: (sequence_parallel(),), {"sp": sp})


@pytest.mark.parametrize("family", ["gpt", "llama", "qwen2"])
def test_ulysses_with_zero3_on_dp2_x_sp2_equals_reference(family):
    check(MODELS[family], lambda m: (sequence_parallel(), shard_zero(3)), {"dp": 2, "sp": 2})


def test_ulysses_sp4_with_zero3_on_8_ranks():
    check(MODELS["llama"], lambda m: (sequence_parallel(), shard_zero(3)), {"dp": 2, "sp": 4})


def test_heads_split_over_tp_and_sp_with_zero1():
    # 8 query / 4 kv heads: tp=2 leaves 4 / 2 per rank, sp=2 gives each rank 2 / 1 of those
    check(MODELS["llama"], lambda m: (sequence_parallel(), shard_zero(1), tensor_parallel("auto", model=m)),
          {"sp": 2, "tp": 2})


def test_with_accumulate_and_clipping():
    # the clip threshold is below the gradient norm: the clipped update needs the summed gradient
    check(MODELS["gpt"], lambda m: (sequence_parallel(), accumulate(2), clip_grad_norm(0.3)), {"sp": 2},
          make_ref_transforms=lambda m: (accumulate(2), clip_grad_norm(0.3)))


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(6, 20), min_size=1, max_size=3), sp=st.sampled_from([2, 4]),
       seed=st.integers(0, 50))
def test_property_any_lengths_and_ignored_labels(lengths, sp, seed):
    """Lengths padded so far that a rank holds only padding (weight 0) included (6 at sp=4)."""
    check(make_gpt, lambda m: (sequence_parallel(),), {"sp": sp}, batches=make_batches(lengths, seed=seed))


def _hf_shifted_loss(apply_fn, params, batch):
    """HF convention: labels are the input ids; the adapter made `shift_labels`."""
    logits = apply_fn(params, batch["input_ids"]).logits
    key = "shift_labels" if "shift_labels" in batch else None
    labels = batch[key] if key else torch.cat(
        [batch["labels"][:, 1:], batch["labels"].new_full((batch["labels"].shape[0], 1), -100)], dim=1)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def test_shift_labels_before_sharding_keeps_the_boundary_targets():
    batches = [{"input_ids": b["input_ids"], "labels": b["input_ids"].clone()} for b in make_batches((12, 10))]
    check(MODELS["llama"], lambda m: (sequence_parallel(shift_labels=True),), {"sp": 2}, batches=batches,
          loss=_hf_shifted_loss)


def test_all_to_all_traffic_matches_the_ulysses_count():
    """4 all-to-alls (q, k, v, out) per attention layer in forward, 4 in backward."""
    batch = make_batches((16,))[0]

    def fn():
        init_mesh(sp=2)
        model = make_gpt()
        apply_fn, params = dsfn.functionalize(model)
        step = compose(sequence_parallel())(train_step_for(apply_fn, loss_fn))
        state = step.init_state(params, _sgd())
        return step.explain(state, batch).collectives
    comm = run_on_ranks(fn, 2)[0]
    layers, b, t, d = 2, 4, 16, 32
    per = b * (t // 2) * d * 4              # one q/k/v/o activation of this rank's slice, bytes
    assert comm[("sp", "all_to_all")] == (8 * layers, 8 * layers * per)


def test_checkpoint_saved_at_sp2_loads_at_sp1(tmp_path):
    batches = make_batches()

    def fn(root):
        init_mesh(sp=2)
        model = make_gpt()
        apply_fn, params = dsfn.functionalize(model)
        ckpt = async_checkpoint(root, every=3)
        step = compose(sequence_parallel(), ckpt)(train_step_for(apply_fn, loss_fn))
        state = step.init_state(params, _sgd())
        for b in batches:
            state, _ = step(state, b)
        ckpt.wait()
        s = step.gather(state)
        return {"params": s.params, "opt_state": s.opt_state}
    final = run_on_ranks(fn, 2, str(tmp_path))[0]
    apply_fn, params = dsfn.functionalize(make_gpt())
    step = compose()(train_step_for(apply_fn, loss_fn))
    loaded = dsfn.checkpoint.load(tmp_path, like=step.init_state(params, _sgd()), restore_rng=False)
    assert_trees_close({"params": loaded.params, "opt_state": loaded.opt_state}, final, rtol=0, atol=0)


# -- errors ---------------------------------------------------------------------------------------------

def _run_one(kind):
    init_mesh(sp=4 if kind == "heads" else 2)
    model = (make_tiny_causal_lm("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
             if kind == "heads" else make_gpt())      # 6 query heads: sp=4 cannot split them
    apply_fn, params = dsfn.functionalize(model)
    sp = sequence_parallel(seq_length=12, seq_length_is_variable=False) if kind == "fixed" else sequence_parallel()
    step = compose(sp)(train_step_for(apply_fn, loss_fn))
    state = step.init_state(params, _sgd())
    batch = make_batches((12,))[0]
    if kind == "shape":
        batch["attention_mask"] = torch.ones(4, 11, dtype=torch.long)
    if kind == "fixed":
        batch = make_batches((10,))[0]
    if kind == "mask":
        batch["attention_mask"] = torch.ones(4, 12, dtype=torch.long)
        batch["attention_mask"][0, 0] = 0                 # left padding
    step(state, batch)


@pytest.mark.parametrize("kind,err,pattern", [
    ("shape", ShapeError, r"batch\['attention_mask'\] has shape \(4, 11\).*differs from batch\['input_ids'\]'s "
                          r"\(4, 12\)"),
    ("fixed", ShapeError, r"seq_length=12, seq_length_is_variable=False\): got a batch of length 10"),
    ("heads", MeshError, r"sp=4 does not divide the 6 query heads .*valid sp degrees are \[1, 2, 3, 6\]"),
    ("mask", ShapeError, "attention_mask has left padding or holes, and GPT is not a Hugging Face model"),
])
def test_bad_input_is_a_clear_error(kind, err, pattern):
    with pytest.raises(RankFailure, match=pattern) as info:
        run_on_ranks(_run_one, 4 if kind == "heads" else 2, kind)
    assert err.__name__ in str(info.value)


class _NoPositions(torch.nn.Module):
    """Embedding + causal sdpa + head; no positions at all (so require_position_ids=False is right)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, t, 16))


def test_a_model_without_position_ids_is_an_error_unless_declared_position_free():
    with pytest.raises(RankFailure, match="takes no position_ids"):
        run_on_ranks(train, 2, _NoPositions, lambda m: (sequence_parallel(),), make_batches(), {"sp": 2})
    check(_NoPositions, lambda m: (sequence_parallel(require_position_ids=False),), {"sp": 2})


def test_bad_configs_fail_at_compose():
    with pytest.raises(ConfigError, match="needs seq_length"):
        sequence_parallel(seq_length_is_variable=False)
    # issue 31: a length only a fixed-length config reads would be accepted and ignored
    with pytest.raises(ConfigError, match=r"seq_length=12\).*seq_length_is_variable=False\) to require it"):
        sequence_parallel(seq_length=12)
    assert sequence_parallel(seq_length=12, seq_length_is_variable=False).seq_length == 12
    with pytest.raises(StackError, match="sequence_parallel must be the outermost"):
        compose(shard_zero(1), sequence_parallel())


# -- AutoSP: the intercepted sdpa equals a model that calls Ulysses itself -----------------------------------

class _ManualAttention(torch.nn.Module):
    """The GPT's attention calling ulysses_sdpa explicitly (same parameters)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        from dsfn.transforms.sequence_parallel import ulysses_sdpa
        a = self.attn
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, a.head_dim).transpose(1, 2) for z in a.qkv(x).chunk(3, dim=-1))
        y = ulysses_sdpa(q, k, v, "sp").transpose(1, 2).reshape(b, t, -1)
        return a.resid_drop(a.proj(y))


def _manual_gpt():
    model = make_gpt()
    for block in model.blocks:
        block.attn.forward = _ManualAttention(block.attn).forward
    return model


def test_autosp_equals_manual_ulysses_and_reference():
    batches = make_batches()
    auto = run_on_ranks(train, 2, make_gpt, lambda m: (sequence_parallel(),), batches, {"sp": 2})[0]
    manual = run_on_ranks(train, 2, _manual_gpt, lambda m: (sequence_parallel(auto=False),), batches, {"sp": 2})[0]
    torch.testing.assert_close(torch.tensor(auto[0]), torch.tensor(manual[0]), rtol=1e-4, atol=1e-5)
    assert_trees_close(auto[1], manual[1], rtol=1e-4, atol=1e-5)
    check(make_gpt, lambda m: (sequence_parallel(),), {"sp": 2}, batches=batches)


def test_auto_false_with_a_hugging_face_model_is_a_config_error():
    """A Hugging Face model's attention is always Ulysses (dsfn_ulysses), so auto=False (leave the
    attention to the model's own ulysses_sdpa calls) would be accepted and ignored (issue 31):
    refused at the first forward, at any sp (here one process); a non-HF model takes it."""
    with pytest.raises(ConfigError, match=r"auto=False\): LlamaForCausalLM is a Hugging Face model.*drop auto=False"):
        train(MODELS["llama"], lambda m: (sequence_parallel(auto=False),), make_batches()[:1])
    train(_manual_gpt, lambda m: (sequence_parallel(auto=False),), make_batches()[:1])


def test_zero2_composes():
    check(MODELS["gpt"], lambda m: (sequence_parallel(), shard_zero(2)), {"dp": 2, "sp": 2})


def _hf_masked_loss(apply_fn, params, batch):
    out = apply_fn(params, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"])
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                             ignore_index=-100)


def test_batch_position_ids_and_right_padding_mask_are_honoured():
    """A HF batch with its own position_ids and a right-padding attention_mask (pads ignored
    in the labels): the valid tokens' loss equals the reference's, which masks the pads."""
    batches = []
    for b in make_batches((12, 11)):
        t = b["input_ids"].shape[1]
        mask = torch.ones(4, t, dtype=torch.long)
        mask[1, -4:] = 0
        mask[3, -2:] = 0
        labels = b["labels"].masked_fill(mask == 0, -100)
        pos = torch.arange(t).expand(4, t).contiguous()
        batches.append({"input_ids": b["input_ids"], "labels": labels, "attention_mask": mask, "position_ids": pos})
    check(MODELS["llama"], lambda m: (sequence_parallel(),), {"sp": 2}, batches=batches, loss=_hf_masked_loss)
