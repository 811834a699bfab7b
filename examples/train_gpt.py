"""Train a small GPT on the Python standard library's source code, on CPU, with dsfn.

    python examples/train_gpt.py                      # 2 local ranks, data parallel, ~1-2 min
    python examples/train_gpt.py --world-size 1       # one process
    python examples/train_gpt.py --model tiny --steps 50
    python -m dsfn.launch --nproc 2 examples/train_gpt.py   # or torchrun: ranks started outside
    python examples/train_gpt.py --steps 400 --resume # continue from the last checkpoint

The model sees bytes (vocab 256) of the stdlib's *.py files (see `corpus.py`); the last
5% of the files are held out for validation. The training step is written once, for
one device, and `dsfn.compose(data_parallel())` runs it on every rank: each rank takes
its rows of the global batch, gradients are averaged over ranks, metrics come back
averaged.

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
import json
import math
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
import torch

import dsfn
from dsfn.models import GPT, GPTConfig, generate, gpt_loss
from dsfn import checkpoint
from dsfn.transforms import async_checkpoint, data_parallel

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
)


def main(model: str = DEFAULTS["model"], steps: int = DEFAULTS["steps"],
         world_size: int = DEFAULTS["world_size"], batch_size: int = DEFAULTS["batch_size"],
         lr: float = DEFAULTS["lr"], warmup: int = DEFAULTS["warmup"],
         weight_decay: float = DEFAULTS["weight_decay"], seed: int = DEFAULTS["seed"],
         out: str | Path = DEFAULTS["out"], max_bytes: int = DEFAULTS["max_bytes"],
         eval_batches: int = DEFAULTS["eval_batches"], prompt: str = DEFAULTS["prompt"],
         sample_tokens: int = DEFAULTS["sample_tokens"],
         temperature: float = DEFAULTS["temperature"], ckpt_every: int = DEFAULTS["ckpt_every"],
         resume: bool = DEFAULTS["resume"], progress: bool = True, verbose: bool = True) -> dict[str, Any]:
    """Train, write metrics.jsonl / loss.png / summary.json under `out`, return the summary.

    `batch_size` is the global batch (sequences per step, over all ranks); it must be a
    multiple of `world_size`. `world_size=1` trains in this process; more ranks run as
    local gloo processes (`dsfn.launch.spawn`). When this process is already one rank of
    a launched job (torchrun or `python -m dsfn.launch` set RANK, WORLD_SIZE, ...), it
    trains as that rank and `world_size` is the job's; ranks other than 0 return {}.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if ckpt_every < 0:
        raise ValueError(f"ckpt_every must be >= 0 (0 = no checkpoints), got {ckpt_every}")
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
               progress=progress, corpus_bytes=len(data))

    if launched or world_size == 1:
        try:
            result = _train(train_data, val_data, run)      # this process is the (or a) rank
        finally:
            if launched:
                # We joined the group, so we leave it: a process that exits with a live gloo
                # group can abort in its destructors ("terminate called ..."). The barrier
                # keeps a fast rank from closing its sockets while a peer still reads them.
                dsfn.runtime.collectives.barrier()
                dsfn.runtime.env.shutdown()
        if not result:                                      # ranks other than 0
            return {}
    else:
        # Forked ranks share the corpus tensor copy-on-write; one torch thread each.
        results = dsfn.launch.spawn(_train, world_size, args=(train_data, val_data, run),
                                    timeout=max(600.0, 10.0 * steps))
        result = results[0]
    result["wall_s"] = time.perf_counter() - t0

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    plot_loss(metrics, out / "loss.png", title=_title(cfg, model, world_size, batch_size),
              val_loss=result["val_loss"])
    summary = _summary(result, metrics, run, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if verbose:
        print(format_summary(summary))
    return summary


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float) -> Any:
    """Clip the global gradient norm to 1, then AdamW (betas 0.9/0.95, the usual GPT choice).

    The lr follows DeepSpeed's WarmupCosineLR: linear warmup over `warmup` steps to `lr`, then
    a cosine to lr/10 at `steps` (DeepSpeed's first update uses lr 0; dsfn keeps that).
    """
    schedule = dsfn.optim.WarmupCosineLR(base_lr=lr, total_num_steps=steps, warmup_num_steps=warmup,
                                         warmup_type="linear", cos_min_ratio=0.1)
    return dsfn.optim.chain(dsfn.optim.clip_by_global_norm(1.0),
                            dsfn.optim.adamw(lr=schedule, betas=(0.9, 0.95), weight_decay=weight_decay))


