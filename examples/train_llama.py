"""Train a small Hugging Face Llama on the stdlib's source bytes, on CPU ranks, with
tensor parallelism, data parallelism, ZeRO and (Ulysses) sequence parallelism from dsfn, then
export it as a HF model.

    python examples/train_llama.py                          # tp 2 x dp 1, ZeRO 0: 2 ranks, ~1 min
    python examples/train_llama.py --tp 2 --dp 2 --zero 1   # 4 ranks: ZeRO-1 over dp, Megatron tp
    python examples/train_llama.py --tp 1 --dp 2 --zero 3   # 2 ranks, ZeRO-3 only
    python examples/train_llama.py --model tiny --steps 50
    python examples/train_llama.py --sp 2 --tp 2 --zero 1 --tiled-mlp 2   # 4 ranks: Ulysses sp x tp
    python examples/train_llama.py --tp 1 --sp 2 --seq-len 4096 --batch-size 1 --steps 3 --remat  # long context
    python -m dsfn.launch --nproc 4 examples/train_llama.py --tp 2 --dp 2   # ranks started outside
    python examples/train_llama.py --tp 1 --seq-len 1024 --batch-size 2 --remat-offload   # activation checkpointing

The model is `transformers.LlamaForCausalLM` built from a `LlamaConfig` with random weights
(nothing is downloaded): byte-level, vocab 256, on the same corpus as `train_gpt.py` (see
`corpus.py`; the last 5% of the files are held out for validation). The training step is
written once, for one device; `compose(shard_zero(zero), tensor_parallel("auto", model=model),
clip_grad_norm(1.0))` runs it on tp x dp ranks: `tensor_parallel("auto")` reads the model's own
Hugging Face tp plan (q/k/v/gate/up colwise, o/down rowwise, vocab-parallel embedding and LM
head), `shard_zero` splits the global batch and (stage >= 1) the optimizer state, (>= 2) the
gradients and (3) the parameters over dp. Every rank draws the same global batch, so the ranks
of a tp group see the same rows.

With `--sp N` (> 1) the stack is `compose(sequence_parallel(), shard_zero(...), tensor_parallel(...),
clip_grad_norm(1.0))` on dp x tp x sp ranks: DeepSpeed Ulysses. Every sequence is split over
the sp ranks (dim 1; lengths not divisible by sp are padded with ignored labels), the model gets
the global position_ids of its slice (RoPE), HF attention runs as all-to-all (sequence -> heads,
full-sequence causal attention on H/(tp*sp) heads, heads -> sequence), and the loss is the
token-weighted mean over the sp group. sp*tp must divide the query and key/value head counts.
`--tiled-mlp N` runs every decoder layer's MLP over N sequence tiles, recomputed in backward
(`dsfn.ops.tile_mlps`), so its activation memory does not grow with the sequence length.
`--seq-len` sets the training length (and the config's max_position_embeddings, so the
exported model accepts it). `--remat` checkpoints every decoder layer with the `remat()`
transform (inside tensor_parallel: the recompute re-issues tp's collectives), `--remat-offload`
keeps the layers' saved inputs in host memory, `--remat-policy matmuls` also saves matmul outputs.

At the end the training state is saved with `dsfn.checkpoint.save` (sharded, one file per
rank) and exported with `dsfn.checkpoint.export(..., format="hf", config=model.config)` to a
Hugging Face directory that `transformers.LlamaForCausalLM.from_pretrained` loads.

Outputs (in --out, default runs/train_llama): metrics.jsonl (one JSON object per step),
loss.png (the loss curve), summary.json (what the summary printed at the end says), ckpt/
(the last training state) and hf/ (config.json + model.safetensors).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Running as `python examples/train_llama.py` from a checkout without `pip install -e .`:
# make the repository's dsfn importable (and `corpus` / `runner` when imported as a module).
if importlib.util.find_spec("dsfn") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus
import runner
import torch

import dsfn
from dsfn import checkpoint
from dsfn.models import generate, gpt_loss
from dsfn.ops import tile_mlps
from dsfn.runtime import init_mesh
from dsfn.transforms import (
    clip_grad_norm,
    compose,
    sequence_parallel,
    shard_zero,
    tensor_parallel,
)

# LlamaConfig fields of the presets. 8 query / 4 key-value heads: tp 1, 2 and 4 divide both
# (tp x sp up to 8: sp replicates key/value heads where a tp rank has fewer than sp).
# intermediate_size 344 does not divide by 4 (nor 172 by 8): tensor_parallel pads the split.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, seq_len=64),
    "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, seq_len=128),
}

DEFAULTS: dict[str, Any] = dict(
    model="small",
    steps=150,
    tp=2,
    dp=1,
    sp=1,                 # sequence-parallel degree (Ulysses); ranks = dp * tp * sp
    zero=0,
    tiled_mlp=0,          # sequence tiles of each MLP (0: untiled)
    seq_len=None,         # None: the preset's length
    batch_size=16,        # global: split over dp (every rank of a tp group gets the same rows)
    lr=3e-3,
    warmup=10,
    weight_decay=0.1,
    seed=0,
    out="runs/train_llama",
    max_bytes=8_000_000,
    eval_batches=8,
    prompt="def ",
    sample_tokens=120,
    temperature=0.8,
    remat=False,          # activation checkpointing of the decoder layers (remat())
    remat_offload=False,  # ... with their inputs in host memory (remat(offload="cpu"))
    remat_policy="nothing",
    device="auto",        # "auto": dsfn.runtime.device() (this rank's GPU under torchrun), "cpu", "cuda[:N]"
)


def llama_config(model: str = DEFAULTS["model"], seq_len: int | None = None):
    """The `transformers.LlamaConfig` of a preset: byte-level (vocab 256), untied LM head.
    `seq_len` (default: the preset's) is the training length and max_position_embeddings."""
    import transformers
    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; choose one of {sorted(PRESETS)}")
    p = dict(PRESETS[model])
    preset_len = p.pop("seq_len")
    seq_len = preset_len if seq_len is None else seq_len
    cfg = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=seq_len, use_cache=False,
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None, **p)
    cfg.architectures = ["LlamaForCausalLM"]          # so AutoModelForCausalLM also loads the export
    return cfg


