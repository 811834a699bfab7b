"""What the training examples (`train_gpt.py`, `train_llama.py`) share: starting the ranks,
the step loop with its metrics log and progress bar, the validation loss, and the outputs
written at the end (loss.png, summary.json, the printed report).

Imported by the examples once they have put the repository's dsfn and this folder on sys.path.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import corpus
import torch

import dsfn
from dsfn.models import gpt_loss


def add_optim_and_data_args(p: Any, defaults: dict[str, Any]) -> None:
    """The examples' shared flags: --lr, --warmup, --weight-decay, --seed, --out, --max-bytes
    (defaults from the example's DEFAULTS)."""
    p.add_argument("--lr", type=float, default=defaults["lr"], help="peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults["warmup"], help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=defaults["weight_decay"], help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=defaults["seed"], help="model init, data order and sample")
    p.add_argument("--out", default=defaults["out"], help="output directory")
    p.add_argument("--max-bytes", type=int, default=defaults["max_bytes"], help="corpus size cap")


def add_device_arg(p: Any) -> None:
    """--device: where the model, batches and state live (default: the runtime's choice)."""
    p.add_argument("--device", default="auto",
                   help="compute device: auto (dsfn.runtime.device(): cuda:LOCAL_RANK under a launcher on GPUs, "
                        "else cpu), cpu, cuda or cuda:N")


def compute_device(run: dict[str, Any]) -> torch.device:
    """This rank's device for run["device"] ("auto" -> `dsfn.runtime.device()`, which picks the
    rank's GPU under torchrun; "cuda" -> that GPU too, or cuda:0 without a launcher)."""
    want = str(run.get("device", "auto"))
    if want == "auto":
        return dsfn.runtime.device()
    dev = torch.device(want)
    if dev.type == "cuda" and dev.index is None:
        rt = dsfn.runtime.device()
        return rt if rt.type == "cuda" else torch.device("cuda", 0)
    return dev


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A batch's tensors on `device` (non-blocking from the host: no wait for the GPU)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_device(run: dict[str, Any]) -> None:
    """ValueError for a --device this process cannot use (before any rank starts)."""
    want = str(run.get("device", "auto"))
    if want == "auto":
        return
    try:
        dev = torch.device(want)
    except RuntimeError:
        raise ValueError(f"--device {want!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {want}: CUDA is not available here; use --device cpu (or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {want}: the examples run on cpu or cuda")


def add_remat_args(p: Any) -> None:
    """--remat, --remat-offload, --remat-policy: activation checkpointing of the model's blocks
    (the `remat` transform)."""
    p.add_argument("--remat", action="store_true",
                   help="activation checkpointing: keep only each block's input, recompute the block in backward "
                        "(dsfn.transforms.remat)%(default).0s")
    p.add_argument("--remat-offload", action="store_true",
                   help="as --remat, with the kept block inputs in host memory (remat(offload='cpu'))%(default).0s")
    p.add_argument("--remat-policy", default="nothing", choices=("nothing", "matmuls"),
                   help="what --remat saves besides the block inputs: nothing, or the matmul outputs too")


def remat_transforms(run: dict[str, Any]) -> list[Any]:
    """[remat(...)] when run["remat"] or run["remat_offload"] asks for it, else []."""
    if not (run.get("remat") or run.get("remat_offload")):
        return []
    from dsfn.transforms import remat
    return [remat(policy=run.get("remat_policy", "nothing"), offload="cpu" if run.get("remat_offload") else None)]


def remat_name(run: dict[str, Any]) -> list[str]:
    """`remat_transforms(run)` in words."""
    if not (run.get("remat") or run.get("remat_offload")):
        return []
    opts = [f"policy={run.get('remat_policy', 'nothing')}"] if run.get("remat_policy", "nothing") != "nothing" else []
    opts += ["offload=cpu"] if run.get("remat_offload") else []
    return [f"remat({', '.join(opts)})"]


def launch(train_fn: Callable[..., dict[str, Any]], train_data: torch.Tensor, val_data: torch.Tensor,
           run: dict[str, Any], launched: bool) -> dict[str, Any]:
    """Run `train_fn(train_data, val_data, run)` on run["world_size"] ranks; return rank 0's result.

    When this process is already one rank of a launched job (`launched`: torchrun or
    `python -m dsfn.launch` started it) or world_size is 1, it trains here, and a launched rank
    leaves its process group afterwards; ranks other than 0 get {}. Otherwise the ranks run as
    local gloo processes (`dsfn.launch.spawn`).
    """
    if launched or run["world_size"] == 1:
        try:
            return train_fn(train_data, val_data, run)      # this process is the (or a) rank
        finally:
            if launched:
                # We joined the group, so we leave it: a process that exits with a live gloo
                # group can abort in its destructors ("terminate called ..."). The barrier
                # keeps a fast rank from closing its sockets while a peer still reads them.
                dsfn.runtime.collectives.barrier()
                dsfn.runtime.env.shutdown()
    # Forked ranks share the corpus tensor copy-on-write; one torch thread each.
    results = dsfn.launch.spawn(train_fn, run["world_size"], args=(train_data, val_data, run),
                                timeout=max(600.0, 10.0 * run["steps"]))
    return results[0]


def train_loop(step: Callable, state: Any, data_iter: Iterator[dict[str, torch.Tensor]],
               run: dict[str, Any], tokens_per_step: int, rank: int, *, first: int = 0,
               record_metrics: tuple[str, ...] = ("lr",),
               on_done: Callable[[], None] | None = None) -> tuple[Any, float]:
    """Steps first+1 .. run["steps"]: `state, metrics = step(state, next(data_iter))`.
    Returns (state, train_s), train_s the loop's seconds.

    Rank 0 writes one record per step to out/metrics.jsonl: {step, loss, the `record_metrics`
    (None where the step reports none), tokens_per_s, elapsed}, and drives the progress bar
    (unless run["progress"] is off). `first` > 0 continues a resumed run: the log keeps the
    records of steps <= first and drops later ones. `on_done` runs after the last step, inside
    the timed loop (train_gpt waits there for its last background checkpoint).
    """
    log = _metrics_log(Path(run["out"]) / "metrics.jsonl", keep_through=first) if rank == 0 else None
    bar = _progress_bar(run, first) if rank == 0 else None
    device = compute_device(run)
    start = time.perf_counter()
    try:
        for i in range(first, run["steps"]):
            batch = to_device(next(data_iter), device)
            t = time.perf_counter()
            state, metrics = step(state, batch)
            dt = time.perf_counter() - t
            if rank != 0:
                continue
            record = {"step": i + 1, "loss": float(metrics["loss"]),
                      **{k: float(metrics[k]) if k in metrics else None for k in record_metrics},
                      "tokens_per_s": tokens_per_step / dt,
                      "elapsed": time.perf_counter() - start}
            log.write(json.dumps(record) + "\n")
            if bar is not None:       # tokens/s averaged over the run so far: steadier than per step
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                tok_s=f"{tokens_per_step * (i + 1 - first) / record['elapsed']:,.0f}", refresh=False)
                bar.update(1)
        if on_done is not None:
            on_done()
    finally:
        if bar is not None:
            bar.close()
        if log is not None:
            log.close()
    return state, time.perf_counter() - start


def _progress_bar(run: dict[str, Any], first: int = 0):
    if not run["progress"]:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=run["steps"], initial=first, desc=f"train {run['model']} x{run['world_size']}",
                unit="step", dynamic_ncols=True)


