"""sequence_parallel with a Hugging Face causal LM's OWN loss (`model(..., labels=).loss`).

HF shifts the labels inside the model (or takes `shift_labels=`) and means over the valid
targets it sees. Under sp each rank sees a slice, so the transform must (a) shift over the
whole sequence, so the target of every slice's last token is the next slice's first
label, and (b) normalise by the valid targets of the whole batch (sp x dp), so the step's
gradient is the single-process gradient. Each test equals the single-process HF run of the
same train step (fp32, rtol 1e-5, SGD with momentum, 3 steps); the negative controls show
the same runs differ when the transform's label handling is switched off.

Batches: 4 rows, lengths 16 / 13 (padded at sp 2 and 4) / 16, -100 at different places in
every row and different counts in the two dp halves (rows 0-1 vs 2-3), so the ranks of an
sp group and the dp halves hold different numbers of valid targets.
"""
from __future__ import annotations

import pytest
import torch

import dsfn
from dsfn.errors import RankFailure
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import hf_labels_loss as loss_labels  # the new user's step: the model shifts
from dsfn.testing.reference import hf_shift_labels_loss as loss_shift_labels   # DeepSpeed ALST's way
from dsfn.testing.reference import run_steps, train_step_for
from dsfn.transforms import compose, sequence_parallel, shard_zero

pytest.importorskip("transformers")
VOCAB = 101
ROWS = 4


def make_batches(lengths=(16, 13, 16), seed=0) -> list[dict]:
    out = []
    for i, t in enumerate(lengths):
        ids = token_batches(1, ROWS, t, VOCAB, seed=seed + i)[0]["input_ids"]
        lab = ids.clone()
        lab[0, :3] = -100                   # a prompt
        lab[1, t // 2 - 1:t // 2 + 2] = -100  # around the sp=2 boundary
        lab[2, -4:] = -100                  # a tail
        lab[3, 1::3] = -100                 # scattered
        out.append({"input_ids": ids, "labels": lab})
    return out






def loss_ids_as_labels(apply_fn, params, batch):
    """labels are the input ids themselves (no labels in the batch at all)."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def loss_num_items(apply_fn, params, batch):
    """The caller's count (e.g. over accumulated micro-batches): the loss is sum / 40."""
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"],
                    num_items_in_batch=torch.tensor(40.0)).loss


LOSSES = {"labels": loss_labels, "shift_labels": loss_shift_labels, "ids": loss_ids_as_labels,
          "num_items": loss_num_items}


def _sgd():
    return dsfn.optim.sgd(lr=0.5, momentum=0.9)


def _ref_batch(b: dict) -> dict:
    """The single-process batch for `loss_shift_labels`: shift_labels made the same way."""
    lab = b["labels"]
    return {**b, "shift_labels": torch.cat([lab[:, 1:], lab.new_full((lab.shape[0], 1), -100)], dim=1)}


def train(family, make_transforms, batches, mesh=None, loss="labels", sabotage=False):
    if mesh:
        init_mesh(**mesh)
    if sabotage:        # the transform's label handling switched off: HF's loss as is
        from dsfn.integrations.hf import losses
        import contextlib
        losses.own_loss = lambda *a, **k: contextlib.nullcontext()
    if sabotage == "and strided slices":      # ... and the slices left as column views (not contiguous)
        from dsfn.transforms.sequence_parallel import SequenceParallel
        shard = SequenceParallel.shard_batch

        def strided(self, batch):
            return {k: (x.t().contiguous().t() if isinstance(x, torch.Tensor) and x.dim() == 2 else x)
                    for k, x in shard(self, batch).items()}
        SequenceParallel.shard_batch = strided
    model = make_tiny_causal_lm(family)
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*make_transforms())(train_step_for(apply_fn, LOSSES[loss]))
    state = step.place(dsfn.TrainState.create(params, _sgd()))
    return run_steps(step, state, batches)