def build_model(cfg, seed: int):
    """The same random init on every rank (same seed)."""
    import transformers
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(cfg)


def check_batch(max_bytes: int, seq_len: int, seed: int = DEFAULTS["seed"], batch_size: int = 4
                ) -> dict[str, torch.Tensor]:
    """A fixed batch of held-out windows: main reports the trained model's loss on it
    (`summary["check_loss"]`), so the exported HF model can be checked against it."""
    _, val = corpus.train_val_split(corpus.load_corpus(max_bytes), val_fraction=0.05)
    return _check_batch(val, seq_len, seed, batch_size)


def _check_batch(val_data: torch.Tensor, seq_len: int, seed: int, batch_size: int = 4) -> dict[str, torch.Tensor]:
    return next(corpus.batches(val_data, batch_size, seq_len, seed=seed + 2))


def main(model: str = DEFAULTS["model"], steps: int = DEFAULTS["steps"], tp: int = DEFAULTS["tp"],
         dp: int = DEFAULTS["dp"], sp: int = DEFAULTS["sp"], zero: int = DEFAULTS["zero"],
         tiled_mlp: int = DEFAULTS["tiled_mlp"], seq_len: int | None = DEFAULTS["seq_len"],
         batch_size: int = DEFAULTS["batch_size"],
         lr: float = DEFAULTS["lr"], warmup: int = DEFAULTS["warmup"],
         weight_decay: float = DEFAULTS["weight_decay"], seed: int = DEFAULTS["seed"],
         out: str | Path = DEFAULTS["out"], max_bytes: int = DEFAULTS["max_bytes"],
         eval_batches: int = DEFAULTS["eval_batches"], prompt: str = DEFAULTS["prompt"],
         sample_tokens: int = DEFAULTS["sample_tokens"], temperature: float = DEFAULTS["temperature"],
         remat: bool = DEFAULTS["remat"], remat_offload: bool = DEFAULTS["remat_offload"],
         remat_policy: str = DEFAULTS["remat_policy"], device: str = DEFAULTS["device"], progress: bool = True,
         verbose: bool = True) -> dict[str, Any]:
    """Train on dp*tp*sp ranks, write metrics.jsonl / loss.png / summary.json / ckpt / hf under
    `out`, return the summary.

    `batch_size` is the global batch (sequences per step); it must be a multiple of `dp`.
    `seq_len` (default: the preset's) is the sequence length; sp > 1 splits every sequence
    over sp ranks (Ulysses); `tiled_mlp` > 0 runs each MLP over that many sequence tiles.
    dp*tp*sp == 1 trains in this process; more ranks run as local gloo processes
    (`dsfn.launch.spawn`). When this process is already one rank of a launched job (torchrun
    or `python -m dsfn.launch`), it trains as that rank and the job's world size must be
    dp*tp*sp; ranks other than 0 return {}. `device` ("auto": `dsfn.runtime.device()`, the
    rank's GPU under torchrun on GPUs) is where the model, batches and state live.
    """
    runner.check_device({"device": device})
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if tp < 1 or dp < 1 or sp < 1:
        raise ValueError(f"tp, dp and sp must be >= 1, got tp={tp}, dp={dp}, sp={sp}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if tiled_mlp < 0:
        raise ValueError(f"tiled_mlp must be >= 0 (0: untiled), got {tiled_mlp}")
    if seq_len is not None and seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if batch_size % dp:
        raise ValueError(f"batch_size={batch_size} must be a multiple of dp={dp}")
    if remat_policy not in ("nothing", "matmuls"):
        raise ValueError(f"remat_policy must be 'nothing' or 'matmuls', got {remat_policy!r}")
    cfg = llama_config(model, seq_len)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % (tp * sp) or kv_heads % tp:
        # tensor parallelism splits query and key/value heads over tp; Ulysses splits a tp rank's
        # query heads over sp, replicating key/value heads where there are fewer than sp
        raise ValueError(f"tp*sp = {tp}*{sp} = {tp * sp} must divide the {heads} query heads and tp = {tp} the "
                         f"{kv_heads} key/value heads of model {model!r}; valid tp: "
                         f"{[d for d in range(1, heads + 1) if heads % d == 0 and kv_heads % d == 0]}, valid tp*sp: "
                         f"{[d for d in range(1, heads + 1) if heads % d == 0]}")
    seq_len = cfg.max_position_embeddings
    world_size = dp * tp * sp
    launched = dsfn.runtime.init_distributed()          # False unless started by a launcher
    if launched and dsfn.runtime.world_size() != world_size:
        raise ValueError(f"the launcher started {dsfn.runtime.world_size()} ranks but dp*tp*sp = {dp}*{tp}*{sp} = "
                         f"{world_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    data = corpus.load_corpus(max_bytes)
    train_data, val_data = corpus.train_val_split(data, val_fraction=0.05)
    if len(val_data) <= seq_len:       # the held-out 5% must hold a window of seq_len + 1 bytes
        raise ValueError(f"seq_len={seq_len} needs a longer corpus: its held-out 5% has {len(val_data)} bytes "
                         f"(max_bytes={max_bytes}, corpus {len(data)} bytes); raise max_bytes")
    name = f"llama-{model} tp{tp} dp{dp}" + (f" sp{sp}" if sp > 1 else "") + f" zero{zero}"
    run = dict(cfg=cfg, model=name, preset=model, steps=steps, world_size=world_size, tp=tp, dp=dp, sp=sp,
               zero=zero, tiled_mlp=tiled_mlp, seq_len=seq_len, batch_size=batch_size, lr=lr, warmup=warmup,
               weight_decay=weight_decay, seed=seed, out=str(out), eval_batches=eval_batches, prompt=prompt,
               sample_tokens=sample_tokens, temperature=temperature, progress=progress,
               remat=remat, remat_offload=remat_offload, remat_policy=remat_policy,
               device=device, corpus_bytes=len(data))

    result = runner.launch(_train, train_data, val_data, run, launched)
    if not result:                                      # ranks other than 0
        return {}
    result["wall_s"] = time.perf_counter() - t0
    return runner.finish(out, result, run, _title(run, result["num_params"]),
                         summarize=_summary, report=format_summary, verbose=verbose)


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float) -> Any:
    """AdamW (betas 0.9/0.95) with train_gpt's schedule (DeepSpeed's WarmupCosineLR: linear
    warmup to `lr`, cosine to lr/10). Unlike train_gpt's, no clipping in the optimizer: the
    `clip_grad_norm` transform clips by the norm over all tp / ZeRO shards."""
    schedule = dsfn.optim.WarmupCosineLR(base_lr=lr, total_num_steps=steps, warmup_num_steps=warmup,
                                         warmup_type="linear", cos_min_ratio=0.1)
    return dsfn.optim.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=weight_decay)


