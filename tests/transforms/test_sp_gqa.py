"""sequence_parallel with grouped-query attention: key/value heads fewer than sp are replicated.

Ulysses gives each sp rank whole heads. With 8 query / 2 key-value heads at sp=4 (or 1 kv
head per tp rank at tp=2 x sp=2) the key/value heads are repeated by f = sp / gcd(kv, sp)
in `repeat_kv`'s order before the all-to-all (DeepSpeed's kv_replication_factor), so each
rank gets the key/value heads its query heads use; autograd through the repeat sums the
copies' gradients back into the one k/v projection. Each run equals the single-process
run (fp32, rtol 1e-5, SGD with momentum, 3 steps); the negative control replicates in the
wrong order (`repeat`: k0 k1 k0 k1) and differs.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsfn
from dsfn.errors import MeshError, RankFailure
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import run_steps, train_step_for
from dsfn.transforms import compose, sequence_parallel, shard_zero, tensor_parallel
from dsfn.transforms.sequence_parallel import kv_replication, replicate_kv

pytest.importorskip("transformers")
VOCAB = 101


def make_batches(lengths=(16, 13, 16), rows=2, hf=True) -> list[dict]:
    """`hf`: labels are the input ids (the model shifts them); else the next tokens (pre-shifted).
    -100 at different places per row, so the sp slices hold different numbers of targets."""
    out = []
    for i, t in enumerate(lengths):
        b = token_batches(1, rows, t, VOCAB, seed=i)[0]
        lab = (b["input_ids"] if hf else b["labels"]).clone()
        lab[0, :3] = -100
        lab[1, t // 2:t // 2 + 2] = -100
        out.append({"input_ids": b["input_ids"], "labels": lab})
    return out


def hf_loss(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


def ce_loss(apply_fn, params, batch):
    """For the non-HF models: cross-entropy over the pre-shifted next tokens."""
    logits = apply_fn(params, batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                             ignore_index=-100)


class GQAModel(torch.nn.Module):
    """Embedding + learned positions + one GQA attention (8 query / 2 key-value heads of 4,
    `F.scaled_dot_product_attention(..., enable_gqa=True)`, or `ulysses_sdpa` when `manual`)
    + MLP + head. x [B, T] -> logits [B, T, VOCAB]."""

    H, HKV, D = 8, 2, 4

    def __init__(self, manual: bool = False):
        super().__init__()
        torch.manual_seed(0)
        w = self.H * self.D
        self.manual = manual
        self.emb = torch.nn.Embedding(VOCAB, w)
        self.pos = torch.nn.Embedding(64, w)
        self.q = torch.nn.Linear(w, w)
        self.kv = torch.nn.Linear(w, 2 * self.HKV * self.D)
        self.o = torch.nn.Linear(w, w)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.GELU(), torch.nn.Linear(2 * w, w))
        self.head = torch.nn.Linear(w, VOCAB)

    def forward(self, input_ids, position_ids=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t)[None]
        x = self.emb(input_ids) + self.pos(position_ids)
        q = self.q(x).view(b, t, self.H, self.D).transpose(1, 2)
        k, v = (z.view(b, t, self.HKV, self.D).transpose(1, 2) for z in self.kv(x).chunk(2, dim=-1))
        if self.manual:
            from dsfn.transforms.sequence_parallel import ulysses_sdpa
            y = ulysses_sdpa(q, k, v, "sp", enable_gqa=True)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x + self.mlp(x))


MODELS = {
    "llama": lambda: make_tiny_causal_lm("llama", num_key_value_heads=2),
    "qwen2": lambda: make_tiny_causal_lm("qwen2", num_key_value_heads=2),
    "gemma2": lambda: make_tiny_causal_lm("gemma2", num_key_value_heads=2, sliding_window=5),
    "auto": lambda: GQAModel(),
    "manual": lambda: GQAModel(manual=True),
}


def train(family, stack, batches, mesh=None, wrong_order=False):
    if mesh:
        init_mesh(**mesh)
    if wrong_order:         # negative control: k0 k1 k0 k1 instead of k0 k0 k1 k1
        import sys
        module = sys.modules["dsfn.engines.ulysses"]
        module.replicate_kv = lambda x, f: x if f == 1 else x.repeat(1, f, 1, 1)
    model = MODELS[family]()
    apply_fn, params = dsfn.functionalize(model)
    transforms = {None: (), "sp": (sequence_parallel(auto=family != "manual"),),
                  "tp": (sequence_parallel(), tensor_parallel("auto", model=model)),
                  "zero3": (sequence_parallel(), shard_zero(3))}[stack]
    loss = ce_loss if family in ("auto", "manual") else hf_loss
    step = compose(*transforms)(train_step_for(apply_fn, loss))
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(lr=0.5, momentum=0.9)))
    return run_steps(step, state, batches)


def run(family, stack, mesh, wrong_order=False):
    world = 1
    for v in mesh.values():
        world *= v
    batches = make_batches(hf=family not in ("auto", "manual"))
    return run_on_ranks(train, world, family, stack, batches, mesh, wrong_order, timeout=180)


def reference(family):
    return train("auto" if family == "manual" else family, None, make_batches(hf=family not in ("auto", "manual")))


def assert_equal(results, ref):
    for rank, (losses, state) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert_trees_close(state, ref[1], rtol=1e-5, atol=1e-6, msg=f"rank {rank} state")


@pytest.mark.parametrize("family,mesh,stack", [
    ("llama", {"sp": 4}, "sp"),                  # 2 kv heads, sp 4: f = 2
    ("qwen2", {"sp": 4}, "sp"),                  # k/v biases: their gradients sum over the copies too
    ("gemma2", {"sp": 4}, "sp"),                 # eager (its own repeat_kv) with a sliding window
    ("llama", {"tp": 2, "sp": 2}, "tp"),         # 1 kv head per tp rank, sp 2: f = 2
    ("llama", {"dp": 2, "sp": 4}, "zero3"),      # 8 ranks: replicated kv under ZeRO-3
    ("auto", {"sp": 4}, "sp"),                   # AutoSP: sdpa(enable_gqa=True) intercepted
    ("manual", {"sp": 4}, "sp"),                 # ulysses_sdpa(..., enable_gqa=True) in the model
])
def test_replicated_kv_heads_equal_single_process(family, mesh, stack):
    assert_equal(run(family, stack, mesh), reference(family))


@pytest.mark.parametrize("family,mesh,stack", [("llama", {"sp": 4}, "sp"), ("gemma2", {"sp": 4}, "sp"),
                                               ("auto", {"sp": 4}, "sp")])
def test_negative_control_replicating_in_the_wrong_order_differs(family, mesh, stack):
    """(At tp=2 x sp=2 each rank holds one kv head: any order is the same there.)"""
    ref = reference(family)
    got = run(family, stack, mesh, wrong_order=True)
    assert max(float((a - ref[1]["params"][k]).abs().max()) for k, a in got[0][1]["params"].items()) > 1e-3


def test_replicated_kv_all_to_all_bytes():
    """k and v travel with Hkv * f heads: per attention layer and rank, forward q, k, v, out =
    (2 H + 2 Hkv f) * d * 4 bytes per local token, backward the same."""
    batch = make_batches((16,), hf=False)[0]

    def fn():
        init_mesh(sp=4)
        apply_fn, params = dsfn.functionalize(MODELS["auto"]())
        step = compose(sequence_parallel())(train_step_for(apply_fn, ce_loss))
        return step.explain(step.init_state(params, dsfn.optim.sgd(lr=0.1)), batch).collectives
    comm = run_on_ranks(fn, 4)[0]
    tokens = 2 * 16 // 4
    per_direction = tokens * GQAModel.D * 4 * (2 * GQAModel.H + 2 * GQAModel.HKV * 2)
    assert comm[("sp", "all_to_all")] == (8, 2 * per_direction)


# -- the replication itself ----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(kv=st.sampled_from([1, 2, 3, 4, 6, 8]), groups=st.sampled_from([1, 2, 3, 4, 8]),
       n=st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_property_each_rank_gets_the_kv_heads_its_query_heads_use(kv, groups, n):
    """For every valid (H, Hkv, sp): after the repeat, rank r's query heads [r H/n, (r+1) H/n)
    map (GQA grouping H/Hkv' inside the rank) to the key/value heads it holds, and those are
    the heads `repeat_kv` gives them in the single process."""
    heads = kv * groups
    if heads % n:
        with pytest.raises(MeshError, match=f"sp={n} does not divide the {heads} query heads"):
            kv_replication(heads, kv, n, "m")
        return
    f = kv_replication(heads, kv, n, "m")
    assert (kv * f) % n == 0 and heads % (kv * f) == 0
    k = torch.arange(kv, dtype=torch.float32).reshape(1, kv, 1, 1)
    rep = replicate_kv(k, f)
    full = k.repeat_interleave(groups, dim=1)          # HF repeat_kv: query head h -> kv head h // groups
    hq, hkv = heads // n, kv * f // n
    for r in range(n):
        local = rep[:, r * hkv:(r + 1) * hkv].repeat_interleave(hq // hkv, dim=1)   # what the rank's sdpa uses
        assert torch.equal(local, full[:, r * hq:(r + 1) * hq])


def test_replicated_gradients_sum_back():
    """The copies' gradients add up in the original head (autograd through repeat_interleave)."""
    k = torch.randn(2, 2, 3, 4, requires_grad=True)
    g = torch.randn(2, 4, 3, 4)
    replicate_kv(k, 2).backward(g)
    torch.testing.assert_close(k.grad, g[:, 0::2] + g[:, 1::2], rtol=0, atol=0)


# -- what still cannot work ----------------------------------------------------------------------------------

def test_kv_heads_that_do_not_divide_the_query_heads_are_refused():
    with pytest.raises(MeshError, match=r"^sequence_parallel: m has 4 query heads and 3 key/value heads \(on this "
                                        r"rank\); grouped-query attention needs the query heads to be a multiple "
                                        r"of the key/value heads"):
        kv_replication(4, 3, 2, "m")


def _run_bad_heads():
    init_mesh(sp=4)
    model = make_tiny_causal_lm("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    apply_fn, params = dsfn.functionalize(model)
    step = compose(sequence_parallel())(train_step_for(apply_fn, hf_loss))
    step(step.init_state(params, dsfn.optim.sgd(lr=0.1)), make_batches((16,))[0])


def test_query_heads_not_divisible_by_sp_are_refused():
    with pytest.raises(RankFailure, match=r"MeshError: sequence_parallel: sp=4 does not divide the 6 query heads of "
                                          r"LlamaAttention \(on this rank, after any tensor-parallel split\); Ulysses "
                                          r"gives each sp rank whole query heads: valid sp degrees are \[1, 2, 3, 6\]"):
        run_on_ranks(_run_bad_heads, 4)
