"""The `pipeline` section: `pipeline_parallel("1f1b", ...)`, its stage split, and what it does not combine with.

In DeepSpeed pipeline parallelism is a `PipelineModule` passed to `initialize`; its
config's `"pipeline"` section (`get_pipeline_config`) is where dsfn reads it: `stages` > 1
builds `pipeline_parallel("1f1b", microbatches=gradient_accumulation_steps, model=model)`
(DeepSpeed's engine runs 1F1B, with the accumulation steps as its micro-batches) over a
"pp" mesh axis laid out outermost, as DeepSpeed's pipe-data(-model) topology is. `stages`
absent, "auto" (DeepSpeed's default) or 1 is no pipeline: the other pipeline keys then do
nothing and are named in the warning. ZeRO stage 2/3 with a pipeline, which DeepSpeed's
pipeline engine refuses, is mapped: `shard_zero(2|3)` around it (each micro-batch's backward
a round of gradient buckets); `sequence_parallel_size` > 1 keeps `sequence_parallel()`
outermost and `autotp_size` > 1 puts `tensor_parallel("auto")` inside the pipeline (each
stage split over its tp group); `activation_checkpoint_interval: 1` is `remat()` (each layer
of a stage checkpointed; DeepSpeed's `activation_checkpointing` options, when given, shape
that remat), a larger interval (groups of layers) is listed, and so are fewer accumulation
steps than stages (dsfn's 1F1B needs m >= P); `pipe_partitioned` / `grad_partitioned` (partitioned
p2p of tensor-parallel activations: communication only, and DeepSpeed applies them only
under model parallelism), `use_reentrant` and `seed_layers` (DeepSpeed's engine takes it
from PipelineModule, and dsfn trains the parameters the model already holds) are accepted
and named in the warning. The split into stages changes where layers run, not the numbers.
"""
from __future__ import annotations

import re
from typing import Any

from dsfn.errors import ConfigError
from dsfn.migrate.ds_config.report import KeyReport
from dsfn.migrate.ds_config.values import build, flag, section, whole_number

_PIPE_COMM = {"pipe_partitioned": "partitioned p2p of tensor-parallel activations",
              "grad_partitioned": "partitioned p2p of tensor-parallel activation gradients"}


def _stage_count(b: dict) -> int:
    """`pipeline.stages` (popped): absent, null or "auto" is 1 (no pipeline)."""
    stages = b.pop("stages", "auto")
    if stages is None or (isinstance(stages, str) and stages == "auto"):
        return 1
    pp = whole_number("pipeline.stages", stages)
    if pp < 1:
        raise ConfigError(f"ds_config pipeline.stages={stages!r}: the number of pipeline stages, an int >= 1 "
                          "(PipelineModule's num_stages)")
    return pp


def _partition_method(b: dict, report: KeyReport) -> str:
    """`pipeline.partition` (popped) as "uniform", "parameters" or "type:<regex>"."""
    partition = b.pop("partition", "best")
    if not isinstance(partition, str):
        raise ConfigError(f"ds_config pipeline.partition={partition!r}: 'uniform', 'parameters' or 'type:<regex>'")
    low = partition.lower()
    if low in ("best", "uniform"):
        partition = "uniform"
    elif low == "parameters":
        partition = "parameters"
    elif low.startswith("type:"):
        partition = "type:" + partition[5:]
    else:
        report.refuse("pipeline.partition", f"{partition!r}: dsfn cuts the model's decoder layers 'uniform' (by "
                      "count), by 'parameters' or by 'type:<regex>' (DeepSpeed's 'profile' is not implemented there "
                      "either)")
    return partition


def read_pipeline(block: Any, report: KeyReport) -> tuple[int, str, int]:
    """(pp size, partition method, activation_checkpoint_interval) from the `pipeline` section (module docstring); its
    keys are popped and each one checked, listed or named as ignored."""
    if block is None:
        return 1, "uniform", 0
    b = section("pipeline", block)
    pp = _stage_count(b)
    if pp == 1:
        if b:
            report.ignore("pipeline", f"{sorted(b)} with no pipeline.stages > 1: DeepSpeed takes the stage count "
                          "from PipelineModule(num_stages=); set pipeline.stages to it for pipeline_parallel (without "
                          "it the accumulation steps run as accumulate(n): the same numbers)")
        return 1, "uniform", 0
    partition = _partition_method(b, report)
    interval = whole_number("pipeline.activation_checkpoint_interval", b.pop("activation_checkpoint_interval", 0))
    if interval > 1:
        report.refuse("pipeline.activation_checkpoint_interval", f"{interval}: DeepSpeed checkpoints groups of "
                      f"{interval} layers; dsfn's remat() checkpoints each layer of a stage: set 1 (every layer; the "
                      "same numbers) or 0")
    if "use_reentrant" in b:
        flag("pipeline.use_reentrant", b.pop("use_reentrant"))
        report.ignore("pipeline.use_reentrant", "it picks the checkpoint function; dsfn's remat is non-reentrant "
                      "(the same numbers)" if interval else "it picks the checkpoint function of "
                      "activation_checkpoint_interval, which is off")
    for k, what in _PIPE_COMM.items():
        if k in b:
            flag(f"pipeline.{k}", b.pop(k))
            report.ignore(f"pipeline.{k}", f"{what}: communication only, and DeepSpeed applies it only under tensor "
                          "parallelism, which does not run inside a dsfn pipeline stage")
    if "seed_layers" in b and flag("pipeline.seed_layers", b.pop("seed_layers")):
        report.ignore("pipeline.seed_layers", "it seeds PipelineModule's layer construction (DeepSpeed's engine "
                      "reads it from PipelineModule, not the config); dsfn trains the parameters the model already "
                      "holds")
    for k in b:
        report.refuse(f"pipeline.{k}", "not a DeepSpeed 0.19 pipeline key (stages, partition, seed_layers, "
                      "activation_checkpoint_interval, pipe_partitioned, grad_partitioned, use_reentrant)")
    return pp, partition, interval


