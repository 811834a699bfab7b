"""A wrapped Hugging Face causal LM's own loss (`labels=`) is the whole batch's token mean:
peft's LoRA (`PeftModelForCausalLM` -> `LoraModel` -> `LlamaForCausalLM`), a user's own
nn.Module around an HF model and torch.compile's `OptimizedModule`. The whole-batch count
goes to the module that computes the loss — the inner model whose `loss_function` the
forward calls (`dsfn.integrations.hf.loss_modules`) — not the top module, under data
parallel, ZeRO-3, sequence parallel (peft's forward takes position_ids through **kwargs)
and accumulate.

Equality: prompt-masked labels (a different number of -100 per rank / micro-batch),
SGD-momentum, 3 steps, losses and final trainable state at fp32 rtol 1e-5 against the
single process. Negative control: installing the count on the top module (the old rule)
leaves the inner model's loss a per-rank mean, and the run differs. A model given labels
whose loss dsfn cannot find (or that never calls it) is refused with ConfigError.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import dsfn
from dsfn.errors import ConfigError
from dsfn.runtime import init_mesh
from dsfn.testing import run_on_ranks
from dsfn.testing.asserts import assert_trees_close
from dsfn.testing.models import make_tiny_causal_lm, token_batches
from dsfn.testing.reference import run_steps
from dsfn.transforms import accumulate, compose, data_parallel, sequence_parallel, shard_zero

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = dict(rtol=1e-5, atol=1e-6)


def make_batches(steps=3, rows=4, t=12, seed=7):
    """Prompt tokens masked: rows 0-1 (dp rank 0, micro-batch 0, and the first half of the
    sequence under sp) hold many -100, rows 2-3 few."""
    out = []
    for i in range(steps):
        ids = token_batches(1, rows, t, 101, seed=seed + i)[0]["input_ids"]
        labels = ids.clone()
        labels[0, :7] = -100
        labels[1, :5] = -100
        labels[2, :2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


class Wrapper(nn.Module):
    """A user's own wrapper: the HF model one level down, called with the labels."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels=None, **kwargs):
        return self.lm(input_ids=input_ids, labels=labels, **kwargs)


def make_model(family="llama", kind="peft"):
    lm = make_tiny_causal_lm(family)
    if kind == "plain":
        return lm
    if kind == "wrapper":
        for n, p in lm.named_parameters():       # a head-only fine-tune, to keep it a wrapped-model test
            p.requires_grad_("layers.1" in n)
        return Wrapper(lm)
    torch.manual_seed(1)
    # init_lora_weights=False: B random too, so A trains from the first step
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    model = peft.get_peft_model(lm, cfg)
    if kind == "compiled":
        model = torch.compile(model, backend="eager")
    return model


def train(make_transforms, family="llama", kind="peft", mesh=None, top_only=False):
    from dsfn.integrations.hf import detect, losses
    real = detect.loss_modules, losses._check_called
    if top_only:            # the old rule: the whole-batch count on the top module ("unchecked": no proof)
        detect.loss_modules = lambda model: [model]
        if top_only == "unchecked":
            losses._check_called = lambda *a: None
    try:
        return _train(make_transforms, family, kind, mesh)
    finally:
        detect.loss_modules, losses._check_called = real


def _train(make_transforms, family, kind, mesh):
    if mesh:
        init_mesh(**mesh)
    model = make_model(family, kind)
    apply_fn, params = dsfn.functionalize(model)

    def loss_fn(p, b):
        return apply_fn(p, input_ids=b["input_ids"], labels=b["labels"]).loss

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(*make_transforms())(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5, momentum=0.9))
    return run_steps(step, state, make_batches())


# name -> (transforms, world, mesh)
STACKS = {
    "dp2": (lambda: (data_parallel(),), 2, {"dp": 2}),
    "zero3": (lambda: (shard_zero(3),), 2, {"dp": 2}),
    "sp2": (lambda: (sequence_parallel(),), 2, {"sp": 2}),
    "accumulate2": (lambda: (accumulate(2),), 1, None),
}


def _run(stack, family="llama", kind="peft", top_only=False):
    make, world, mesh = STACKS[stack]
    if world == 1:
        return [train(make, family, kind, mesh, top_only)]
    return run_on_ranks(train, world, make, family, kind, mesh, top_only, timeout=180)


def _check(runs, ref):
    ref_losses, ref_state = ref
    for losses, state in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
        assert_trees_close(state, ref_state, **TOL)


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_lora_loss_is_the_whole_batch_token_mean(family, stack):
    _check(_run(stack, family), train(lambda: (), family))


