"""A pipeline rank's activations for `dsfn.estimate_memory`: the stages it holds (the pipeline
engine's own `build_schedule` and `plan_stages`, from the pipeline's published facts) and a
*model* of the bytes they keep under the schedule (docs/estimate.md: Korthikanti et al.'s
per-layer activations, walked through the schedule's order). A model, not a measurement."""
from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from torch import nn

from dsfn.errors import ConfigError

__all__ = ["ACT_VALUES_PER_LAYER", "activation_detail", "human_bytes", "pipeline_activations", "pipeline_cut",
           "pipeline_line", "ring_activations"]

ACT_VALUES_PER_LAYER = 17
"""Activation values kept per token per hidden unit by one transformer layer for its backward:
Korthikanti et al. 2022's 34·s·b·h bytes at 16 bits (no recomputation, no parallelism,
attention scores not stored). A model, not a measurement."""


def human_bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:9.3f} {unit}"
    return f"{b:9.0f} B  "


def pipeline_cut(pipe: Mapping[str, Any], module: nn.Module | None, names: list[str], pp: int,
                 pp_rank: int) -> dict[str, Any]:
    """The pipeline's cut as it makes it, from its facts `pipe`: its schedule (`build_schedule`
    of its schedule, micro-batches, virtual stages at pp), stage -> rank from the schedule's
    actions, `plan_stages` of the model over p*v stages (its split, layers). {"schedule",
    "plan", "module", "stages": this rank's stages}."""
    from dsfn.engines.pipeline.schedules import build_schedule
    from dsfn.engines.pipeline.stages import plan_stages
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ConfigError(f"estimate_memory(pp_rank={pp_rank!r}): a pipeline rank 0 .. {pp - 1}")
    module = module if module is not None else pipe["pipeline_model"]
    if not isinstance(module, nn.Module):
        raise ConfigError("estimate_memory with pipeline_parallel needs the model's layers to cut it into stages: "
                          "pass the nn.Module as model= (the meta device is enough), or pipeline_parallel(..., "
                          "model=model)")
    schedule = build_schedule(pipe["pipeline_schedule"], pp, pipe["pipeline_microbatches"], pipe["pipeline_virtual"])
    where = {a.stage: a.rank for acts in schedule for a in acts}
    plan = plan_stages(module, names, len(where), pipe["pipeline_split"], pipe["pipeline_layers"])
    return {"schedule": schedule, "plan": plan, "module": module,
            "stages": tuple(sorted(s for s, r in where.items() if r == pp_rank))}


def _model_dims(module: nn.Module) -> tuple[int | None, int | None]:
    """(hidden size, vocabulary) from the model's config: Hugging Face's hidden_size /
    vocab_size, dsfn GPT's d_model / vocab_size (n_embd for GPT-2 style configs)."""
    config = getattr(module, "config", None)
    hidden = next((getattr(config, k) for k in ("hidden_size", "d_model", "n_embd")
                   if isinstance(getattr(config, k, None), int)), None)
    vocab = getattr(config, "vocab_size", None)
    return hidden, vocab if isinstance(vocab, int) else None