def check_pipeline_limits(pp: int, gas: int, report: KeyReport) -> None:
    """What a dsfn pipeline does not combine with (listed, as DeepSpeed's own limits are)."""
    if gas < pp:
        report.refuse("gradient_accumulation_steps", f"{gas} with pipeline.stages {pp}: the accumulation steps are "
                      f"the pipeline's micro-batches, and dsfn's 1F1B needs at least one per stage; set it >= {pp} "
                      "(and train_batch_size to match)")


def _parameter_weights(model: Any, plan: Any) -> tuple[list[int], int, int]:
    """(parameters per layer, before the layer list, after it): a tied weight counted once, where it first appears."""
    layers, prefix = plan.layers, plan.layers_path + "."
    first = last = 0
    weights = [0] * len(layers)
    order = {name: k for k, (name, _) in enumerate(model.named_modules())}
    at = order[plan.layers_path]
    for name, p in model.named_parameters():
        if name.startswith(prefix):
            weights[int(name[len(prefix):].split(".", 1)[0])] += p.numel()
        elif order.get(name.rsplit(".", 1)[0] if "." in name else "", -1) < at:
            first += p.numel()
        else:
            last += p.numel()
    return weights, first, last


def _type_weights(plan: Any, partition: str) -> list[int]:
    """1 for each layer whose class name matches the regex of 'type:<regex>' (case-insensitive), else 0."""
    layers = plan.layers
    try:
        regex = re.compile(partition[5:], re.IGNORECASE)
    except re.error as e:
        raise ConfigError(f"ds_config pipeline.partition={partition!r}: not a regular expression ({e})") from None
    weights = [1 if regex.search(type(layer).__name__) else 0 for layer in layers]
    if not any(weights):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ConfigError(f"ds_config pipeline.partition={partition!r}: no layer of the model's layer list "
                          f"({plan.layers_path}: {kinds}) matches; name one of those classes, or use 'uniform'")
    return weights


def pipeline_split(model: Any, pp: int, partition: str) -> list[int] | None:
    """`pipeline_parallel(split=)` for a partition method: None (the even split by layer
    count) for 'uniform', else each stage's layer count balancing a weight per layer as
    DeepSpeed's `partition_balanced` does: its parameter count ('parameters'; the modules
    before the layer list, embeddings, counted on the first stage, those after it on the
    last, a tied weight once, where it first appears) or 1 for a layer whose class name
    matches the regex ('type:<regex>', case-insensitive as in DeepSpeed)."""
    from dsfn.engines.pipeline.stages import plan_stages
    if partition == "uniform":
        return None
    names = [n for n, _ in model.named_parameters()]
    plan = build("pipeline", plan_stages, model, names, 1)
    if partition == "parameters":
        weights, first, last = _parameter_weights(model, plan)
    else:
        weights, first, last = _type_weights(plan, partition), 0, 0
    return balanced_split(weights, pp, first, last)


def balanced_split(weights: list[int], parts: int, first: int = 0, last: int = 0) -> list[int]:
    """Consecutive layer counts (each >= 1) cutting `weights` into `parts` stages whose
    largest total (`first` added to the first stage, `last` to the last) is the least
    possible; of those, the one whose earlier stages hold the most layers (equal weights
    give the even split, the first stages taking one more)."""
    n = len(weights)
    if n < parts:
        raise ConfigError(f"ds_config pipeline.stages={parts}: the model has {n} layers, fewer than the stages")
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)

    def cost(s: int, a: int, b: int) -> int:
        return pre[b] - pre[a] + (first if s == 0 else 0) + (last if s == parts - 1 else 0)

    inf = float("inf")
    # best[s][a]: the least largest total of stages s.. over layers a..
    best = [[inf] * (n + 1) for _ in range(parts)]
    for a in range(n):
        best[parts - 1][a] = cost(parts - 1, a, n)
    for s in range(parts - 2, -1, -1):
        for a in range(s, n - (parts - 1 - s)):
            best[s][a] = min(max(cost(s, a, b), best[s + 1][b]) for b in range(a + 1, n - (parts - 2 - s)))
    cap, counts, a = best[0][0], [], 0
    for s in range(parts - 1):
        b = max(b for b in range(a + 1, n - (parts - 2 - s)) if cost(s, a, b) <= cap and best[s + 1][b] <= cap)
        counts.append(b - a)
        a = b
    counts.append(n - a)
    return counts