def _train(train_data: torch.Tensor, val_data: torch.Tensor, run: dict[str, Any]) -> dict[str, Any]:
    """One rank's training run (also the whole run when world_size == 1).

    Every rank draws the same global batches; data_parallel gives each its rows.
    Rank 0 logs and evaluates; its return value is the run's result.
    """
    cfg: GPTConfig = run["cfg"]
    rank = dsfn.runtime.rank()
    model = GPT(cfg, seed=run["seed"])
    apply_fn, params = dsfn.functionalize(model)
    tx = make_optimizer(run["lr"], run["warmup"], run["steps"], run["weight_decay"])
    state = dsfn.TrainState.create(params, tx=tx, seed=run["seed"])

    def loss_fn(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = apply_fn(params, batch["input_ids"])          # [B/world, T, V]
        return gpt_loss(logits, batch["labels"])

    def train_step(state: dsfn.TrainState, batch: dict[str, torch.Tensor]):
        loss, grads = dsfn.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads), {"loss": loss}

    ckpt_dir = Path(run["out"]) / "ckpt"
    ckpt = async_checkpoint(ckpt_dir, every=run["ckpt_every"], keep=2) if run["ckpt_every"] else None
    step = dsfn.compose(*([ckpt] if ckpt else []), data_parallel())(train_step)
    state = step.place(state)
    first = 0
    if run["resume"]:
        state = checkpoint.load(ckpt_dir, like=state)    # this layout, whatever the saved one was
        first = int(state.step)

    tokens_per_step = run["batch_size"] * cfg.seq_len
    data_iter = corpus.batches(train_data, run["batch_size"], cfg.seq_len, seed=run["seed"])
    for _ in range(first):                               # the batches the checkpointed steps used
        next(data_iter)
    log = _metrics_log(Path(run["out"]) / "metrics.jsonl", first if run["resume"] else None) if rank == 0 else None
    bar = _progress_bar(run, first) if rank == 0 else None
    start = time.perf_counter()
    try:
        for i in range(first, run["steps"]):
            batch = next(data_iter)
            t = time.perf_counter()
            state, metrics = step(state, batch)
            dt = time.perf_counter() - t
            if rank != 0:
                continue
            record = {"step": i + 1, "loss": float(metrics["loss"]),
                      "lr": float(metrics["lr"]) if "lr" in metrics else None,
                      "tokens_per_s": tokens_per_step / dt,
                      "elapsed": time.perf_counter() - start}
            log.write(json.dumps(record) + "\n")
            if bar is not None:       # tokens/s averaged over the run so far: steadier than per step
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                tok_s=f"{tokens_per_step * (i + 1 - first) / record['elapsed']:,.0f}", refresh=False)
                bar.update(1)
        if ckpt is not None:
            ckpt.wait()                      # the last save is committed (or its error raised)
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    train_s = time.perf_counter() - start

    final = step.gather(state)               # logical state: every rank takes part
    if rank != 0:
        return {}
    model.eval()
    logits_fn = lambda ids: apply_fn(final.params, ids)
    val_loss = evaluate(logits_fn, val_data, cfg.seq_len, run["batch_size"], run["eval_batches"],
                        seed=run["seed"] + 1)
    prompt = corpus.encode(run["prompt"])[None]          # [1, T0]
    sample = generate(logits_fn, prompt, run["sample_tokens"], cfg.seq_len, temperature=run["temperature"],
                      generator=torch.Generator().manual_seed(run["seed"]))
    return {"train_s": train_s, "val_loss": val_loss, "sample": corpus.decode(sample[0]),
            "num_params": sum(p.numel() for p in params.values())}


@torch.no_grad()
def evaluate(logits_fn, data: torch.Tensor, seq_len: int, batch_size: int, n_batches: int,
             seed: int) -> float:
    """Mean loss over `n_batches` fixed random windows of `data` (uint8[N])."""
    it = corpus.batches(data, batch_size, seq_len, seed=seed)
    losses = [gpt_loss(logits_fn(b["input_ids"]), b["labels"]).item() for b, _ in zip(it, range(n_batches))]
    return sum(losses) / len(losses)


def _progress_bar(run: dict[str, Any], first: int = 0):
    if not run["progress"]:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=run["steps"], initial=first, desc=f"train {run['model']} x{run['world_size']}",
                unit="step", dynamic_ncols=True)


def _metrics_log(path: Path, keep_through: int | None):
    """metrics.jsonl opened for writing; on resume, the records after the checkpoint's step go
    (a crashed run may have logged steps that the resumed run repeats)."""
    if keep_through is None or not path.exists():
        return open(path, "w")
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= keep_through]
    f = open(path, "w")
    f.write("".join(line + "\n" for line in kept))
    return f


