"""The promise as tests: every stack equals the single-process reference, or refuses.

The matrix (stacks x optimizers x models x world sizes) and the one list of refused
combinations live in `dsfn.testing.conformance`, with the tolerances and why (fp32
rtol 1e-5; SGD-momentum state compared at every world size, Adam-like optimizers on
losses at world >= 2; mixed precision rtol 2e-2). CI runs a drawn sample (hypothesis,
derandomized so every CI run checks the same cases) plus every refusal; `-m slow` runs
the whole matrix. The negative control breaks the mechanism the matrix rests on (the
logical-value primitive) and the same machinery must report a failure.
"""
from __future__ import annotations

from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsfn import logical
from dsfn.testing import conformance as K

pytest.importorskip("transformers")

RUNNABLE = [c for c in K.cases() if K.refusal(c.stack, c.optimizer, c.model) is None]


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from([c for c in RUNNABLE if c.world <= 2]))
def test_a_sample_of_the_matrix_equals_the_reference(case, tmp_path_factory):
    assert K.run_case(case, str(tmp_path_factory.mktemp("case"))) == "passed"


@pytest.mark.parametrize("stack,model", [("zero3", "routed"), ("zero1+tp", "gpt"), ("sp+zero3", "llama"),
                                         ("zero2+async_checkpoint+resume", "gpt"), ("sp+zero3", "llama+labels"),
                                         ("zero1+tp+offload_cpu", "qwen2+labels")])
def test_the_hard_rows_with_the_users_optimizer(stack, model, tmp_path):
    """Rows that broke before: the clip in the optimizer chain on sharded gradients, data-dependent
    parameter use, resume from an async checkpoint, Hugging Face's own loss (labels=) under
    sequence parallel, tensor parallel with offload."""
    assert K.run_case(K.Case(stack, "clip+sgd", model, 2), str(tmp_path)) == "passed"


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


@pytest.mark.slow
@pytest.mark.parametrize("case", K.cases(), ids=str)
def test_the_whole_matrix(case, tmp_path):
    assert K.run_case(case, str(tmp_path)) in ("passed", "refused")