def run(family, loss, mesh, zero=False, sabotage=False, batches=None):
    batches = batches or make_batches()
    world = 1
    for v in mesh.values():
        world *= v

    def transforms():
        sp = sequence_parallel(shift_labels=(loss == "shift_labels"))
        return (sp, shard_zero(3)) if zero else (sp,)
    return run_on_ranks(train, world, family, transforms, batches, mesh, loss, sabotage, timeout=180)


def reference(family, loss, batches=None):
    batches = batches or make_batches()
    if loss == "shift_labels":
        batches = [_ref_batch(b) for b in batches]
    return train(family, lambda: (), batches, loss=loss)


def assert_equal_to_reference(results, ref):
    ref_losses, ref_state = ref
    for rank, (losses, state) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert_trees_close(state, ref_state, rtol=1e-5, atol=1e-6, msg=f"rank {rank} state")


def max_param_diff(results, ref):
    return max(float((a - ref[1]["params"][k]).abs().max()) for k, a in results[0][1]["params"].items())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("loss", ["labels", "shift_labels"])
@pytest.mark.parametrize("sp", [2, 4])
def test_hf_own_loss_equals_single_process(family, loss, sp):
    assert_equal_to_reference(run(family, loss, {"sp": sp}), reference(family, loss))


@pytest.mark.parametrize("loss", ["labels", "shift_labels"])
def test_hf_own_loss_dp2_x_sp2_zero3_equals_single_process(loss):
    """dp halves hold different numbers of valid targets: the global token mean, as single-process."""
    assert_equal_to_reference(run("llama", loss, {"dp": 2, "sp": 2}, zero=True), reference("llama", loss))


@pytest.mark.parametrize("mesh,zero", [({"sp": 2}, False), ({"dp": 2, "sp": 2}, True)])
def test_callers_num_items_in_batch_is_kept(mesh, zero):
    assert_equal_to_reference(run("llama", "num_items", mesh, zero=zero), reference("llama", "num_items"))


def test_input_ids_as_labels_without_labels_in_the_batch():
    batches = [{"input_ids": b["input_ids"]} for b in make_batches()]
    assert_equal_to_reference(run("qwen2", "ids", {"sp": 2}, batches=batches), reference("qwen2", "ids", batches))


@pytest.mark.parametrize("mesh,zero", [({"sp": 2}, False), ({"dp": 2, "sp": 2}, True)])
def test_negative_control_without_the_label_handling_differs(mesh, zero):
    """`labels=`: HF shifts inside each slice (boundary targets lost, per-rank means)."""
    ref = reference("llama", "labels")
    got = run("llama", "labels", mesh, zero=zero, sabotage=True)
    assert max_param_diff(got, ref) > 1e-3


def test_negative_control_shift_labels_without_the_handling_differs_over_dp():
    """`labels=` + `shift_labels=` without the transform: at sp alone the batch's shift_labels
    weight HF's per-rank means right, but dp halves with different valid counts are averaged
    as means, not as the global token mean."""
    ref = reference("llama", "shift_labels")
    assert max_param_diff(run("llama", "shift_labels", {"sp": 2}, sabotage=True), ref) < 1e-5
    assert max_param_diff(run("llama", "shift_labels", {"dp": 2, "sp": 2}, zero=True, sabotage=True), ref) > 1e-3


def test_negative_control_strided_slices_break_hf_loss():
    """The issue's RuntimeError: HF .view()s shift_labels, a column slice of a batch > 1 row."""
    with pytest.raises(RankFailure, match="view size is not compatible"):
        run("llama", "shift_labels", {"sp": 2}, sabotage="and strided slices")


def _shift_in_slice(apply_fn, params, batch):
    lab = batch["labels"]
    shifted = torch.cat([lab[:, 1:], lab.new_full((lab.shape[0], 1), -100)], dim=1)
    return apply_fn(params, input_ids=batch["input_ids"], labels=lab, shift_labels=shifted).loss


def _cut_logits(apply_fn, params, batch):
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"][:, :-1],
                    logits_to_keep=batch["input_ids"].shape[1] - 1).loss