def _title(cfg: GPTConfig, model: str, world_size: int, batch_size: int) -> str:
    return (f"GPT '{model}' ({cfg.num_params() / 1e6:.2f}M params) on stdlib bytes, "
            f"{world_size} rank{'s' if world_size > 1 else ''}, batch {batch_size}x{cfg.seq_len}")


def plot_loss(metrics: list[dict[str, Any]], path: Path, title: str = "",
              val_loss: float | None = None) -> None:
    """Training loss per step (raw and smoothed) and the final validation loss, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")                    # no display needed
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    loss = [m["loss"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=1, label="train loss")
    half = max(1, len(loss) // 40)
    ax.plot(steps, _moving_average(loss, half), color="tab:blue", lw=2,
            label=f"train loss (mean of {2 * half + 1} steps)")
    if val_loss is not None:
        ax.scatter([steps[-1]], [val_loss], color="tab:red", zorder=3, label=f"val loss {val_loss:.3f}")
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform over bytes (ln 256)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _moving_average(xs: list[float], half: int) -> list[float]:
    """Centered mean over +-`half` points (shrinking at the ends): smooths without lagging."""
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _summary(result: dict[str, Any], metrics: list[dict[str, Any]], run: dict[str, Any],
             out: Path) -> dict[str, Any]:
    losses = [m["loss"] for m in metrics]
    tail = losses[-max(1, len(losses) // 10):]          # smooth the last value over ~10% of steps
    tokens = run["steps"] * run["batch_size"] * run["cfg"].seq_len
    return {
        "model": run["model"], "num_params": result["num_params"], "world_size": run["world_size"],
        "steps": run["steps"], "global_batch": run["batch_size"], "seq_len": run["cfg"].seq_len,
        "corpus_bytes": run["corpus_bytes"],
        "initial_loss": losses[0], "final_loss": sum(tail) / len(tail), "last_loss": losses[-1],
        "val_loss": result["val_loss"],
        "tokens": tokens, "tokens_per_s": tokens / result["train_s"],
        "train_s": result["train_s"], "wall_s": result["wall_s"],
        "prompt": run["prompt"], "temperature": run["temperature"], "sample": result["sample"],
        "files": {name: str(out / name) for name in ("metrics.jsonl", "loss.png", "summary.json")}
        | ({"ckpt": str(out / "ckpt")} if run["ckpt_every"] else {}),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run report printed by `main`."""
    sample = s["sample"].replace("\t", "    ")
    how = "greedy" if s["temperature"] == 0 else f"sampled (T={s['temperature']})"
    header = (f"== train_gpt: '{s['model']}' GPT, {s['num_params'] / 1e6:.2f}M params, "
              f"{s['world_size']} rank(s) with data_parallel, {s['steps']} steps of "
              f"{s['global_batch']}x{s['seq_len']} tokens")
    return "\n".join([
        "",
        header,
        (f"  train loss  {s['initial_loss']:.3f} -> {s['final_loss']:.3f}  "
         f"(first step -> mean of the last 10%; ln 256 = {math.log(256):.3f})"),
        f"  val loss    {s['val_loss']:.3f}  (held-out stdlib files)",
        f"  throughput  {s['tokens_per_s']:,.0f} tokens/s over all ranks",
        f"  time        {s['wall_s']:.1f} s wall ({s['train_s']:.1f} s in the training loop)",
        f"  files       {Path(s['files']['metrics.jsonl']).parent}/{{metrics.jsonl, loss.png, summary.json}}"
        + (f"; checkpoints in {s['files']['ckpt']} (--resume continues)" if "ckpt" in s["files"] else ""),
        f"  sample      {how} continuation of {s['prompt']!r}:",
        *("    | " + line for line in sample.splitlines()),
        "",
    ])


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
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="peak learning rate")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=DEFAULTS["weight_decay"], help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="model init, data order and sample")
    p.add_argument("--out", default=DEFAULTS["out"], help="output directory")
    p.add_argument("--max-bytes", type=int, default=DEFAULTS["max_bytes"], help="corpus size cap")
    p.add_argument("--prompt", default=DEFAULTS["prompt"], help="prompt of the generated sample")
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                   help="sampling temperature of the sample text (0 = greedy)")
    p.add_argument("--ckpt-every", type=int, default=DEFAULTS["ckpt_every"],
                   help="save a checkpoint to OUT/ckpt every N steps, in the background (0 = never)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in OUT/ckpt up to --steps%(default).0s")
    # "%(default).0s" prints nothing; it stops the formatter adding a confusing "(default: True)".
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the progress bar%(default).0s")
    return p.parse_args(argv)


def _presets() -> list[str]:
    from dsfn.models.gpt import PRESETS
    return list(PRESETS)


if __name__ == "__main__":
    main(**vars(parse_args()))