@pytest.mark.parametrize("stack", ["zero3", "sp2"])
def test_user_wrapper_loss_is_the_whole_batch_token_mean(stack):
    _check(_run(stack, kind="wrapper"), train(lambda: (), kind="wrapper"))


@pytest.mark.parametrize("kind", ["plain", "peft", "wrapper", "compiled"])
def test_the_loss_module_is_found_through_wrappers(kind):
    """torch.compile's OptimizedModule (`_orig_mod`), peft (PeftModel -> LoraModel), a user's module."""
    from dsfn.integrations import hf
    model = make_model(kind=kind)
    found = hf.loss_modules(model)
    assert [type(m).__name__ for m in found] == ["LlamaForCausalLM"]
    assert (found[0] is model) == (kind == "plain")


@pytest.mark.slow          # dynamo traces the model (~30 s on 2 cores)
def test_compiled_peft_model_loss_is_the_whole_batch_token_mean():
    ref_losses, ref_state = train(lambda: ())
    ((losses, state),) = _run("accumulate2", kind="compiled")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    params = {k.removeprefix("_orig_mod."): v for k, v in state["params"].items()}
    assert_trees_close(params, ref_state["params"], **TOL)


@pytest.mark.parametrize("stack", ["dp2", "accumulate2"])
def test_negative_control_count_on_the_top_module_differs(stack):
    ref_losses, _ = train(lambda: ())
    losses, _ = _run(stack, top_only="unchecked")[0]
    assert not torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), **TOL), (losses, ref_losses)


def test_count_on_a_module_whose_loss_the_forward_never_calls_is_refused():
    """The proof: the installed loss must be called. The old top-module install is caught."""
    with pytest.raises(ConfigError, match="did not call the loss_function of PeftModel"):
        _run("accumulate2", top_only="checked")


class OwnCrossEntropy(Wrapper):
    """Given labels, but computes its loss itself from the inner model's logits."""

    def forward(self, input_ids, labels=None):
        logits = self.lm(input_ids=input_ids).logits[:, :-1]
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)}


class Unregistered(nn.Module):
    """Holds an HF model outside its module tree and claims its loss_function by __getattr__
    (as peft forwards it): no module of the tree defines one."""

    def __init__(self, lm):
        super().__init__()
        self.__dict__["lm"] = lm                      # not registered: not in the module tree
        self.w = nn.Parameter(torch.ones(()))

    def __getattr__(self, name):
        if name == "loss_function":
            return self.__dict__["lm"].loss_function
        return super().__getattr__(name)

    def forward(self, input_ids, labels=None):
        return self.lm(input_ids=input_ids, labels=labels)


class Forwarding(Unregistered):
    """The same, claiming it by a property: the count installed on it is never called."""

    @property
    def loss_function(self):
        return self.lm.loss_function


@pytest.mark.parametrize("make, why", [(OwnCrossEntropy, "did not call the loss_function of LlamaForCausalLM"),
                                       (Forwarding, "did not call the loss_function of Forwarding"),
                                       (Unregistered, "no module of its tree defines one")])
def test_a_loss_dsfn_cannot_find_is_refused(make, why):
    model = make(make_tiny_causal_lm("llama"))
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        value, grads = dsfn.value_and_grad(
            lambda p, b: apply_fn(p, input_ids=b["input_ids"], labels=b["labels"])["loss"])(state.params, batch)
        return state.apply_gradients(grads), {"loss": value}
    step = compose(accumulate(2))(train_step)
    state = step.init_state(params, dsfn.optim.sgd(0.5))
    with pytest.raises(ConfigError, match="cannot find the module that computes its own loss") as e:
        step(state, make_batches(1)[0])
    assert why in str(e.value)


def test_position_ids_that_a_wrapper_drops_are_refused_under_sp():
    def run():
        init_mesh(sp=2)

        class Dropping(Wrapper):
            def forward(self, input_ids, labels=None, **kwargs):      # takes **kwargs, passes none on
                return self.lm(input_ids=input_ids, labels=labels)
        model = Dropping(make_tiny_causal_lm("llama"))
        apply_fn, params = dsfn.functionalize(model)

        def train_step(state, batch):
            value, grads = dsfn.value_and_grad(
                lambda p: apply_fn(p, input_ids=batch["input_ids"], labels=batch["labels"]).loss)(state.params)
            return state.apply_gradients(grads), {"loss": value}
        step = compose(sequence_parallel())(train_step)
        state = step.init_state(params, dsfn.optim.sgd(0.5))
        try:
            step(state, make_batches(1)[0])
        except ConfigError as e:
            return str(e)
        return None
    for msg in run_on_ranks(run, 2, timeout=120):
        assert msg is not None and "did not reach LlamaForCausalLM.forward" in msg, msg
