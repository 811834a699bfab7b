"""context_parallel(): ring attention over cp, the sequence in head-tail chunks, equal to the
single process (SGD-momentum, 3 steps, losses and the final state at rtol 1e-5 / atol 1e-6:
the ring's softmax sums reassociate across blocks). The loss is the train step's own, from
the whole-sequence `shift_labels` the transform adds before cutting the sequence; the
single-process reference computes the same shifted labels itself.

Negative control: the head-tail layout undone on the labels only (the labels cut in
contiguous chunks while the tokens are head-tail) fails."""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.engines.sequence_shards import shift_left
from dsfn.errors import ConfigError, ShapeError
from dsfn.models.gpt import GPT, GPTConfig
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, uneven_label_batches
from dsfn.testing.reference import run_steps, train_step_for
from dsfn.transforms import compose, context_parallel, sequence_parallel, shard_zero

VOCAB = 61
TOL = dict(rtol=1e-5, atol=1e-6)


def make_gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=32, n_layer=2, n_head=4, d_model=32))


def make_batches(lengths=(16, 13, 24), rows=4, seed=0):
    return uneven_label_batches(lengths, rows, VOCAB, seed)


def shifted_loss(apply_fn, params, batch):
    labels = batch["shift_labels"] if "shift_labels" in batch else shift_left(batch["labels"], -100)
    logits = apply_fn(params, batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def train(outer=(), mesh=None, cp=True, bug=None):
    if mesh:
        init_mesh(**mesh)
    if bug == "labels_contiguous":        # the labels cut in contiguous chunks, the tokens head-tail
        from dsfn.transforms.context_parallel import ContextParallel
        orig = ContextParallel._take

        def take(self, batch, t, n, r, device):
            out = orig(self, batch, t, n, r, device)
            c = t // n
            out["shift_labels"] = batch["shift_labels"][:, r * c:(r + 1) * c].contiguous()
            return out
        ContextParallel._take = take
    model = make_gpt()
    apply_fn, params = dsfn.functionalize(model)
    ts = (context_parallel(), *outer) if cp else ()
    step = compose(*ts)(train_step_for(apply_fn, shifted_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, make_batches())


def _close(got, ref):
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), **TOL)
    assert_trees_close(got[1], ref[1], **TOL)


@pytest.mark.parametrize("world,mesh,outer", [(2, {"cp": 2}, ()), (4, {"cp": 4}, ()),
                                              (4, {"dp": 2, "cp": 2}, ("zero3",)),
                                              (4, {"dp": 2, "cp": 2}, ("zero1",))])
def test_ring_attention_training_equals_the_single_process(world, mesh, outer):
    ref = train(cp=False)
    zero = tuple(shard_zero(int(o[-1])) for o in outer)
    for got in run_on_ranks(train, world, zero, mesh, timeout=300):
        _close(got, ref)


def test_negative_control_labels_in_contiguous_chunks_differ():
    ref = train(cp=False)
    got = run_on_ranks(train, 2, (), {"cp": 2}, True, "labels_contiguous", timeout=300)
    assert any(not torch.allclose(torch.tensor(g[0]), torch.tensor(ref[0]), **TOL) for g in got)


# -- Hugging Face models: "dsfn_ring" attention, the model's own loss over the whole sequence ------

def hf_batches(kind, rows=4, seq=16):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 101, (rows, seq), generator=g)
        b = {"input_ids": ids, "labels": ids.masked_fill(ids % 5 == 0, -100)}
        if kind == "packed":           # documents restart their positions, boundaries differing by row
            pid = torch.cat([torch.arange(6), torch.arange(seq - 6)])[None].repeat(rows, 1)
            pid[1] = torch.cat([torch.arange(9), torch.arange(seq - 9)])
            b["position_ids"] = pid
        if kind == "padded":           # left padding on row 1, right padding on row 2
            mask = torch.ones(rows, seq, dtype=torch.long)
            mask[1, :3] = 0
            mask[2, -4:] = 0
            b["attention_mask"] = mask
            b["labels"] = b["labels"].masked_fill(mask == 0, -100)
        out.append(b)
    return out


def hf_loss(apply_fn, params, batch):
    extra = {k: batch[k] for k in ("position_ids", "attention_mask") if k in batch}
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False, **extra).loss


# Gemma2 with a cap and a window that bite at these sizes (the defaults, 50 and 4096, do not)
FAMILY_CONFIG = {"gemma2": dict(attn_logit_softcapping=0.5, sliding_window=6)}


