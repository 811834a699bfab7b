"""Initialising a ZeRO-3 state for a model larger than one rank: the per-rank allocation peak of
`dsfn.state.init.init_sharded` vs this rank's shard, the largest tensor and the full model.

    python benchmarks/init_memory.py                 # Llama ~5.6M params, 4 ranks: ~1 min on 2 cores
    python benchmarks/init_memory.py --quick         # ~1.4M params, 2 ranks (smoke test)
    python benchmarks/init_memory.py --json out.json

Model: a Hugging Face `LlamaForCausalLM` (hidden 256, intermediate 512, 8 heads, 8 layers,
vocab 1024, tied embeddings; `--quick`: 4 layers, hidden 128), fp32, AdamW, `shard_zero(3)` on
`--world` gloo ranks. Variants, each measured on every rank:

  baseline     the model built on the CPU, then `step.init_state(params, tx)` (what one does
               without init_sharded: every rank holds the whole model once)
  meta+init    built on the meta device, `init_sharded(..., source=fn)` with a per-leaf
               initialiser (one full tensor at a time)
  meta+ckpt    built on the meta device, `init_sharded(..., source=[hf_checkpoint(dir), fn])`
               from a sharded `save_pretrained` directory (`max_shard_size` 2MB); each rank
               reads only its FlatShard runs (bytes counted)

Then, on the meta+ckpt state, the allocation peak (as below) of `export_state` to a
safetensors file and of one sharded eval step (`compose(shard_zero(3, prefetch=0))` of a
no-grad loss, state returned unchanged; its first call, pooled unit buffers included).
Targets: export <= the largest tensor + 10%; eval <= the root unit (embeddings, kept to the
end) + one layer + the logits and their log-softmax, + 10%.

What is measured: the high-water mark of torch's CPU allocations during the init (allocations
minus frees, `torch.profiler` with `profile_memory=True`; model building included), the bytes
of the placed state (`shard`: parameter shards + AdamW's moments), the largest parameter, and
the full model's fp32 parameters + AdamW state (12 bytes per parameter). Target:
peak <= shard + largest tensor + 10%. Ratios are against the baseline's peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
import zlib
from typing import Any

import torch

import dsfn
from dsfn.launch import spawn
from dsfn.runtime import init_mesh
from dsfn.state.init import hf_checkpoint, init_sharded
from dsfn.testing.alloc import allocation_peak
from dsfn.testing.reference import lm_loss, train_step_for
from dsfn.transforms import shard_zero


def config(quick: bool):
    import transformers
    fields = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=128, tie_word_embeddings=True)
    if quick:
        fields.update(hidden_size=128, intermediate_size=256, num_hidden_layers=4)
    return transformers.LlamaConfig(**fields)


def build(cfg, meta: bool):
    import transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if meta:
            with torch.device("meta"):
                return transformers.LlamaForCausalLM(cfg)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg)


def seeded(name: str, like: torch.Tensor) -> torch.Tensor:
    """A per-leaf initialiser (deterministic on every rank; rotary tables from the config)."""
    if name.endswith("inv_freq") or name.endswith("original_inv_freq"):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        return dict(LlamaRotaryEmbedding(_CFG[0]).named_buffers())[name.rpartition(".")[2]]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(like.shape, generator=g).mul_(0.02).to(like.dtype)


_CFG: list = []


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in dsfn.tree.leaves(state) if isinstance(t, torch.Tensor))


def rank_main(quick: bool, ckpt: str) -> dict[str, dict]:
    init_mesh()
    cfg = config(quick)
    _CFG[:] = [cfg]
    out = {}

    def baseline():
        model = build(cfg, meta=False)
        apply_fn, params = dsfn.functionalize(model, release=True)
        step = dsfn.compose(shard_zero(3))(train_step_for(apply_fn, lm_loss))
        return step.init_state(params, dsfn.optim.adamw(lr=1e-3))

    apply_fns = []

    def from_meta(source):
        def run():
            apply_fn, params = dsfn.functionalize(build(cfg, meta=True))
            apply_fns[:] = [apply_fn]                # its constants are filled by init_sharded
            step = dsfn.compose(shard_zero(3))(train_step_for(apply_fn, lm_loss))
            return init_sharded(step, params, dsfn.optim.adamw(lr=1e-3), source=source, apply_fn=apply_fn)
        return run

    src = hf_checkpoint(ckpt)
    state = None
    for name, fn in (("baseline", baseline), ("meta+init", from_meta(seeded)),
                     ("meta+ckpt", from_meta([src, seeded]))):
        del state
        state, peak = allocation_peak(fn)
        out[name] = dict(peak=peak, shard=nbytes(state))
    out["meta+ckpt"]["bytes_read"] = src.bytes_read
    out["export_eval"] = export_and_eval(cfg, state, apply_fns[0], ckpt)
    return out


def export_and_eval(cfg, state, apply_fn, ckpt: str) -> dict[str, int]:
    """Allocation peaks (as for the init) of export_state and of a sharded eval step's first
    call (its pooled unit buffers included), on the meta+ckpt state."""
    from dsfn.checkpoint.export import export_state
    with tempfile.TemporaryDirectory(dir=os.path.dirname(ckpt)) as d:
        _, export = allocation_peak(lambda: export_state(state, d))

    def eval_step(s, batch):
        with torch.no_grad():     # use_cache=False: else HF keeps every layer's keys and values
            logits = apply_fn(s.params, batch["input_ids"], use_cache=False).logits
            return s, {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (8, 65), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    _, ev = allocation_peak(lambda: dsfn.compose(shard_zero(3, prefetch=0))(eval_step)(state, batch))
    local_rows = 8 // torch.distributed.get_world_size()
    return dict(export=export, eval=ev, logits=local_rows * 64 * cfg.vocab_size * 4)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world", type=int, default=None, help="ranks (default 4; --quick: 2)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    world = a.world or (2 if a.quick else 4)
    cfg = config(a.quick)
    model = build(cfg, meta=False)
    numels = {n: q.numel() for n, q in model.named_parameters()}
    psi, largest = sum(numels.values()), 4 * max(numels.values())
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, max_shard_size="2MB")
        shards = len([f for f in os.listdir(d) if f.endswith(".safetensors")])
        del model
        results = spawn(rank_main, world, args=(a.quick, d), timeout=600)
    full = 12 * psi
    print(f"Llama {psi / 1e6:.2f}M params, world {world}, ZeRO-3 + AdamW fp32; checkpoint in {shards} files")
    print(f"full model (fp32 params + AdamW) {full / 2**20:.2f} MiB; largest tensor {largest / 2**20:.2f} MiB")
    print(f"{'variant':10s} {'rank':>4s} {'peak MiB':>9s} {'shard MiB':>9s} {'peak/(shard+largest)':>21s} "
          f"{'peak/full':>9s} {'vs baseline':>11s} {'read MiB':>9s}")
    rows = []
    export_eval = [res.pop("export_eval") for res in results]
    for r, res in enumerate(results):
        base = res["baseline"]["peak"]
        for v, m in res.items():
            target = m["shard"] + largest
            row = dict(variant=v, rank=r, peak=m["peak"], shard=m["shard"], vs_target=m["peak"] / target,
                       vs_full=m["peak"] / full, vs_baseline=m["peak"] / base, bytes_read=m.get("bytes_read"))
            rows.append(row)
            read = f"{m['bytes_read'] / 2**20:9.3f}" if "bytes_read" in m else f"{'':9s}"
            print(f"{v:10s} {r:4d} {m['peak'] / 2**20:9.3f} {m['shard'] / 2**20:9.3f} {row['vs_target']:21.3f} "
                  f"{row['vs_full']:9.3f} {row['vs_baseline']:11.3f} {read}")
    worst = max(r["vs_target"] for r in rows if r["variant"] != "baseline")
    ok = worst <= 1.10
    print(f"target peak <= shard + largest + 10%: worst {worst:.3f} -> {'met' if ok else 'MISSED'}")
    # export / eval on the meta+ckpt state: allocations beyond the held shard
    root = 4 * sum(n for k, n in numels.items() if ".layers." not in k)
    layer = 4 * sum(n for k, n in numels.items() if ".layers.0." in k)
    print(f"export_state and a sharded eval step (allocation peak; largest tensor {largest / 2**20:.2f} MiB, "
          f"root unit {root / 2**20:.2f}, one layer {layer / 2**20:.2f})")
    print(f"{'rank':>4s} {'export MiB':>10s} {'/largest':>8s} {'eval MiB':>9s} {'/(root+layer+2 logits)':>23s}")
    ee_ok = True
    for r, e in enumerate(export_eval):
        bound = root + layer + 2 * e["logits"]      # the logits and the loss's log-softmax of them
        print(f"{r:4d} {e['export'] / 2**20:10.3f} {e['export'] / largest:8.2f} {e['eval'] / 2**20:9.3f} "
              f"{e['eval'] / bound:23.2f}")
        rows.append(dict(variant="export_eval", rank=r, **e, bound=bound))
        ee_ok = ee_ok and e["export"] <= 1.1 * largest + (256 << 10) and e["eval"] <= 1.1 * bound
    print(f"target export <= largest + 10%, eval <= (root + layer + 2 logits) + 10%: "
          f"{'met' if ee_ok else 'MISSED'}")
    ok = ok and ee_ok
    out = dict(psi=psi, world=world, full=full, largest=largest, rows=rows, target_met=ok)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["target_met"] else 1)
