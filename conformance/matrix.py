"""The conformance matrix's rows: a `Case` is (stack, optimizer, model, world size); `cases()`
enumerates them all, `default_sample()` is the stratified subset CI runs, and `REFUSALS` is
the one list of combinations that must raise (with the dsfn error and why; `refusal`).
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Callable

from dsfn.errors import ConfigError, DsfnError, ShapeError

from conformance.models import MODELS
from conformance.optimizers import OPTIMIZERS
from conformance.stacks import STACKS


# ---------------------------------------------------------------------------------------------
# refusals: the one list of combinations that must raise, with the error and why


@dataclasses.dataclass(frozen=True)
class Refusal:
    applies: Callable[[str, str, str], bool]       # (stack, optimizer, model)
    error: type[DsfnError]
    match: str
    why: str


def pipelined(stack: str) -> bool:
    """Whether a stack pipelines (its name has a "pp" or "pp_<schedule>" part)."""
    return any(part == "pp" or part.startswith(("pp_", "pp4_")) for part in stack.split("+"))


REFUSALS: list[Refusal] = [
    # first: expert_parallel is built before the transforms inside it (their refusals come after)
    Refusal(lambda s, o, m: "ep" in s.split("+") and MODELS[m].experts is None, ConfigError,
            "declares no expert plan", "expert parallel shards a mixture of experts' experts; the model has "
            "none (or no plan for them: pass plan={'<experts module>': 'experts'})"),
    Refusal(lambda s, o, m: "tp" in s.split("+") and m == "llama+lora", ConfigError, "matches no module of PeftModel",
            "the HF tp plan names the inner model's modules; peft's wrapper (and its LoRA layers) has no plan: "
            "a clear error, not a silent replicated run"),
    Refusal(lambda s, o, m: "remat" in s and m in ("batchnorm", "moe") and not pipelined(s), ConfigError,
            "no repeated blocks to checkpoint",
            "remat's default picks the model's repeated blocks; this model has none (name them: modules=[...])"),
    # before tensor parallel's: a pipeline's model is cut when the stack is built (pp+tp on the MLP)
    Refusal(lambda s, o, m: pipelined(s) and not MODELS[m].attention, ConfigError,
            "cannot find the layers", "pipeline stages are cut from the model's repeated blocks; it has none "
            "(name them: layers='...')"),
    Refusal(lambda s, o, m: "tp" in s.split("+") and MODELS[m].tp is None, ConfigError,
            "declares no tp plan", "tensor parallel needs a plan; the model has none (pass plan=...)"),
    Refusal(lambda s, o, m: ("sp" in s.split("+") or "cp" in s.split("+")) and not pipelined(s)
            and not MODELS[m].attention, ShapeError,
            "the batch must be a dict with 'input_ids' [batch, seq]",
            "sequence parallel splits a token sequence; the model's batches have none"),
    Refusal(lambda s, o, m: s in ("pp_interleaved", "pp_zbv", "pp4_1f1b") and MODELS[m].attention
            and MODELS[m].layers < 4, ConfigError, "fewer than the 4 stages",
            "4 stages (2 ranks x 2 virtual stages, or 4 ranks) need 4 layers; the model has 2"),
]


def refusal(stack: str, optimizer: str, model: str) -> Refusal | None:
    return next((r for r in REFUSALS if r.applies(stack, optimizer, model)), None)


@dataclasses.dataclass(frozen=True)
class Case:
    stack: str
    optimizer: str
    model: str
    world: int

    def __str__(self) -> str:
        return f"{self.stack} | {self.optimizer} | {self.model} | world {self.world}{self._axes(' ', ', ')}"

    @property
    def id(self) -> str:
        """A test id: stack/optimizer/model/w<world>[axis sizes], e.g. `zero1+tp/sgd/gpt/w4[dp2,tp2]`."""
        return f"{self.stack}/{self.optimizer}/{self.model}/w{self.world}{self._axes('', ',')}"

    def _axes(self, sep: str, join: str) -> str:
        sspec = STACKS[self.stack]
        axes = sspec.axes(self.world)
        if sspec.ranks_per_node(self.world):
            axes["nodes"] = sspec.nodes
        return f"{sep}[{join.join(f'{k}{sep}{n}' for k, n in axes.items())}]" if axes else ""


def cases() -> list[Case]:
    """The whole matrix (refused combinations included: they must raise)."""
    out = []
    for s, o, m in itertools.product(STACKS, OPTIMIZERS, MODELS):
        if o in STACKS[s].skip_optimizers:
            continue
        for w in STACKS[s].worlds:
            out.append(Case(s, o, m, w))
    return out


SAMPLE_SEED = 26


def default_sample(seed: int = SAMPLE_SEED) -> list[Case]:
    """The rows CI runs by default: a stratified sample of the runnable matrix, the same for a seed.

    - every stack twice, at its full world (`StackSpec.full_world`: 2, or 4 where the stack has
      two parallel axes, so each is 2): once with an SGD-momentum-family optimizer, once with an
      Adam-like one (the same stack with a scale-sensitive and a scale-blind update);
    - within a family the optimizer, and the model, are the least used so far among those the
      stack runs (ties broken by `random.Random(seed)`), so every optimizer and every model
      appears at world >= 2 (`tests/conformance/test_matrix.py` asserts it);
    - one more row per model a stack names (`StackSpec.models`: the sequence-splitting stacks'
      causal, windowed and packed models), the families alternating; models with
      `drawn=False` appear only there.
    Refused combinations are not drawn: each listed refusal has its own test.
    """
    rng = random.Random(seed)
    used_opt = {o: 0 for o in OPTIMIZERS}
    used_model = {m: 0 for m in MODELS}
    out = []

    def least(counts: dict[str, int], allowed: list[str]) -> str:
        low = min(counts[x] for x in allowed)
        return rng.choice([x for x in allowed if counts[x] == low])

    def draw(stack: str, family: str, world: int) -> None:
        opts = [o for o, spec in OPTIMIZERS.items() if spec.family == family and o not in STACKS[stack].skip_optimizers
                and any(refusal(stack, o, m) is None for m in MODELS)]
        o = least(used_opt, opts)
        m = least(used_model, [m for m in MODELS if MODELS[m].drawn and refusal(stack, o, m) is None])
        used_opt[o] += 1
        used_model[m] += 1
        out.append(Case(stack, o, m, world))
    for stack, sspec in STACKS.items():
        for family in ("sgd", "adam"):
            draw(stack, family, sspec.full_world())
        for k, world in enumerate(sspec.also_sampled):      # one more row each, the families alternating
            draw(stack, ("sgd", "adam")[(len(out) + k) % 2], world)
        for k, model in enumerate(sspec.models):            # the models the stack names, one row each
            family = ("sgd", "adam")[(len(out) + k) % 2]
            o = least(used_opt, [o for o, spec in OPTIMIZERS.items() if spec.family == family
                                 and o not in sspec.skip_optimizers and refusal(stack, o, model) is None])
            used_opt[o] += 1
            used_model[model] += 1
            out.append(Case(stack, o, model, sspec.full_world()))
    return out
