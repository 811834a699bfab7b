"""The promise as tests: every stack equals the single-process reference, or refuses.

The matrix (stacks x optimizers x models x world sizes), the one list of refused
combinations and the comparison live in `conformance` (the repository's top-level package): every row trains
STEPS (3) steps and compares the losses and the whole final state (parameters and
optimizer state, Adam's moments included); fp32 rows at rtol 1e-5, mixed-precision rows
against a same-precision reference within 1/20 of what the updates changed; and a row
fails when its reference's updates are not >= 10x its tolerance.

By default CI runs `conformance.default_sample()`: an explicit stratified sample (every
stack with an SGD-family and an Adam-like optimizer, at the world size where each of its
parallel axes is 2; every optimizer and model at world >= 2; a fixed seed). It is a
deterministic construction rather than a hypothesis draw so that the coverage it
promises holds by construction and is asserted below. The ids name the row:
`stack/optimizer/model/w<world>[axis sizes]`. `-m slow` runs the whole matrix.

The negative controls break, one at a time, what the matrix rests on (the logical-value
primitive; the gradient's scale; the optimizer state a resume restores; the update
itself) and the same machinery must report a failure. `test_mutations.py` (slow) does
this for every injected bug of `conformance.mutations` over many rows.
"""
from __future__ import annotations

from unittest import mock

import pytest

import conformance as K
import dsfn
from conformance import mutations as M
from dsfn import logical

pytest.importorskip("transformers")

SAMPLE = K.default_sample()


def test_the_default_sample_covers_the_matrix():
    """Each stack, optimizer and model at world >= 2; every parallel axis of a row > 1; each
    stack with both optimizer families; nothing refused; the same rows on every call."""
    assert SAMPLE == K.default_sample()
    assert all(c.world >= 2 and all(n > 1 for n in K.STACKS[c.stack].axes(c.world).values()) for c in SAMPLE)
    assert {c.stack for c in SAMPLE} == set(K.STACKS)
    assert {c.optimizer for c in SAMPLE} == set(K.OPTIMIZERS)
    assert {c.model for c in SAMPLE} == set(K.MODELS)
    for s in K.STACKS:
        assert {K.OPTIMIZERS[c.optimizer].family for c in SAMPLE if c.stack == s} == {"sgd", "adam"}, s
    assert all(K.refusal(c.stack, c.optimizer, c.model) is None for c in SAMPLE)


@pytest.mark.parametrize("case", SAMPLE, ids=lambda c: c.id)
def test_a_sample_of_the_matrix_equals_the_reference(case, tmp_path):
    v = K.run_case(case, str(tmp_path))
    assert v == "passed"
    extra = f"; largest leaf error {v.worst:.3g} of its change" if v.worst is not None else ""
    print(f"{case.id}: the updates moved the parameters {v.ratio:.0f}x the tolerance{extra}")


HARD = [("zero3", "routed"), ("zero1+tp", "gpt"), ("sp+zero3", "llama"), ("zero2+async_checkpoint+resume", "gpt"),
        ("sp+zero3", "llama+labels"), ("zero1+tp+offload_cpu", "qwen2+labels")]


@pytest.mark.parametrize("optimizer", ["clip+sgd", "sgd"])
@pytest.mark.parametrize("stack,model", HARD)
def test_the_hard_rows_with_the_users_optimizer(stack, model, optimizer, tmp_path):
    """Rows that broke before: the clip in the optimizer chain on sharded gradients, data-dependent
    parameter use, resume from an async checkpoint, Hugging Face's own loss (labels=) under
    sequence parallel, tensor parallel with offload. Every axis at 2. `clip+sgd` clips below the
    gradient norm (checks the global norm; blind to the gradient's scale); `sgd` does not clip
    (checks the scale)."""
    case = K.Case(stack, optimizer, model, K.STACKS[stack].full_world())
    assert K.run_case(case, str(tmp_path)) == "passed"


@pytest.mark.parametrize("refusal", K.REFUSALS, ids=lambda r: r.why[:40])
def test_every_listed_refusal_raises_its_error(refusal, tmp_path):
    case = next(c for c in K.cases() if refusal.applies(c.stack, c.optimizer, c.model) and c.world == 2)
    assert K.run_case(case, str(tmp_path)) == "refused"


def test_negative_control_a_broken_mechanism_fails_the_matrix(tmp_path):
    """Each rank clips by its own shard's norm (the primitive answered locally): the same
    case must fail, so the tests above can fail."""
    with mock.patch.object(logical, "reduce_leaves", lambda partials, pieces, op="sum": list(partials)):
        with pytest.raises(AssertionError):
            K.run_case(K.Case("zero2", "clip+sgd", "mlp", 2), str(tmp_path))


@pytest.mark.parametrize("mutation,case", [
    # gradient scale: the reducer sums over 2 ranks (2x); Adam's moments see it
    ("reducer_sums", K.Case("zero2", "adamw", "mlp", 2)),
    # lost optimizer state: a resume restarts the momentum
    ("ckpt_drops_moments", K.Case("zero2+async_checkpoint+resume", "sgd", "mlp", 2)),
    # no update in the ranks: at 1/20 of the update, a mixed-precision row must see it
    ("no_update", K.Case("zero3+mixed_precision", "sgd", "mlp", 2)),
], ids=lambda x: x if isinstance(x, str) else x.id)
def test_negative_control_a_wrong_training_fails_the_matrix(mutation, case, tmp_path):
    with M.active(mutation):
        with pytest.raises(AssertionError):
            K.run_case(case, str(tmp_path))


def test_negative_control_a_reference_that_does_not_move_fails(tmp_path):
    """A row whose reference barely trains (lr 1e-9) could not see a lost update: it fails."""
    tiny = K.OptSpec(lambda: dsfn.optim.sgd(1e-9, momentum=0.9), "sgd")
    with mock.patch.dict(K.OPTIMIZERS, {"sgd": tiny}):
        with pytest.raises(AssertionError, match="could not see a lost update"):
            K.run_case(K.Case("zero2", "sgd", "mlp", 2), str(tmp_path))


def test_a_mutation_named_in_the_environment_reaches_the_ranks():
    """DSFN_MUTATION alone (nothing patched in this process) patches the ranks' code."""
    from dsfn.optim import base
    from dsfn.testing.ranks import run_on_ranks

    def where():
        from dsfn.optim import base
        return base.step.__module__
    with mock.patch.dict("os.environ", {M.ENV: "no_update"}):
        assert run_on_ranks(where, 2) == ["conformance.mutations"] * 2
    assert base.step.__module__ == "dsfn.optim.base"


@pytest.mark.slow
@pytest.mark.parametrize("case", K.cases(), ids=lambda c: c.id)
def test_the_whole_matrix(case, tmp_path):
    assert K.run_case(case, str(tmp_path)) in ("passed", "refused")