def train_hf(family, kind, mesh=None, cp=True, outer=()):
    if mesh:
        init_mesh(**mesh)
    family, _, impl = family.partition(":")          # "llama:eager": the model loaded with that attention
    model = make_tiny_causal_lm(family, **({"attn_implementation": impl} if impl else {}), **FAMILY_CONFIG.get(family, {}))
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*((context_parallel(), *outer) if cp else ()))(train_step_for(apply_fn, hf_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, hf_batches(kind))


@pytest.mark.parametrize("family,kind,world,mesh", [
    ("llama", "plain", 2, {"cp": 2}), ("llama", "plain", 4, {"cp": 4}),
    ("qwen2", "plain", 2, {"cp": 2}),            # GQA: 8 query / 4 kv heads, biases
    ("mistral", "plain", 4, {"cp": 4}),          # a sliding window of 5 (sdpa)
    ("llama", "packed", 2, {"cp": 2}), ("llama", "padded", 2, {"cp": 2}),
    ("llama:eager", "packed", 2, {"cp": 2}),     # eager attention: the ring replaces it alike
    ("qwen3", "plain", 2, {"cp": 2}),            # per-head q / k norms
    ("gemma2", "plain", 2, {"cp": 2}),           # logit soft-capping, a window on alternate layers
])
def test_hf_models_train_equal_to_the_single_process(family, kind, world, mesh):
    pytest.importorskip("transformers")
    ref = train_hf(family, kind, cp=False)
    for got in run_on_ranks(train_hf, world, family, kind, mesh, timeout=300):
        _close(got, ref)


def test_hf_model_with_zero3_on_dp2_x_cp2_equals_the_single_process():
    pytest.importorskip("transformers")
    ref = train_hf("llama", "plain", cp=False)
    for got in run_on_ranks(train_hf, 4, "llama", "plain", {"dp": 2, "cp": 2}, True, (shard_zero(3),), timeout=300):
        _close(got, ref)


def test_it_must_be_outermost_with_ulysses_right_inside():
    from dsfn.errors import StackError
    apply_fn, _ = dsfn.functionalize(make_gpt())
    f = train_step_for(apply_fn, shifted_loss)
    with pytest.raises(StackError, match="context_parallel must be the outermost"):
        compose(shard_zero(1), context_parallel())(f)
    with pytest.raises(StackError, match=r"context_parallel must be the outermost.*sequence_parallel is outside"):
        compose(sequence_parallel(), context_parallel())(f)
    with pytest.raises(StackError, match=r"right inside an outermost context_parallel.*shard_zero is outside.*"
                                         r"compose\(context_parallel\(\), sequence_parallel\(\), shard_zero"):
        compose(context_parallel(), shard_zero(3), sequence_parallel())(f)
    compose(context_parallel(), sequence_parallel(), shard_zero(3))(f)        # 2-D: accepted


# -- 2-D: Ulysses (sp) inside, the ring (cp) outside ---------------------------------------------------

def train_2d(mesh=None, two=True, outer=()):
    if mesh:
        init_mesh(**mesh)
    apply_fn, params = dsfn.functionalize(make_gpt())
    ts = (context_parallel(), sequence_parallel(), *outer) if two else ()
    step = compose(*ts)(train_step_for(apply_fn, shifted_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, make_batches())


def train_hf_2d(family, kind, mesh=None, two=True):
    if mesh:
        init_mesh(**mesh)
    apply_fn, params = dsfn.functionalize(make_tiny_causal_lm(family, **FAMILY_CONFIG.get(family, {})))
    step = compose(*((context_parallel(), sequence_parallel()) if two else ()))(train_step_for(apply_fn, hf_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, hf_batches(kind))


def test_2d_cp2_x_sp2_equals_the_single_process():
    """Lengths 16, 13 (padded to 2 x cp x sp = 8's multiple), 24; labels uneven over the chunks."""
    ref = train_2d(two=False)
    for got in run_on_ranks(train_2d, 4, {"cp": 2, "sp": 2}, timeout=300):
        _close(got, ref)


@pytest.mark.parametrize("family,kind", [("llama", "plain"), ("llama", "packed"), ("llama", "padded"),
                                         ("mistral", "plain"), ("qwen2", "plain"), ("gemma2", "plain")])
def test_2d_hf_models_equal_the_single_process(family, kind):
    """The model's own loss over the whole sequence; Ulysses' all-to-all hands the ring the
    cp-local sequence (window, documents, padding applied by the ring)."""
    pytest.importorskip("transformers")
    ref = train_hf_2d(family, kind, two=False)
    for got in run_on_ranks(train_hf_2d, 4, family, kind, {"cp": 2, "sp": 2}, timeout=300):
        _close(got, ref)


# -- the training transforms inside context parallel -------------------------------------------------

def _inner(name):
    from dsfn.transforms import accumulate, clip_grad_norm, mixed_precision, remat
    return {"accumulate": (accumulate(2),), "clip": (clip_grad_norm(0.3),), "remat": (remat(),),
            "bf16": (mixed_precision(torch.bfloat16),)}[name]


def train_inner(name, mesh=None, cp=True):
    if mesh:
        init_mesh(**mesh)
    model = make_gpt()
    apply_fn, params = dsfn.functionalize(model)
    ts = ((context_parallel(), *_inner(name)) if cp else _inner(name))
    step = compose(*ts)(train_step_for(apply_fn, shifted_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, make_batches())


# bf16: the reference runs the same mixed precision; the ring's blockwise softmax (fp32 inside)
# and the whole-sequence one differ by bf16 rounding of the attention inputs and outputs
INNER_TOL = {"bf16": dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("name", ["accumulate", "clip", "remat", "bf16"])
def test_training_transforms_inside_equal_the_single_process(name):
    ref = train_inner(name, cp=False)
    tol = INNER_TOL.get(name, TOL)
    for got in run_on_ranks(train_inner, 2, name, {"cp": 2}, timeout=300):
        torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), **tol)
        assert_trees_close(got[1], ref[1], **tol)


# -- explain: which axis crosses nodes, the K/V bytes on the wire ---------------------------------------

def explain_2d(mesh, two):
    from dsfn.runtime import collectives as C
    init_mesh(**mesh)
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)
    ts = (context_parallel(), sequence_parallel()) if two else (context_parallel(),)
    step = compose(*ts)(train_step_for(apply_fn, hf_loss))
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    batch = hf_batches("packed")[0]
    text = str(step.explain(state, batch))
    C.counters.reset()
    step(state, batch)
    cfg = model.config
    return text, C.counters.bytes("cp", "send"), cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, \
        cfg.num_hidden_layers


@pytest.mark.parametrize("order,cp_crosses", [(("cp", "sp"), True), (("sp", "cp"), False)])
def test_explain_says_which_axis_crosses_nodes_and_the_wire_bytes_equal_the_closed_form(order, cp_crosses):
    """4 ranks on 2 nodes of 2: the mesh's outer axis crosses nodes. The ring's bytes sent per
    step (the runtime's counters) equal explain's and the closed form: per layer a block of
    K, V [B, Hkv/sp, S/cp, D] fp32 + positions + documents (int64) makes 2(cp - 1) shifts, and
    its dK / dV (fp32) cp."""
    pytest.importorskip("transformers")
    mesh = {a: 2 for a in order}
    for text, sent, hkv, d, layers in run_on_ranks(explain_2d, 4, mesh, True, ranks_per_node=2, timeout=300):
        cp_says, sp_says = ("crosses nodes", "within a node") if cp_crosses else ("within a node", "crosses nodes")
        assert f"context_parallel over 'cp' (size 2, {cp_says})" in text
        assert f"2-D: sequence_parallel over 'sp' (size 2, {sp_says}) inside" in text
        rows, t, n = 4, 16 // 2, 2
        block = 2 * rows * (hkv // 2) * t * d * 4 + 8 * t + 8 * rows * t
        grads = 2 * rows * (hkv // 2) * t * d * 4
        closed = layers * (2 * (n - 1) * block + n * grads)
        assert sent == closed
        assert f"{closed:,} B this step" in text


# -- bad input: named errors ----------------------------------------------------------------------------

class ManualAttention(torch.nn.Module):
    """Attention written out (softmax of q k^T): no sdpa call for the ring to run."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids, position_ids=None):
        x = self.emb(ids)
        q, k, v = self.qkv(x).chunk(3, -1)
        t = ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = (q @ k.transpose(-1, -2) / 4).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.head(att @ v)


def bad_input(kind, axis="cp"):
    init_mesh(**{axis: 2})
    model = ManualAttention() if kind == "manual" else make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)
    loss = shifted_loss if kind == "manual" else hf_loss
    split = context_parallel() if axis == "cp" else sequence_parallel(shift_labels=True)
    step = compose(split)(train_step_for(apply_fn, loss))
    state = step.init_state(params, dsfn.optim.sgd(0.1))
    batch = make_batches()[0] if kind == "manual" else hf_batches("plain")[0]
    if kind == "mask3d":
        batch["attention_mask"] = torch.ones(4, 16, 16, dtype=torch.long).tril()
    if kind == "short_labels":
        batch["labels"] = batch["labels"][:, :-1]
    if kind == "position_ids":
        batch["position_ids"] = torch.arange(15)[None].repeat(4, 1)
    try:
        step(state, batch)
    except (ConfigError, ShapeError) as e:
        return type(e).__name__, str(e)
    return None, ""


@pytest.mark.parametrize("kind,error,match", [
    ("manual", "ConfigError", r"made no causal scaled_dot_product_attention call.*only this rank's tokens"),
    ("mask3d", "ShapeError", r"attention_mask has shape \(4, 16, 16\).*2-D padding mask"),
    ("short_labels", "ShapeError", r"batch\['labels'\] has shape \(4, 15\).*same length"),
    ("position_ids", "ShapeError", r"batch\['position_ids'\] has shape \(4, 15\).*same length"),
])
def test_bad_input_is_a_named_error(kind, error, match):
    """A model whose attention dsfn cannot find (it would attend within the rank's chunks
    only), a mask the ring cannot honour, labels / position ids of another length."""
    import re
    if kind != "manual":
        pytest.importorskip("transformers")
    for name, text in run_on_ranks(bad_input, 2, kind, timeout=120):
        assert name == error and re.search(match, text), (name, text)


def test_ulysses_refuses_a_model_without_sdpa_alike():
    """The same check guards sequence_parallel's AutoSP (its attention would be the slice's)."""
    for name, text in run_on_ranks(bad_input, 2, "manual", "sp", timeout=120):
        assert name == "ConfigError" and "sequence_parallel: ManualAttention's forward made no causal" in text, text
        assert "ulysses_sdpa yourself with sequence_parallel(auto=False)" in text