def _train(train_data: torch.Tensor, val_data: torch.Tensor, run: dict[str, Any]) -> dict[str, Any]:
    """One rank's training run (also the whole run when dp*tp*sp == 1).

    Every rank draws the same global batches; sequence_parallel gives each its sp slice of
    every sequence, shard_zero its dp rows; the ranks of a tp group share them. Rank 0 logs,
    evaluates and exports; its return value is the run's result.
    """
    cfg = run["cfg"]
    init_mesh(dp=run["dp"], tp=run["tp"], sp=run["sp"])   # every rank builds the same mesh
    rank = dsfn.runtime.rank()
    device = runner.compute_device(run)
    model = build_model(cfg, run["seed"]).to(device)       # on the GPU before functionalize
    if run["tiled_mlp"]:
        # Each decoder layer's .mlp runs over sequence tiles, recomputed tile by tile in
        # backward: at most one tile's [B, T/tiles, intermediate] activations are alive.
        # Parameter names (and so the tp plan, checkpoints and the HF export) are unchanged.
        tile_mlps(model, run["tiled_mlp"])
    apply_fn, params = dsfn.functionalize(model)
    num_params = sum(p.numel() for p in params.values())
    tx = make_optimizer(run["lr"], run["warmup"], run["steps"], run["weight_decay"])

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        # [B/dp, T/sp, V]; under sp the model also gets its slice's global position_ids.
        # labels are already next-token targets (ignore_index -100: sp's padding).
        logits = apply_fn(params, batch["input_ids"]).logits
        return gpt_loss(logits, batch["labels"])

    def train_step(state: dsfn.TrainState, batch: dict[str, torch.Tensor]):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    transforms = [shard_zero(run["zero"]), tensor_parallel("auto", model=model),
                  *runner.remat_transforms(run), clip_grad_norm(1.0)]
    if run["sp"] > 1:                 # outermost: it splits the batch before ZeRO sees it
        transforms.insert(0, sequence_parallel(labels_key="labels", shift_labels=False, ignore_index=-100))
    step = compose(*transforms, donate=True)(train_step)   # the new state reuses the old one's buffers
    state = step.init_state(params, tx, seed=run["seed"])   # this rank's shards only
    del params

    seq_len = cfg.max_position_embeddings
    tokens_per_step = run["batch_size"] * seq_len
    data_iter = corpus.batches(train_data, run["batch_size"], seq_len, seed=run["seed"])
    state, train_s = runner.train_loop(step, state, data_iter, run, tokens_per_step, rank,
                                       record_metrics=("lr", "grad_norm"))

    # Save the sharded state (collective: every rank writes its own slices), then take the
    # logical state (also collective) for evaluation.
    ckpt_dir = Path(run["out"]) / "ckpt"
    checkpoint.save(ckpt_dir, state, keep=1)
    final = step.gather(state)
    if rank != 0:
        return {}
    hf_dir = Path(run["out"]) / "hf"
    checkpoint.export(ckpt_dir, hf_dir, format="hf", config=model.config)

    model.eval()
    with torch.no_grad():
        logits_fn = lambda ids: apply_fn(final.params, ids.to(device)).logits.cpu()
        val_loss = runner.evaluate(logits_fn, val_data, seq_len, run["batch_size"], run["eval_batches"],
                                   seed=run["seed"] + 1)
        check_loss = float(loss_fn(final.params, runner.to_device(_check_batch(val_data, seq_len, run["seed"]),
                                                                  device)))
        prompt = corpus.encode(run["prompt"])[None]
        sample = generate(logits_fn, prompt, run["sample_tokens"], seq_len, temperature=run["temperature"],
                          generator=torch.Generator().manual_seed(run["seed"]))
    return {"train_s": train_s, "val_loss": val_loss, "check_loss": check_loss, "hf_dir": str(hf_dir),
            "ckpt_dir": str(ckpt_dir), "sample": corpus.decode(sample[0]), "num_params": num_params}