def _metrics_log(path: Path, keep_through: int = 0):
    """metrics.jsonl opened for writing; on resume (`keep_through` > 0), the records after the
    checkpoint's step go (a crashed run may have logged steps that the resumed run repeats)."""
    if not keep_through or not path.exists():
        return open(path, "w")
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= keep_through]
    f = open(path, "w")
    f.write("".join(line + "\n" for line in kept))
    return f


@torch.no_grad()
def evaluate(logits_fn, data: torch.Tensor, seq_len: int, batch_size: int, n_batches: int,
             seed: int) -> float:
    """Mean loss over `n_batches` fixed random windows of `data` (uint8[N]); `logits_fn` takes
    host ids (it moves them to its device) and its logits may live anywhere."""
    it = corpus.batches(data, batch_size, seq_len, seed=seed)
    losses = [gpt_loss(logits_fn(b["input_ids"]).cpu(), b["labels"]).item() for b, _ in zip(it, range(n_batches))]
    return sum(losses) / len(losses)


def finish(out: Path, result: dict[str, Any], run: dict[str, Any], title: str,
           summarize: Callable[..., dict[str, Any]], report: Callable[[dict[str, Any]], str],
           verbose: bool) -> dict[str, Any]:
    """Rank 0's outputs after training; returns the summary.

    Writes `summarize(result, metrics, run, out)` to out/summary.json (always) and, when
    matplotlib is installed, plots out/metrics.jsonl and result["val_loss"] to out/loss.png
    (titled `title`; without matplotlib a one-line note says so and the summary lists no
    loss.png); if `verbose`, prints `report(summary)`.
    """
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = summarize(result, metrics, run, out)
    plotted = plot_loss(metrics, out / "loss.png", title=title, val_loss=result["val_loss"])
    if not plotted:
        summary["files"].pop("loss.png", None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if verbose:
        print(report(summary))
    return summary


def file_names(s: dict[str, Any]) -> str:
    """The report's `dir/{metrics.jsonl, loss.png, summary.json}` for the files summary `s` lists."""
    names = [n for n in ("metrics.jsonl", "loss.png", "summary.json") if n in s["files"]]
    return f"{Path(s['files']['metrics.jsonl']).parent}/{{{', '.join(names)}}}"


def loss_stats(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """The summary's training losses: the first step's, the mean over the last ~10% of steps
    (a smoothed final value) and the last step's."""
    losses = [m["loss"] for m in metrics]
    tail = losses[-max(1, len(losses) // 10):]
    return {"initial_loss": losses[0], "final_loss": sum(tail) / len(tail), "last_loss": losses[-1]}


def speed_stats(result: dict[str, Any], tokens: int) -> dict[str, float]:
    """The summary's token count and times: `tokens` trained on, their rate over the training
    loop (result["train_s"]), the loop's and the whole run's (result["wall_s"]) seconds."""
    return {"tokens": tokens, "tokens_per_s": tokens / result["train_s"],
            "train_s": result["train_s"], "wall_s": result["wall_s"]}


def format_report(s: dict[str, Any], header: str, files: list[str]) -> str:
    """The end-of-run report of summary `s`: `header`, its losses, throughput and times, the
    `files` lines, then the generated sample."""
    sample = s["sample"].replace("\t", "    ")
    how = "greedy" if s["temperature"] == 0 else f"sampled (T={s['temperature']})"
    return "\n".join([
        "",
        header,
        (f"  train loss  {s['initial_loss']:.3f} -> {s['final_loss']:.3f}  "
         f"(first step -> mean of the last 10%; ln 256 = {math.log(256):.3f})"),
        f"  val loss    {s['val_loss']:.3f}  (held-out stdlib files)",
        f"  throughput  {s['tokens_per_s']:,.0f} tokens/s over all ranks",
        f"  time        {s['wall_s']:.1f} s wall ({s['train_s']:.1f} s in the training loop)",
        *files,
        f"  sample      {how} continuation of {s['prompt']!r}:",
        *("    | " + line for line in sample.splitlines()),
        "",
    ])


def plot_loss(metrics: list[dict[str, Any]], path: Path, title: str = "",
              val_loss: float | None = None) -> bool:
    """Training loss per step (raw and smoothed) and the final validation loss, as a PNG.
    Returns False (after a one-line note) when matplotlib is not installed: the plot is optional."""
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so no {path.name} (pip install matplotlib); "
              "metrics.jsonl and summary.json are written")
        return False
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
    return True


def _moving_average(xs: list[float], half: int) -> list[float]:
    """Centered mean over +-`half` points (shrinking at the ends): smooths without lagging."""
    out = []
    for i in range(len(xs)):
        window = xs[max(0, i - half): i + half + 1]
        out.append(sum(window) / len(window))
    return out
