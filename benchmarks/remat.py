"""Activation checkpointing (`remat`): saved activations, peak memory and step time, on CPU.

    python benchmarks/remat.py            # GPT at seq 1024 and 4096, tiny HF Llama at 1024: ~2 min on 2 cores
    python benchmarks/remat.py --quick    # GPT at 512, Llama at 512, 3 steps: ~15 s (smoke test)
    python benchmarks/remat.py --json out.json --steps 5

Models (batch 1, fp32, one process): the example GPT (`dsfn.models.GPT`, d_model 128, 4 heads,
4 layers, vocab 256) at sequence 1024 and 4096, and a small Hugging Face `LlamaForCausalLM`
(hidden 128, intermediate 344, 8/4 heads, 4 layers, vocab 256) at 1024. Each is trained with
`dsfn.compose(...)` + SGD under these variants:

  none           no checkpointing
  hf-gc          Hugging Face's own `gradient_checkpointing_enable()` (Llama only; dsfn runs it
                 non-reentrant)
  remat          `remat()`: every block keeps only its input, recomputed in backward
  remat-matmuls  `remat(policy="matmuls")`: + the matmul / attention outputs saved
  remat-offload  `remat(offload="cpu")`: the kept block inputs held in host memory

What is measured, per variant:

- saved activations: the bytes autograd saves during one step, counted by a
  `torch.autograd.graph.saved_tensors_hooks` around the step (each distinct storage once, by
  its size; the parameters' storages left out), plus the matmul outputs a selective policy
  saves (`remat.policy_saved_bytes`, which that hook cannot see). `host` is what
  `remat(offload="cpu")` held in host memory (`remat.offloaded_bytes`); on a CPU device that
  is the same memory, so the offload variant shows where the bytes would live on a GPU, not
  a saving here. Tensors saved inside a checkpoint are not counted: the checkpoint drops
  them in forward and its recompute holds one block's at a time in backward.
- peak: the high-water mark of torch's CPU allocator during one step (allocations minus
  frees, from `torch.profiler` with `profile_memory=True`; relative to the step's start, so
  it includes the step's gradients and new parameters, equal in every variant).
- step: the median wall time of `--steps` timed steps (after one warm-up), variants taking
  turns step by step so load drift hits all alike (profiling and counting run separately).

Ratios are against `none`. Targets: remat's saved activations <= 1/3, remat's step time <=
1.4x. Every variant's first loss equals `none`'s (checked and printed).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import dsfn  # noqa: E402
from dsfn.models import GPT, GPTConfig  # noqa: E402
from dsfn.runtime import collectives as C  # noqa: E402
from dsfn.testing.alloc import allocation_peak  # noqa: E402
from dsfn.transforms import remat  # noqa: E402

SAVED_TARGET = 1 / 3
TIME_TARGET = 1.4


# -- models ---------------------------------------------------------------------------------------

def gpt_model(seq: int, d_model: int, n_layer: int):
    return GPT(GPTConfig(vocab_size=256, seq_len=seq, n_layer=n_layer, n_head=4, d_model=d_model), seed=0)


def llama_model(seq: int, hidden: int, n_layer: int):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                                   num_hidden_layers=n_layer, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=seq, use_cache=False, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(cfg)


def lm_loss(apply_fn, params, batch):
    out = apply_fn(params, batch["input_ids"])
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


VARIANTS = {
    "none": lambda: [],
    "hf-gc": lambda: [],                    # the model checkpoints itself (set up in `build`)
    "remat": lambda: [remat()],
    "remat-matmuls": lambda: [remat(policy="matmuls")],
    "remat-offload": lambda: [remat(offload="cpu")],
}


def build(kind: str, seq: int, width: int, layers: int, variant: str):
    model = gpt_model(seq, width, layers) if kind == "gpt" else llama_model(seq, width, layers)
    if variant == "hf-gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_fn, params = dsfn.functionalize(model)

    def train_step(state, batch):
        loss, grads = dsfn.value_and_grad(lambda p, b: lm_loss(apply_fn, p, b))(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}
    step = dsfn.compose(*VARIANTS[variant]())(train_step)
    state = step.place(dsfn.TrainState.create(params, dsfn.optim.sgd(1e-3)))
    return step, state, params


def batches(n: int, seq: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (1, seq + 1), generator=g)
        out.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return out


# -- measurements -----------------------------------------------------------------------------------

def saved_bytes(step, state, params, batch) -> tuple[int, int, float]:
    """(device-held saved bytes incl. a policy's saved outputs, host-held bytes, loss) of one step."""
    exclude = {p.untyped_storage().data_ptr() for p in params.values()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t
    C.reset_gauges()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, m = step(state, batch)
    policy = C.gauge_max.get("remat.policy_saved_bytes", 0)
    return sum(seen.values()) + policy, C.gauge_max.get("remat.offloaded_bytes", 0), float(m["loss"])


def peak_bytes(step, state, batch) -> int:
    """High-water mark of torch's CPU allocations during one step (profiler memory events)."""
    return allocation_peak(lambda: step(state, batch))[1]


def step_times(steps: dict, states: dict, data: list[dict], warmup: int = 1) -> dict[str, float]:
    """Median step seconds per variant; variants take turns, in a rotating order."""
    times: dict[str, list[float]] = {v: [] for v in steps}
    names = list(steps)
    for i, b in enumerate(data):
        order = names[i % len(names):] + names[:i % len(names)]
        for v in order:
            t0 = time.perf_counter()
            steps[v](states[v], b)
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(t) for v, t in times.items()}


def bench(name: str, kind: str, seq: int, width: int, layers: int, n_steps: int) -> dict[str, Any]:
    variants = [v for v in VARIANTS if v != "hf-gc" or kind == "llama"]
    built = {v: build(kind, seq, width, layers, v) for v in variants}
    data = batches(n_steps + 1, seq)
    rows = {}
    for v, (step, state, params) in built.items():
        saved, host, loss = saved_bytes(step, state, params, data[0])
        rows[v] = {"saved": saved, "host": host, "loss": loss, "peak": peak_bytes(step, state, data[0])}
    t = step_times({v: b[0] for v, b in built.items()}, {v: b[1] for v, b in built.items()}, data)
    base = rows["none"]
    for v, r in rows.items():
        r["step_s"] = t[v]
        r["saved_ratio"] = r["saved"] / base["saved"]
        r["peak_ratio"] = r["peak"] / base["peak"]
        r["time_ratio"] = t[v] / t["none"]
        r["loss_diff"] = abs(r["loss"] - base["loss"])
    return {"name": name, "kind": kind, "seq": seq, "width": width, "layers": layers, "rows": rows}


def report(res: dict[str, Any]) -> str:
    mib = 2 ** 20
    lines = [f"\n== {res['name']}: {res['kind']} seq {res['seq']}, width {res['width']}, {res['layers']} layers, "
             "batch 1",
             f"{'variant':15s} {'saved MiB':>10s} {'host MiB':>9s} {'saved/none':>10s} {'peak MiB':>9s} "
             f"{'peak/none':>9s} {'step s':>8s} {'time/none':>9s} {'|dloss|':>8s}"]
    for v, r in res["rows"].items():
        lines.append(f"{v:15s} {r['saved'] / mib:10.2f} {r['host'] / mib:9.2f} {r['saved_ratio']:10.3f} "
                     f"{r['peak'] / mib:9.2f} {r['peak_ratio']:9.3f} {r['step_s']:8.3f} {r['time_ratio']:9.3f} "
                     f"{r['loss_diff']:8.1e}")
    r = res["rows"]["remat"]
    ok_saved, ok_time = r["saved_ratio"] <= SAVED_TARGET, r["time_ratio"] <= TIME_TARGET
    lines.append(f"targets (remat): saved activations {r['saved_ratio']:.3f} <= {SAVED_TARGET:.3f} "
                 f"{'PASS' if ok_saved else 'FAIL'}; step time {r['time_ratio']:.3f} <= {TIME_TARGET} "
                 f"{'PASS' if ok_time else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short sequences, 3 timed steps (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 6; --quick 3)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    n = args.steps or (3 if args.quick else 6)
    if args.quick:
        configs = [("gpt-512", "gpt", 512, 128, 4), ("llama-512", "llama", 512, 128, 4)]
    else:
        configs = [("gpt-1k", "gpt", 1024, 128, 4), ("gpt-4k", "gpt", 4096, 128, 4),
                   ("llama-1k", "llama", 1024, 128, 4)]
    print(f"remat benchmark: torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
          f"{n} timed steps per variant")
    t0 = time.perf_counter()
    results = []
    for name, kind, seq, width, layers in configs:
        if kind == "llama":
            try:
                import transformers  # noqa: F401
            except ImportError:
                print(f"\n== {name}: skipped (transformers is not installed)")
                continue
        res = bench(name, kind, seq, width, layers, n)
        print(report(res), flush=True)
        results.append(res)
    print(f"\n(total {time.perf_counter() - t0:.0f} s; saved = bytes autograd keeps for backward outside "
          "checkpoints (+ a policy's saved matmul outputs); host = remat(offload='cpu')'s share of them; peak = "
          "torch CPU allocator high-water mark during a step)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