def _attention_dims(module: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(layers, key/value heads, head dim) from the model's config (HF names; dsfn GPT's n_layer / n_head)."""
    config = getattr(module, "config", None)
    get = lambda *ks: next((getattr(config, k) for k in ks if isinstance(getattr(config, k, None), int)), None)  # noqa: E731
    layers = get("num_hidden_layers", "n_layer")
    heads = get("num_attention_heads", "n_head")
    kv = get("num_key_value_heads") or heads
    hidden, _ = _model_dims(module)
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    return layers, kv, head_dim


def ring_activations(est: Any, module: nn.Module | None, batch: tuple[int, int] | None, dp_split: int, tp: int,
                     sp: int, cp: int, act_bytes: int) -> None:
    """A context-parallel rank's activations into `est` (a MemoryEstimate; docs/estimate.md): its
    tokens, rows / dp x seq / (cp x sp), keep ACT_VALUES_PER_LAYER values per hidden unit per
    layer (1/tp of them under tensor parallel), plus the embedding's output and the logits;
    and the ring's one K/V block in flight ([rows / dp, kv heads / (tp x sp), seq / cp, head
    dim] twice, + int64 positions), received while the rank's own is used. A model."""
    if batch is None or module is None:
        est.activation_note = "bytes not estimated: pass batch=(rows, seq_len) of the step's batch and the model"
        return
    hidden, vocab = _model_dims(module)
    layers, kv, head_dim = _attention_dims(module)
    if hidden is None or layers is None or head_dim is None:
        est.activation_note = "bytes not estimated: the model's config names no hidden size, layers or heads"
        return
    rows, seq = batch
    if rows % dp_split:
        raise ConfigError(f"estimate_memory(batch={tuple(batch)}): {rows} rows do not split over {dp_split} dp ranks")
    padded = -(-seq // (2 * cp * sp)) * 2 * cp * sp          # the transforms pad to whole chunks
    local_rows, local_seq = rows // dp_split, padded // (cp * sp)
    tokens = local_rows * local_seq
    values = layers * ACT_VALUES_PER_LAYER * tokens * hidden // tp + tokens * hidden + tokens * (vocab or 0)
    est.activations = values * act_bytes
    ring_seq = padded // cp                                  # the ring's block: the cp-local sequence (after Ulysses)
    est.ring_in_flight = (2 * local_rows * max(kv // (tp * sp), 1) * ring_seq * head_dim * act_bytes + 8 * ring_seq)
    est.activation_note = (f"{ACT_VALUES_PER_LAYER} values per token per hidden unit per layer x {layers} layers, "
                           f"{local_rows} row{'s' if local_rows != 1 else ''} x {local_seq} tokens on this rank "
                           f"(seq {seq} / cp {cp}{f' / sp {sp}' if sp > 1 else ''}), hidden {hidden}"
                           f"{f', vocabulary {vocab}' if vocab else ''}, {act_bytes} B per value")


def _recomputed_layers(remat: Mapping[str, Any] | None, plan: Any) -> tuple[set[int], set[int], str]:
    """The plan's layers whose activations are recomputed in backward — checkpointed whole by
    remat (its facts `remat`: default modules, or patterns naming whole layers, with policy
    "nothing") or by the model's own gradient checkpointing (Hugging Face's flag on the layer)
    — and a note on what is not modelled (other remat policies, sublayer patterns: counted as
    without remat): (by the model, by remat — the layers the model checkpoints itself remat
    skips — note)."""
    names = [f"{plan.layers_path}.{k}" for k in range(len(plan.layers))]
    done = {k for k, layer in enumerate(plan.layers) if getattr(layer, "gradient_checkpointing", False) is True}
    note = "the model's gradient checkpointing" if done else ""
    if remat is not None:
        policy, modules = remat["remat_policy"], remat["remat_modules"]
        whole = set(range(len(names))) if modules is None else \
            {k for k, n in enumerate(names) if any(fnmatch.fnmatchcase(n, p) for p in modules)}
        if policy != "nothing" or not whole:
            what = f"policy={policy!r}" if policy != "nothing" else f"modules={list(modules)}"
            note = ", ".join(x for x in (note, f"remat({what}) not modelled: counted as without remat, "
                                               "an upper bound") if x)
        else:
            note = ", ".join(x for x in (note, "remat()") if x)
            return done, whole - done, note
    return done, set(), note


def pipeline_activations(est: Any, cut: dict[str, Any], pipe: Mapping[str, Any], remat: Mapping[str, Any] | None,
                         pp_rank: int, batch: tuple[int, int] | None, dp_split: int, tp: int, sp: int,
                         act_bytes: int) -> None:
    """Fill the pipeline fields of `est` (a MemoryEstimate) for rank `pp_rank`: the schedule's
    peak in stage micro-batches (the engine's simulator) and the modelled activation bytes
    (docs/estimate.md). Layers recomputed in backward (remat, the model's own checkpointing)
    hold their input only, b·s·h values (1/sp under sequence parallel, 1/tp more with
    partition_activations, on the host with offload="cpu"), and each backward rematerialises
    one layer's whole activations at a time on top of what is held."""
    from dsfn.engines.pipeline.schedules import simulate
    schedule, plan = cut["schedule"], cut["plan"]
    m = pipe["pipeline_microbatches"]
    est.pp_rank, est.pipeline_schedule, est.pipeline_microbatches = pp_rank, pipe["pipeline_schedule"], m
    est.pipeline_stages = cut["stages"]
    est.peak_microbatches = simulate(schedule).peak_activations[pp_rank]
    hidden, vocab = _model_dims(cut["module"])
    if batch is None:
        est.activation_note = "bytes not estimated: pass batch=(rows, seq_len) of the step's batch"
        return
    if hidden is None:
        est.activation_note = "bytes not estimated: the model's config names no hidden size (hidden_size, d_model)"
        return
    rows, seq = batch
    if rows % (dp_split * m):
        raise ConfigError(f"estimate_memory(batch={tuple(batch)}): {rows} rows do not split into {dp_split} dp "
                          f"rank{'s' if dp_split > 1 else ''} x {m} micro-batches (pipeline_parallel(microbatches={m}))"
                          f"; pass a batch whose rows are a multiple of {dp_split * m}")
    mb_rows = rows // (dp_split * m)
    tokens = mb_rows * seq
    by_model, by_remat, recompute_note = _recomputed_layers(remat, plan)
    recomputed = by_model | by_remat
    split = sp * (tp if remat is not None and remat["remat_partition_activations"] else 1)
    kept = {k: tokens * hidden // sp for k in by_model}
    kept.update({k: 0 if remat["remat_offload"] else tokens * hidden // split for k in by_remat})
    layer_values = ACT_VALUES_PER_LAYER * tokens * hidden // (tp * sp)

    def stage_bytes(s: int) -> int:
        a, b = plan.bounds[s]
        values = sum(kept.get(k, layer_values) for k in range(a, b))
        if s == 0:
            values += tokens * hidden                       # the embedding's output
        if s == plan.n_stages - 1 and vocab:
            values += tokens * vocab                        # the logits
        return values * act_bytes
    per_stage = {s: stage_bytes(s) for s in est.pipeline_stages}
    # a backward of a stage with recomputed layers rematerialises one of them at a time
    transient = {s: layer_values * act_bytes if any(k in recomputed for k in range(*plan.bounds[s])) else 0
                 for s in est.pipeline_stages}
    held = peak = 0
    for act in schedule[pp_rank]:            # the schedule's order: F holds, B / BW frees (W keeps nothing here)
        if act.kind.value == "F":
            held += per_stage[act.stage]
        elif act.kind.value in ("B", "BW"):
            peak = max(peak, held + transient[act.stage])
            held -= per_stage[act.stage]
        peak = max(peak, held)
    est.activations = peak
    est.microbatch_activations = sum(per_stage.values())
    est.activation_note = (f"{ACT_VALUES_PER_LAYER} values per token per hidden unit per layer, {mb_rows} "
                           f"row{'s' if mb_rows != 1 else ''} x {seq} tokens per micro-batch, hidden {hidden}"
                           f"{f', vocabulary {vocab}' if vocab else ''}, {act_bytes} B per value")
    mine = sorted(k for s in est.pipeline_stages for k in range(*plan.bounds[s]) if k in recomputed)
    if mine:
        est.activation_note += (f"; recomputed in backward ({recompute_note}): layers {mine} hold their input only "
                                f"({', '.join(f'{kept[k]:,}' for k in mine)} values on the device), plus one layer's "
                                f"{layer_values:,} values rematerialised during a backward")
    elif recompute_note:
        est.activation_note += f"; {recompute_note}"


def pipeline_line(est: Any) -> str:
    many = len(est.pipeline_stages) > 1
    stages = ", ".join(str(k) for k in est.pipeline_stages)
    return (f"  pipeline: schedule {est.pipeline_schedule!r}, {est.pipeline_microbatches} micro-batches, pp "
            f"{est.mesh.get('pp', 1)}; pipeline rank {est.pp_rank} holds stage{'s' if many else ''} {stages} "
            f"(the fields count {'their' if many else 'its'} parameters only); peak {est.peak_microbatches:g} "
            f"micro-batch{'' if est.peak_microbatches == 1 else 'es'} of activations held at once under "
            f"{est.pipeline_schedule!r}")


def activation_detail(est: Any) -> str:
    if not est.microbatch_activations:
        return f"modelled; {est.activation_note}"
    return (f"modelled: peak {est.peak_microbatches:g} micro-batch{'' if est.peak_microbatches == 1 else 'es'} under "
            f"{est.pipeline_schedule!r} x {human_bytes(est.microbatch_activations).strip()} per micro-batch through "
            f"this rank's stages; {est.activation_note}")
