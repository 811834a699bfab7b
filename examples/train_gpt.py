"""Train a small GPT on the Python standard library's source code, on CPU, with dsfn.

    python examples/train_gpt.py                      # 2 local ranks, data parallel, ~1-2 min
    python examples/train_gpt.py --world-size 1       # one process
    python examples/train_gpt.py --model tiny --steps 50
    python -m dsfn.launch --nproc 2 examples/train_gpt.py   # or torchrun: ranks started outside
    python examples/train_gpt.py --steps 400 --resume # continue from the last checkpoint
    python examples/train_gpt.py --zero 3 --offload nvme --zenflow   # ZeRO-3, state in files, ZenFlow
    python examples/train_gpt.py --remat-offload      # activation checkpointing, block inputs on the host

The model sees bytes (vocab 256) of the stdlib's *.py files (see `corpus.py`); the last
5% of the files are held out for validation. The training step is written once, for
one device, and `dsfn.compose(data_parallel())` runs it on every rank: each rank takes
its rows of the global batch, gradients are averaged over ranks, metrics come back
averaged.

Other stacks: `--zero N` shards with `shard_zero(N)` instead of `data_parallel()`, `--offload
cpu|nvme` keeps the optimizer state in host memory or in files under OUT/nvme (the update
runs on the host), `--zenflow` adds ZenFlow's selective updates (top 10% of columns on the
device every step, the rest from the host every 4 steps); with it the gradient clipping
moves from the optimizer to the `clip_grad_norm` transform, which sees the whole gradient.
`--remat` adds `remat()` (activation checkpointing: each Block keeps only its input and is
recomputed in backward; the same losses, less activation memory, ~1 more forward per step),
`--remat-offload` `remat(offload="cpu")` (the kept inputs in host memory), `--remat-policy
matmuls` saves the matmul outputs too.

Checkpoints: `async_checkpoint` saves the whole training state (params, AdamW moments,
step, every rank's RNG) to --out/ckpt every --ckpt-every steps in the background, keeping
the newest 2. `--resume` loads the latest one (into any world size) and continues to
--steps; the data stream is skipped ahead by the state's step, so a resumed run sees the
batches the uninterrupted run would have (and at the same world size, its losses exactly).

Outputs (in --out, default runs/train_gpt): metrics.jsonl (one JSON object per step),
loss.png (the loss curve), summary.json (what the summary printed at the end says), ckpt/.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

# Running as `python examples/train_gpt.py` from a checkout without `pip install -e .`:
# make the repository's dsfn importable.
if importlib.util.find_spec("dsfn") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if str(Path(__file__).resolve().parent) not in sys.path:     # `corpus` when imported as a module
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import corpus
import runner
import torch

import dsfn
from dsfn.models import GPT, GPTConfig, generate, gpt_loss
from dsfn import checkpoint
from dsfn.transforms import async_checkpoint, clip_grad_norm, data_parallel, offload, shard_zero, zenflow

DEFAULTS: dict[str, Any] = dict(
    model="small",
    steps=200,
    world_size=2,
    batch_size=32,        # global: split over the ranks
    lr=2e-3,
    warmup=10,
    weight_decay=0.1,
    seed=0,
    out="runs/train_gpt",
    max_bytes=8_000_000,  # corpus size: the first 8 MB of the stdlib's sources
    eval_batches=16,
    prompt="def ",
    sample_tokens=160,
    temperature=0.8,      # 0 = greedy; a small model's greedy text soon loops on one phrase
    ckpt_every=50,        # 0 = no checkpoints
    resume=False,
    zero=0,               # 0: data_parallel(); 1-3: shard_zero(N)
    offload="none",       # "cpu" | "nvme": optimizer state on the host / in files
    zenflow=False,
    remat=False,          # activation checkpointing of the Blocks (remat())
    remat_offload=False,  # ... with their inputs in host memory (remat(offload="cpu"))
    remat_policy="nothing",
    device="auto",        # "auto": dsfn.runtime.device() (this rank's GPU under torchrun), "cpu", "cuda[:N]"
)


def main(model: str = DEFAULTS["model"], steps: int = DEFAULTS["steps"],
         world_size: int = DEFAULTS["world_size"], batch_size: int = DEFAULTS["batch_size"],
         lr: float = DEFAULTS["lr"], warmup: int = DEFAULTS["warmup"],
         weight_decay: float = DEFAULTS["weight_decay"], seed: int = DEFAULTS["seed"],
         out: str | Path = DEFAULTS["out"], max_bytes: int = DEFAULTS["max_bytes"],
         eval_batches: int = DEFAULTS["eval_batches"], prompt: str = DEFAULTS["prompt"],
         sample_tokens: int = DEFAULTS["sample_tokens"],
         temperature: float = DEFAULTS["temperature"], ckpt_every: int = DEFAULTS["ckpt_every"],
         resume: bool = DEFAULTS["resume"], zero: int = DEFAULTS["zero"], offload: str = DEFAULTS["offload"],
         zenflow: bool = DEFAULTS["zenflow"], remat: bool = DEFAULTS["remat"],
         remat_offload: bool = DEFAULTS["remat_offload"], remat_policy: str = DEFAULTS["remat_policy"],
         device: str = DEFAULTS["device"], progress: bool = True, verbose: bool = True) -> dict[str, Any]:
    """Train, write metrics.jsonl / loss.png / summary.json under `out`, return the summary.

    `batch_size` is the global batch (sequences per step, over all ranks); it must be a
    multiple of `world_size`. `world_size=1` trains in this process; more ranks run as
    local gloo processes (`dsfn.launch.spawn`). When this process is already one rank of
    a launched job (torchrun or `python -m dsfn.launch` set RANK, WORLD_SIZE, ...), it
    trains as that rank and `world_size` is the job's; ranks other than 0 return {}.
    `device` ("auto": `dsfn.runtime.device()`, the rank's GPU under torchrun on GPUs) is where
    the model, batches and state live.
    """
    runner.check_device({"device": device})
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0 (data_parallel) or a ZeRO stage 1-3, got {zero}")
    if offload not in ("none", "cpu", "nvme"):
        raise ValueError(f"offload must be 'none', 'cpu' or 'nvme', got {offload!r}")
    if ckpt_every < 0:
        raise ValueError(f"ckpt_every must be >= 0 (0 = no checkpoints), got {ckpt_every}")
    if remat_policy not in ("nothing", "matmuls"):
        raise ValueError(f"remat_policy must be 'nothing' or 'matmuls', got {remat_policy!r}")
    if resume and checkpoint.latest_step(Path(out) / "ckpt") is None:
        raise ValueError(f"--resume: no checkpoint under {Path(out) / 'ckpt'}; run without --resume first")
    launched = dsfn.runtime.init_distributed()          # False unless started by a launcher
    if launched:
        world_size = dsfn.runtime.world_size()
    if batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} must be a multiple of world_size={world_size}")
    cfg = GPTConfig.preset(model)
    if cfg.vocab_size < 256:
        raise ValueError(f"model {model!r} has vocab_size={cfg.vocab_size}; byte-level data needs >= 256")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    data = corpus.load_corpus(max_bytes)
    train_data, val_data = corpus.train_val_split(data, val_fraction=0.05)
    run = dict(cfg=cfg, model=model, steps=steps, world_size=world_size, batch_size=batch_size,
               lr=lr, warmup=warmup, weight_decay=weight_decay, seed=seed, out=str(out),
               eval_batches=eval_batches, prompt=prompt, sample_tokens=sample_tokens,
               temperature=temperature, ckpt_every=ckpt_every, resume=resume,
               zero=zero, offload=offload, zenflow=zenflow,
               remat=remat, remat_offload=remat_offload, remat_policy=remat_policy,
               device=device, progress=progress, corpus_bytes=len(data))

    result = runner.launch(_train, train_data, val_data, run, launched)
    if not result:                                      # ranks other than 0
        return {}
    result["wall_s"] = time.perf_counter() - t0
    return runner.finish(out, result, run, _title(cfg, model, world_size, batch_size),
                         summarize=_summary, report=format_summary, verbose=verbose)


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float, clip: bool = True) -> Any:
    """Clip the global gradient norm to 1, then AdamW (betas 0.9/0.95, the usual GPT choice).

    The lr follows DeepSpeed's WarmupCosineLR: linear warmup over `warmup` steps to `lr`, then
    a cosine to lr/10 at `steps` (DeepSpeed's first update uses lr 0; dsfn keeps that).
    """
    schedule = dsfn.optim.WarmupCosineLR(base_lr=lr, total_num_steps=steps, warmup_num_steps=warmup,
                                         warmup_type="linear", cos_min_ratio=0.1)
    adamw = dsfn.optim.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=weight_decay)
    return dsfn.optim.chain(dsfn.optim.clip_by_global_norm(1.0), adamw) if clip else adamw


def _train(train_data: torch.Tensor, val_data: torch.Tensor, run: dict[str, Any]) -> dict[str, Any]:
    """One rank's training run (also the whole run when world_size == 1).

    Every rank draws the same global batches; data_parallel gives each its rows.
    Rank 0 logs and evaluates; its return value is the run's result.
    """
    cfg: GPTConfig = run["cfg"]
    rank = dsfn.runtime.rank()
    device = runner.compute_device(run)
    model = GPT(cfg, seed=run["seed"]).to(device)          # on the GPU before functionalize
    apply_fn, params = dsfn.functionalize(model)
    # zenflow's optimizer sees column compacts and host pieces: the clip goes into the stack
    tx = make_optimizer(run["lr"], run["warmup"], run["steps"], run["weight_decay"], clip=not run["zenflow"])
    state = dsfn.TrainState.create(params, tx=tx, seed=run["seed"])

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = apply_fn(params, batch["input_ids"])          # [B/world, T, V]
        return gpt_loss(logits, batch["labels"])

    def train_step(state: dsfn.TrainState, batch: dict[str, torch.Tensor]):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    ckpt_dir = Path(run["out"]) / "ckpt"
    ckpt = async_checkpoint(ckpt_dir, every=run["ckpt_every"], keep=2) if run["ckpt_every"] else None
    # donate: each step writes the new state into the old one's buffers (one state in memory, not two)
    step = dsfn.compose(*([ckpt] if ckpt else []), *stack_of(run), donate=True)(train_step)
    state = step.place(state)
    first = 0
    if run["resume"]:
        state = checkpoint.load(ckpt_dir, like=state)    # this layout, whatever the saved one was
        first = int(state.step)

    tokens_per_step = run["batch_size"] * cfg.seq_len
    data_iter = corpus.batches(train_data, run["batch_size"], cfg.seq_len, seed=run["seed"])
    for _ in range(first):                               # the batches the checkpointed steps used
        next(data_iter)
    # metrics.jsonl keeps the checkpointed steps' records; after the last step, the last save is
    # committed (or its error raised) before the loop's time is taken.
    state, train_s = runner.train_loop(step, state, data_iter, run, tokens_per_step, rank, first=first,
                                       record_metrics=("lr",), on_done=ckpt.wait if ckpt else None)
    if ckpt is not None and checkpoint.latest_step(ckpt_dir) != int(state.step):
        # the last step is saved too (--steps below --ckpt-every, or not a multiple of it), so
        # the summary's checkpoints exist and --resume continues from where this run stopped
        checkpoint.save(ckpt_dir, state, keep=2)

    final = step.gather(state)               # logical state: every rank takes part
    if rank != 0:
        return {}
    model.eval()
    logits_fn = lambda ids: apply_fn(final.params, ids.to(device)).cpu()
    val_loss = runner.evaluate(logits_fn, val_data, cfg.seq_len, run["batch_size"], run["eval_batches"],
                               seed=run["seed"] + 1)
    prompt = corpus.encode(run["prompt"])[None]          # [1, T0]
    sample = generate(logits_fn, prompt, run["sample_tokens"], cfg.seq_len, temperature=run["temperature"],
                      generator=torch.Generator().manual_seed(run["seed"]))
    return {"train_s": train_s, "val_loss": val_loss, "sample": corpus.decode(sample[0]), "stack": _stack_name(run),
            "num_params": sum(p.numel() for p in params.values())}


def stack_of(run: dict[str, Any]) -> list[Any]:
    """The transforms --zero / --remat / --offload / --zenflow ask for, in dsfn's canonical order."""
    stack: list[Any] = [shard_zero(run["zero"]) if run["zero"] else data_parallel()]
    stack += runner.remat_transforms(run)        # inside data parallel / ZeRO
    if run["offload"] != "none":
        stack.append(offload(run["offload"], path=Path(run["out"]) / "nvme") if run["offload"] == "nvme"
                     else offload("cpu"))
    if run["zenflow"]:
        stack += [clip_grad_norm(1.0), zenflow(topk_ratio=0.1, update_interval=4)]
    return stack


def _stack_name(run: dict[str, Any]) -> str:
    """`stack_of(run)` in words (without making the transforms)."""
    names = [f"shard_zero({run['zero']})" if run["zero"] else "data_parallel"]
    names += runner.remat_name(run)
    names += [f"offload({run['offload']})"] if run["offload"] != "none" else []
    names += ["clip_grad_norm", "zenflow"] if run["zenflow"] else []
    return " + ".join(names)


def _title(cfg: GPTConfig, model: str, world_size: int, batch_size: int) -> str:
    return (f"GPT '{model}' ({cfg.num_params() / 1e6:.2f}M params) on stdlib bytes, "
            f"{world_size} rank{'s' if world_size > 1 else ''}, batch {batch_size}x{cfg.seq_len}")


def _summary(result: dict[str, Any], metrics: list[dict[str, Any]], run: dict[str, Any],
             out: Path) -> dict[str, Any]:
    tokens = run["steps"] * run["batch_size"] * run["cfg"].seq_len
    return {
        "model": run["model"], "num_params": result["num_params"], "world_size": run["world_size"],
        "stack": result["stack"],
        "steps": run["steps"], "global_batch": run["batch_size"], "seq_len": run["cfg"].seq_len,
        "corpus_bytes": run["corpus_bytes"],
        **runner.loss_stats(metrics), "val_loss": result["val_loss"],
        **runner.speed_stats(result, tokens),
        "prompt": run["prompt"], "temperature": run["temperature"], "sample": result["sample"],
        "files": {name: str(out / name) for name in ("metrics.jsonl", "loss.png", "summary.json")}
        | ({"ckpt": str(out / "ckpt")} if run["ckpt_every"] else {}),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run report printed by `main`."""
    header = (f"== train_gpt: '{s['model']}' GPT, {s['num_params'] / 1e6:.2f}M params, "
              f"{s['world_size']} rank(s) with {s['stack']}, {s['steps']} steps of "
              f"{s['global_batch']}x{s['seq_len']} tokens")
    files = (f"  files       {runner.file_names(s)}"
             + (f"; checkpoints in {s['files']['ckpt']} (--resume continues)" if "ckpt" in s["files"] else ""))
    return runner.format_report(s, header, [files])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULTS["model"], choices=sorted(_presets()),
                   help="GPT size preset (dsfn.models.GPTConfig.preset)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="optimizer steps")
    p.add_argument("--world-size", type=int, default=DEFAULTS["world_size"],
                   help="local ranks (gloo processes); 1 = this process")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="global batch in sequences (split over the ranks)")
    runner.add_optim_and_data_args(p, DEFAULTS)
    p.add_argument("--prompt", default=DEFAULTS["prompt"], help="prompt of the generated sample")
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                   help="sampling temperature of the sample text (0 = greedy)")
    p.add_argument("--ckpt-every", type=int, default=DEFAULTS["ckpt_every"],
                   help="save a checkpoint to OUT/ckpt every N steps, in the background (0 = never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in OUT/ckpt up to --steps%(default).0s")
    # "%(default).0s" prints nothing; it stops the formatter adding a confusing "(default: True)".
    p.add_argument("--zero", type=int, default=DEFAULTS["zero"], choices=(0, 1, 2, 3),
                   help="0: data_parallel(); 1-3: shard_zero(N) (ZeRO stage)")
    p.add_argument("--offload", default=DEFAULTS["offload"], choices=("none", "cpu", "nvme"),
                   help="optimizer state and master weights in host memory or in files under OUT/nvme")
    p.add_argument("--zenflow", action="store_true",
                   help="ZenFlow selective updates (top 10%% columns on the device, the rest every 4 steps)")
    runner.add_remat_args(p)
    runner.add_device_arg(p)
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the progress bar%(default).0s")
    return p.parse_args(argv)


def _presets() -> list[str]:
    from dsfn.models.gpt import PRESETS
    return list(PRESETS)


if __name__ == "__main__":
    main(**vars(parse_args()))
