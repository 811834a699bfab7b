"""tensor_parallel with fewer key/value heads than tp: the ranks sharing a kv head hold replicas.

4 query / 1 kv heads at tp=2 (both ranks hold the one kv head), 8 / 2 (Llama) and 4 / 2
(Qwen2, with k/v biases and one query head per rank) at tp=4 (ranks {0, 1} hold kv head 0,
{2, 3} kv head 1), and tp=2 x sp=2 (Ulysses then repeats each tp rank's kv head for its sp
ranks; 8 / 2 at tp=2 x sp=2, where tp divides the kv heads, is in test_sp_gqa). k_proj / v_proj are `GroupDimShard` pieces; their replicas' gradients are summed
over the ranks sharing them. Each run equals the single process (fp32, rtol 1e-5, SGD with
momentum, 3 steps; AdamW on losses only, see test_tensor_parallel's docstring); the
gathered state holds one copy of each kv head. Negative controls: without the sum the
state differs; counting replicas in the gradient norm changes the clipped run; a checkpoint
holds one copy, and reloads at tp=1 / from tp=1.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import dsfn
from dsfn import checkpoint as ck
from dsfn.errors import MeshError, RankFailure
from dsfn.runtime import init_mesh
from dsfn.state.layout import GroupDimShard, MeshCoords, Nested, Placed, is_placed
from dsfn.transforms.tensor_parallel import packed
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import clip_grad_norm, compose, sequence_parallel, shard_zero, tensor_parallel

pytest.importorskip("transformers")
VOCAB = 101
BATCHES = token_batches(3, 4, 12, VOCAB, seed=1)

MODELS = {      # (family, query heads, kv heads)
    "1kv": ("llama", 4, 1),
    "2kv": ("llama", 8, 2),
    "qwen2": ("qwen2", 4, 2),
}


def make_model(name):
    family, heads, kv = MODELS[name]
    return make_tiny_causal_lm(family, vocab_size=VOCAB, num_attention_heads=heads, num_key_value_heads=kv)


def _sgd():
    return dsfn.optim.sgd(lr=0.5, momentum=0.9)


def _adamw():
    return dsfn.optim.adamw(lr=1e-2)


def train(name, stack, mesh=None, tx=_sgd, no_replica_sum=False, count_replicas=False, inspect=False):
    """(losses, grad norms, gathered logical state, and with `inspect` (this rank's tp coordinate,
    {k/v param path: (layout, this rank's piece)}))."""
    if mesh:
        init_mesh(**mesh)
    if no_replica_sum:        # negative control: each replica keeps its own query heads' part
        from dsfn.engines import tensor_parallel as engine
        engine.sum_replica_grads = lambda g, axis, groups: g
    if count_replicas:        # negative control: replicas counted in the norm as disjoint pieces
        GroupDimShard.duplicate = lambda self, mesh=None: False
    model = make_model(name)
    apply_fn, params = dsfn.functionalize(model)
    transforms = {None: (), "tp": (tensor_parallel("auto", model=model),),
                  "sp": (sequence_parallel(), tensor_parallel("auto", model=model)),
                  "zero3": (shard_zero(3), tensor_parallel("auto", model=model)),
                  "clip": (tensor_parallel("auto", model=model), clip_grad_norm(0.5)),
                  "ref_clip": (clip_grad_norm(0.5),)}[stack]
    step = compose(*transforms)(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, tx(), seed=0))
    losses, norms = [], []
    for b in BATCHES:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        norms.append(float(m.get("grad_norm", float("nan"))))
    pieces = None
    if inspect:
        from dsfn.runtime import current_mesh
        pieces = (current_mesh().local_rank("tp"),
                  {p: (x.layout, x.data) for p, x in dsfn.tree.leaves_with_path(state.params, is_leaf=is_placed)
                   if isinstance(x, Placed) and ("k_proj" in p or "v_proj" in p)})
    logical = step.gather(state)
    return losses, norms, {"params": logical.params, "opt_state": logical.opt_state}, pieces


def run(name, stack, mesh, **kw):
    world = 1
    for v in mesh.values():
        world *= v
    return run_on_ranks(train, world, name, stack, mesh, timeout=240, **kw)


def assert_equal(results, ref, state=True):
    for rank, (losses, norms, st, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        if any(n == n for n in ref[1]):
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref[1]), rtol=1e-5, atol=1e-6)
        if state:
            assert_trees_close(st, ref[2], rtol=1e-5, atol=1e-6, msg=f"rank {rank} state")


def _max_diff(a, b):
    return max(float((x - b["params"][k]).abs().max()) for k, x in a["params"].items())


@pytest.mark.parametrize("name,mesh,stack,groups", [
    ("1kv", {"tp": 2}, "tp", 1),                   # the one kv head on both ranks
    ("2kv", {"tp": 4}, "tp", 2),                   # kv head r // 2 on rank r
    ("qwen2", {"tp": 4}, "tp", 2),                 # k/v biases; 1 query head per rank
    ("1kv", {"tp": 2, "sp": 2}, "sp", 1),          # Ulysses repeats the tp rank's kv head over sp
])
def test_replicated_kv_heads_equal_single_process(name, mesh, stack, groups):
    results = run(name, stack, mesh, inspect=True)
    assert_equal(results, train(name, None))
    coords, pieces = zip(*(r[3] for r in results))
    assert sorted(pieces[0]) == sorted(f"model.layers.{i}.self_attn.{p}.{a}" for i in range(2)
                                       for p in ("k_proj", "v_proj")
                                       for a in (("weight", "bias") if name == "qwen2" else ("weight",)))
    assert {(type(x).__name__, x.groups) for x, _ in pieces[0].values()} == {("GroupDimShard", groups)}
    # the replicas stay bitwise equal after training; different kv heads differ
    tp = mesh["tp"]
    for path in pieces[0]:
        for r in range(1, len(results)):
            same = torch.equal(pieces[r][path][1], pieces[0][path][1])
            assert same == (coords[r] * groups // tp == coords[0] * groups // tp), (path, r)


def test_adamw_losses_equal_single_process():
    assert_equal(run("2kv", "tp", {"tp": 4}, tx=_adamw), train("2kv", None, tx=_adamw), state=False)


@pytest.mark.slow
def test_zero3_over_tp_equals_single_process():
    """ZeRO-3 over dp shards each tp replica: Nested(GroupDimShard, FlatShard)."""
    results = run("1kv", "zero3", {"dp": 2, "tp": 2}, inspect=True)
    assert_equal(results, train("1kv", None))
    assert all(isinstance(x, Nested) and isinstance(x.inner, GroupDimShard) for x, _ in results[0][3][1].values())


def test_negative_control_without_summing_the_replicas_gradients_differs():
    ref = train("1kv", None)
    got = run("1kv", "tp", {"tp": 2}, no_replica_sum=True)
    assert _max_diff(got[0][2], ref[2]) > 1e-3


def test_clipped_norm_counts_each_kv_head_once():
    """The norm is below the threshold's inverse: every step clips, so a norm counting the
    replicas twice (the control) would give other updates."""
    ref = train("1kv", "ref_clip")
    assert_equal(run("1kv", "clip", {"tp": 2}), ref)
    bad = run("1kv", "clip", {"tp": 2}, count_replicas=True)
    assert bad[0][1][0] > ref[1][0] * (1 + 1e-4)
    assert _max_diff(bad[0][2], ref[2]) > 1e-4


# -- checkpoints -----------------------------------------------------------------------------------

def _state(name, mesh=None, seed=0):
    if mesh:
        init_mesh(**mesh)
    model = make_model(name)
    apply_fn, params = dsfn.functionalize(model)
    transforms = (tensor_parallel("auto", model=model),) if mesh else ()
    step = compose(*transforms)(train_step_for(apply_fn, lm_loss))
    state = step.place(dsfn.TrainState.create(params, _sgd(), seed=0))
    for b in BATCHES[:seed]:
        state, _ = step(state, b)
    return step, state


def _save_tp(root, name, mesh):
    step, state = _state(name, mesh, seed=2)
    ck.save(root, state, step=2)
    ck.export_state(state, os.path.join(root, "export"))
    return _logical(step.gather(state))


def _load_tp(root, name, mesh):
    step, like = _state(name, mesh)
    return _logical(step.gather(ck.load(root, like, restore_rng=False)))


def _manifest(root):
    step_dir = open(os.path.join(root, "latest")).read().strip()
    return json.loads(open(os.path.join(root, step_dir, "manifest.json")).read())


def _logical(st):
    return {"params": st.params, "opt_state": st.opt_state}


def test_checkpoint_and_export_saved_at_tp4_load_at_tp1(tmp_path):
    saved = run_on_ranks(_save_tp, 4, str(tmp_path), "2kv", {"tp": 4})[0]
    k = _manifest(tmp_path)["leaves"]["params.model.layers.0.self_attn.k_proj.weight"]
    assert k["layout"]["type"] == "GroupDimShard" and k["shape"] == [16, 64]
    # one logical copy: the owners of kv heads 0 and 1 (ranks 0 and 2) wrote it, not their replicas
    assert sorted(s["file"] for s in k["slices"]) == ["rank_00000.safetensors", "rank_00002.safetensors"]
    from safetensors.torch import load_file
    exported = load_file(os.path.join(tmp_path, "export", "model.safetensors"))    # export_state: one copy too
    assert exported["model.layers.0.self_attn.k_proj.weight"].shape == (16, 64)
    assert_trees_close(exported, saved["params"], rtol=0, atol=0)
    _, ref_state = _state("2kv", seed=2)          # the single process's state after the same steps
    _, like = _state("2kv")
    loaded = ck.load(tmp_path, like, restore_rng=False)
    assert_trees_close(_logical(loaded), saved, rtol=0, atol=0)
    assert_trees_close(_logical(loaded), _logical(ref_state), rtol=1e-5, atol=1e-6)


def test_checkpoint_saved_at_tp1_loads_at_tp2(tmp_path):
    _, state = _state("1kv", seed=2)
    ck.save(tmp_path, state, step=2)
    for st in run_on_ranks(_load_tp, 2, str(tmp_path), "1kv", {"tp": 2}):
        assert_trees_close(st, _logical(state), rtol=0, atol=0)


# -- the layout ------------------------------------------------------------------------------------

def test_group_dim_shard_blocks_runs_and_duplicates():
    layout = GroupDimShard("tp", 0, (4, 3), 2)
    full = torch.arange(12.0).reshape(4, 3)
    for r, (block, dup) in enumerate([(0, False), (0, True), (1, False), (1, True)]):
        m = MeshCoords.of({"tp": 4}, {"tp": r})
        assert layout.block(m) == block and layout.duplicate(m) == dup
        assert torch.equal(layout.shard(full, m), full[2 * block:2 * block + 2])
        assert layout.runs(m) == [(6 * block, 6, 0)]
    assert Nested(layout, GroupDimShard("dp", 0, (2, 3), 1)).duplicate(MeshCoords.of({"tp": 4}, {"tp": 3}))
    from dsfn.checkpoint.format import layout_from_json, layout_to_json
    assert layout_from_json(json.loads(json.dumps(layout_to_json(layout)))) == layout


# -- what is still refused ---------------------------------------------------------------------------

def _bad(heads, kv):
    init_mesh(tp=2)
    model = make_tiny_causal_lm("llama", vocab_size=VOCAB, hidden_size=48, num_attention_heads=heads,
                                num_key_value_heads=kv)
    apply_fn, params = dsfn.functionalize(model)
    step = compose(tensor_parallel("auto", model=model))(train_step_for(apply_fn, lm_loss))
    step.place(dsfn.TrainState.create(params, _sgd()))


def test_kv_heads_neither_dividing_nor_divided_by_tp_are_refused():
    with pytest.raises(RankFailure, match=r"MeshError: tensor_parallel: tp=2 does not fit the attention heads of "
                                          r"'model.layers.0.self_attn' \(6 query heads, 3 key/value heads\).*"
                                          r"valid tp degrees are \[1, 3, 6\]"):
        run_on_ranks(_bad, 2, 6, 3)


class _Attention(torch.nn.Module):
    """4 query / 1 key-value heads of 2: a fused qkv, or separate q/k/v without `num_key_value_groups`."""
    num_heads, num_key_value_heads = 4, 1

    def __init__(self, fused):
        super().__init__()
        if fused:
            self.qkv = torch.nn.Linear(8, 12)
        else:
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, n) for n in (8, 2, 2))


@pytest.mark.parametrize("fused", [True, False])
def test_unsupported_attentions_with_fewer_kv_heads_than_tp_are_refused(fused):
    from dsfn.engines.tp_plan import check_heads as _check_heads
    root = torch.nn.Module()
    root.attn = _Attention(fused)
    styles = ({"attn.qkv": packed("colwise", (8, 2, 2))} if fused else
              {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise"})
    why = "its q/k/v projection is fused" if fused else "it has no integer `num_key_value_groups`"
    with pytest.raises(MeshError, match=r"^tensor_parallel: tp=2 is more than the 1 key/value heads of 'attn'.*"
                                        + why + r".*Use a tp degree dividing the key/value heads: \[1\]"):
        _check_heads(root, styles, 2)
    if not fused:
        root.attn.num_key_value_groups = 4
        shared = _check_heads(root, styles, 2)
        assert {k: (v.groups, v.q_per_rank) for k, v in shared.items()} == {"attn.k_proj": (1, 2),
                                                                           "attn.v_proj": (1, 2)}