def _custom_loss_function(apply_fn, params, batch):
    apply_fn.module.loss_function = lambda logits, labels, vocab_size, **k: logits.float().mean()
    return apply_fn(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss


def _run_bad(loss):
    init_mesh(sp=2)
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)
    step = compose(sequence_parallel())(train_step_for(apply_fn, loss))
    state = step.init_state(params, _sgd())
    step(state, make_batches()[0])


@pytest.mark.parametrize("loss,pattern", [
    (_shift_in_slice, r"got shift_labels=, but the batch had none before it was split"),
    (_cut_logits, r"this rank's slice \[batch, 8\]"),
    (_custom_loss_function, r"loss_function is '<lambda>'"),
])
def test_losses_the_transform_cannot_make_right_are_refused(loss, pattern):
    with pytest.raises(RankFailure, match=pattern) as info:
        run_on_ranks(_run_bad, 2, loss)
    assert "ConfigError" in str(info.value) or "ShapeError" in str(info.value)


def _eval_losses(mesh, zero):
    """A step that also reports the model's own loss outside the gradient (an eval metric)."""
    if mesh:
        init_mesh(**mesh)
    model = make_tiny_causal_lm("llama")
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: loss_labels(apply_fn, p, b))(state.params, batch)
        with torch.no_grad():
            ev = apply_fn(state.params, input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return state.apply_gradients(grads), {"loss": loss, "eval": ev}
    transforms = (() if not mesh else (sequence_parallel(), shard_zero(3)) if zero else (sequence_parallel(),))
    step = compose(*transforms)(train_step)
    state = step.place(dsfn.TrainState.create(params, _sgd()))
    out = []
    for b in make_batches():
        state, m = step(state, b)
        out.append(float(m["eval"]))
    return out


@pytest.mark.parametrize("mesh,zero", [({"sp": 4}, False), ({"dp": 2, "sp": 2}, True)])
def test_own_loss_outside_the_gradient_is_the_whole_batch_value(mesh, zero):
    ref = _eval_losses(None, False)
    world = 1
    for v in mesh.values():
        world *= v
    for got in run_on_ranks(_eval_losses, world, mesh, zero, timeout=180):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


# -- the model's own masks over the whole sequence: sliding windows -----------------------------------------

def make_windowed(family, window):
    """Gemma2 (eager: soft-capped scores, layers alternate sliding / full) and Mistral (sdpa,
    every layer sliding), window `window` tokens."""
    return make_tiny_causal_lm(family, sliding_window=window)


def train_windowed(family, window, mesh=None, drop_window=False):
    if mesh:
        init_mesh(**mesh)
    if drop_window:     # negative control: the window not passed on (a plain causal mask)
        from dsfn.integrations.hf import attention
        forward = attention._ulysses_forward
        attention._ulysses_forward = lambda *a, **k: forward(*a, **{**k, "sliding_window": None})
    model = make_windowed(family, window)
    assert model.config._attn_implementation == ("eager" if family == "gemma2" else "sdpa")
    apply_fn, params = dsfn.functionalize(model)
    step = compose(*((sequence_parallel(),) if mesh else ()))(train_step_for(apply_fn, loss_labels))
    state = step.place(dsfn.TrainState.create(params, _sgd()))
    losses = []
    for b in make_batches((16, 16)):
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, {"params": step.gather(state).params}


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
@pytest.mark.parametrize("window", [3, 12])     # below and above each rank's slice (8 tokens at sp 2)
def test_sliding_window_over_the_whole_sequence_equals_single_process(family, window):
    ref = train_windowed(family, window)
    got = run_on_ranks(train_windowed, 2, family, window, {"sp": 2}, timeout=180)
    assert_equal_to_reference([(losses, state) for losses, state in got], ref)


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_negative_control_dropping_the_window_differs(family):
    ref = train_windowed(family, 3)
    got = run_on_ranks(train_windowed, 2, family, 3, {"sp": 2}, True, timeout=180)
    assert max(float((a - ref[1]["params"][k]).abs().max()) for k, a in got[0][1]["params"].items()) > 1e-3