def _title(run: dict[str, Any], num_params: int) -> str:
    cfg = run["cfg"]
    return (f"Llama '{run['preset']}' ({num_params / 1e6:.2f}M params) on stdlib bytes, tp {run['tp']} x dp "
            f"{run['dp']} x sp {run['sp']}, ZeRO-{run['zero']}"
            + (f", MLP in {run['tiled_mlp']} tiles" if run["tiled_mlp"] else "")
            + f", batch {run['batch_size']}x{cfg.max_position_embeddings}")


def _summary(result: dict[str, Any], metrics: list[dict[str, Any]], run: dict[str, Any],
             out: Path) -> dict[str, Any]:
    seq_len = run["cfg"].max_position_embeddings
    tokens = run["steps"] * run["batch_size"] * seq_len
    return {
        "model": run["preset"], "num_params": result["num_params"], "tp": run["tp"], "dp": run["dp"],
        "sp": run["sp"], "zero": run["zero"], "tiled_mlp": run["tiled_mlp"], "world_size": run["world_size"],
        "remat": " ".join(runner.remat_name(run)) or None,
        "steps": run["steps"],
        "global_batch": run["batch_size"], "seq_len": seq_len, "seed": run["seed"],
        "corpus_bytes": run["corpus_bytes"],
        **runner.loss_stats(metrics), "val_loss": result["val_loss"], "check_loss": result["check_loss"],
        **runner.speed_stats(result, tokens),
        "prompt": run["prompt"], "temperature": run["temperature"], "sample": result["sample"],
        "hf_dir": result["hf_dir"],
        "files": {name: str(out / name) for name in ("metrics.jsonl", "loss.png", "summary.json")}
        | {"ckpt": result["ckpt_dir"], "hf": result["hf_dir"]},
    }


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run report printed by `main`."""
    header = (f"== train_llama: '{s['model']}' Llama, {s['num_params'] / 1e6:.2f}M params, tp {s['tp']} x dp "
              f"{s['dp']} x sp {s['sp']} = {s['world_size']} rank(s), ZeRO-{s['zero']}"
              + (f", MLP in {s['tiled_mlp']} tiles" if s["tiled_mlp"] else "")
              + (f", {s['remat']}" if s.get("remat") else "")
              + f", {s['steps']} steps of {s['global_batch']}x{s['seq_len']} tokens")
    return runner.format_report(s, header, [
        (f"  files       {runner.file_names(s)}; "
         f"checkpoint in {s['files']['ckpt']}"),
        f"  HF model    {s['hf_dir']}  (transformers.LlamaForCausalLM.from_pretrained(...))",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULTS["model"], choices=sorted(PRESETS), help="Llama size preset")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--tp", type=int, default=DEFAULTS["tp"], help="tensor-parallel degree")
    p.add_argument("--dp", type=int, default=DEFAULTS["dp"], help="data-parallel degree (ranks = dp * tp * sp)")
    p.add_argument("--sp", type=int, default=DEFAULTS["sp"],
                   help="sequence-parallel degree (Ulysses; sp * tp must divide the attention heads)")
    p.add_argument("--zero", type=int, default=DEFAULTS["zero"], choices=(0, 1, 2, 3), help="ZeRO stage over dp")
    p.add_argument("--tiled-mlp", type=int, default=DEFAULTS["tiled_mlp"],
                   help="run each MLP over this many sequence tiles, recomputed in backward (0: off)")
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                   help="sequence length, also the config's max_position_embeddings (None: the preset's)")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="global batch in sequences (split over dp)")
    runner.add_optim_and_data_args(p, DEFAULTS)
    p.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"],
                   help="validation batches at the end")
    p.add_argument("--prompt", default=DEFAULTS["prompt"], help="prompt of the generated sample")
    p.add_argument("--sample-tokens", type=int, default=DEFAULTS["sample_tokens"], help="bytes to generate")
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                   help="sampling temperature of the sample text (0 = greedy)")
    runner.add_remat_args(p)
    runner.add_device_arg(p)
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the progress bar%(default).0s")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(**vars(parse_args()))
