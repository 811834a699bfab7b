"""The ops of `dsfn/ops/` and Muon: throughput of the paths that run here, against torch.

    python benchmarks/ops_kernels.py              # CPU: torch paths (~1 min); on CUDA also the GPU section
    python benchmarks/ops_kernels.py --quick      # small sizes (seconds)
    python benchmarks/ops_kernels.py --cuda-only  # only the GPU section (benchmarks/gpu_checks.sh)

CPU (always, unless --cuda-only):
  adamw     the fused-AdamW torch reference (`adamw_update_torch`, one leaf) and dsfn's
            foreach `adamw` vs `torch.optim.AdamW` (foreach) on the same 64M-element state:
            GB/s of the 28 bytes/element an AdamW step must move (read p, g, m, v; write p, m, v)
  rmsnorm   `rms_norm_torch` forward+backward, GB/s, vs a memcpy of the same bytes
  ce        `linear_cross_entropy` (vocabulary tiles) vs `F.cross_entropy(hidden @ W.T)`:
            time and peak resident memory of forward+backward (each in a fresh child)
  muon      Muon step time: one process vs 2 ranks under shard_zero(2) (owner-computed NS)

CUDA (when a GPU is present; the issue's targets, each printed with PASS/FAIL):
  adamw     fused AdamW (Triton) GB/s vs `torch.optim.AdamW(fused=True)` and a
            device-to-device copy: target >= 85% of copy bandwidth and >= 1.0x torch fused
  rmsnorm   Triton RMSNorm forward+backward vs the torch reference
  ce        tiled linear cross-entropy vs `F.cross_entropy` on materialised logits at vocab
            128k (N=8192 tokens, D=4096, bf16): forward+backward time and peak allocated
            memory above the inputs; target peak ratio <= 1/4
  muon      `dsfn.optim.muon` step on GPT-like matrices ("gram" and "standard" NS, in the
            device's NS dtype and in fp32) vs `dsfn.optim.adamw` on the same params. One GPU:
            sharded Muon (NS on owner ranks) needs several and is not measured here.

The GPU section runs with DSFN_KERNELS=triton (a kernel that cannot run is an error, never a
silent torch fallback), refuses TRITON_INTERPRET, prints which implementation each op used
and checks that its Triton kernel really launched. Timings: warm-up calls first (Triton
compiles on the first), `torch.cuda.synchronize()` before and after every timed call,
median of `--repeats`.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# imports after the sys.path insert: a checkout runs without installing dsfn
import torch  # noqa: E402

import dsfn  # noqa: E402
import dsfn.launch  # noqa: E402
from dsfn.ops import adamw as adamw_mod  # noqa: E402
from dsfn.ops import cross_entropy as ce_mod  # noqa: E402
from dsfn.ops import dispatch  # noqa: E402
from dsfn.ops import rmsnorm as rms_mod  # noqa: E402
from dsfn.ops.adamw import adamw_update, adamw_update_torch  # noqa: E402
from dsfn.ops.cross_entropy import linear_cross_entropy  # noqa: E402
from dsfn.ops.rmsnorm import rms_norm, rms_norm_torch  # noqa: E402

GB = 1e9
GIB = 1 << 30


def _sync_for(device: str):
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def _time(fn, repeats: int, sync=lambda: None, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeats` calls, after `warmup` untimed calls (Triton
    compiles, cuBLAS picks algorithms, the allocator warms up); synchronized around each."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


@contextlib.contextmanager
def _count_launches(*kernels: tuple):
    """Count launches of the Triton kernels `(module, name)` in this block (the proof that
    the Triton path, not the torch reference, ran): yields {name: launches}."""
    counts = {name: 0 for _, name in kernels}
    saved = [(mod, name, getattr(mod, name)) for mod, name in kernels]

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                counts[self.name] += 1
                return launch(*args, **kwargs)
            return run
    for mod, name, kernel in saved:
        setattr(mod, name, Counting(name, kernel))
    try:
        yield counts
    finally:
        for mod, name, kernel in saved:
            setattr(mod, name, kernel)


def _implementation(label: str, fn, *kernels: tuple) -> None:
    """Run `fn` once, print which implementation ran; exit if a Triton kernel did not launch."""
    with _count_launches(*kernels) as counts:
        fn()
    _sync_for("cuda" if torch.cuda.is_available() else "cpu")()
    ran = ", ".join(f"{k} x{v}" for k, v in counts.items())
    print(f"  implementation of {label}: {'Triton' if all(counts.values()) else 'NOT Triton'} ({ran})")
    if not all(counts.values()):
        sys.exit(f"{label}: the Triton kernel did not launch; dispatch took another path")


# -- AdamW --------------------------------------------------------------------------------------
def bench_adamw(n: int, repeats: int, device: str) -> None:
    g = torch.Generator(device=device).manual_seed(0)        # drawn on the device: 4 x 256M on a GPU
    p, gr, m, v = (torch.randn(n, generator=g, device=device) for _ in range(4))
    v = v.abs()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    moved = 28 * n
    lr = torch.tensor(1e-3, device=device)
    step = torch.tensor(10, device=device)
    rows = {}
    rows["dsfn adamw_update (torch reference)"] = _time(
        lambda: adamw_update_torch(p, gr, m, v, lr=lr, step=step, weight_decay=0.1), repeats, sync)
    # dsfn's optimizer (what TrainState uses) and torch.optim on the same single tensor
    tx = dsfn.optim.adamw(lr=1e-3, weight_decay=0.1)
    st = tx.init({"w": p})
    if device == "cuda":
        kernel = ((adamw_mod, "_adamw_kernel"),)
        _implementation("adamw_update", lambda: adamw_update(p, gr, m, v, lr=lr, step=step, weight_decay=0.1),
                        *kernel)
        _implementation("dsfn.optim.adamw", lambda: tx.apply({"w": gr}, st, {"w": p}), *kernel)
        rows["dsfn adamw_update (Triton kernel)"] = _time(
            lambda: adamw_update(p, gr, m, v, lr=lr, step=step, weight_decay=0.1), repeats, sync, warmup=2)
    rows["dsfn.optim.adamw (apply)"] = _time(lambda: tx.apply({"w": gr}, st, {"w": p}), repeats, sync)
    for label, kw in (("torch.optim.AdamW (foreach)", {"foreach": True}),
                      ("torch.optim.AdamW (fused)", {"fused": True})):
        if kw.get("fused") and device != "cuda":
            continue
        w = torch.nn.Parameter(p.clone())
        opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.1, **kw)
        w.grad = gr.clone()
        opt.step()
        rows[label] = _time(opt.step, repeats, sync)
        del opt, w
    copy_dst = torch.empty_like(p)
    t_copy = _time(lambda: copy_dst.copy_(p), repeats, sync, warmup=2)
    bw = 2 * 4 * n / t_copy
    print(f"\nAdamW step, {n / 1e6:.0f}M fp32 elements ({moved / GB:.2f} GB moved per step); "
          f"copy bandwidth {bw / GB:.1f} GB/s on {device}:")
    for k, t in rows.items():
        print(f"  {k:38s} {t * 1e3:9.2f} ms  {moved / t / GB:7.1f} GB/s  {moved / t / bw * 100:5.1f}% of copy")
    if device == "cuda" and "torch.optim.AdamW (fused)" in rows:
        r = rows["torch.optim.AdamW (fused)"] / rows["dsfn adamw_update (Triton kernel)"]
        pct = moved / rows["dsfn adamw_update (Triton kernel)"] / bw
        print(f"  Triton / torch fused speed {r:.2f}x (target >= 1.0: {_verdict(r >= 1.0)}); "
              f"{pct * 100:.1f}% of copy bandwidth (target >= 85%: {_verdict(pct >= 0.85)})")


# -- RMSNorm ------------------------------------------------------------------------------------
def bench_rmsnorm(rows_: int, d: int, repeats: int, device: str) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.randn(rows_, d, device=device, requires_grad=True)
    w = torch.randn(d, device=device, requires_grad=True)
    dy = torch.randn(rows_, d, device=device)

    def fwd_bwd(fn):
        def run():
            y = fn(x, w, 1e-6)
            torch.autograd.grad(y, (x, w), dy)
        return run
    moved = 4 * rows_ * d * 5          # fwd: read x, write y; bwd: read x, dy, write dx
    print(f"\nRMSNorm forward+backward, [{rows_}, {d}] fp32 ({moved / GB:.2f} GB moved) on {device}:")
    t_ref = _time(fwd_bwd(rms_norm_torch), repeats, sync)
    print(f"  {'rms_norm_torch (reference)':38s} {t_ref * 1e3:9.2f} ms  {moved / t_ref / GB:7.1f} GB/s")
    if device == "cuda":
        _implementation("rms_norm", fwd_bwd(rms_norm), (rms_mod, "_rms_fwd_kernel"), (rms_mod, "_rms_bwd_kernel"))
        t = _time(fwd_bwd(rms_norm), repeats, sync, warmup=2)
        print(f"  {'rms_norm (Triton)':38s} {t * 1e3:9.2f} ms  {moved / t / GB:7.1f} GB/s  ({t_ref / t:.2f}x)")


# -- cross-entropy --------------------------------------------------------------------------------
def _hwm_reset() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 << 10)
    libc.mallopt(-1, 128 << 10)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _ce_child(kind: str, n: int, v: int, d: int) -> tuple[float, int]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * 0.02).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g)

    def run():
        if kind == "tiled":
            loss = linear_cross_entropy(h, w, y)
        else:
            loss = torch.nn.functional.cross_entropy(h @ w.T, y)
        return torch.autograd.grad(loss, (h, w))
    run()                               # warm-up (code pages, allocator)
    before = _hwm_reset()
    t0 = time.perf_counter()
    run()
    dt = time.perf_counter() - t0
    return dt, _status("VmHWM") - before


def bench_ce(n: int, v: int, d: int) -> None:
    print(f"\ncross-entropy fused with the LM head, forward+backward, N={n} tokens, V={v}, D={d}, fp32 CPU "
          f"(full logits: {n * v * 4 / 2**20:.0f} MiB):")
    res = {}
    for kind in ("materialised", "tiled"):
        (dt, peak), = dsfn.launch.spawn(_ce_child, 1, args=(kind, n, v, d), timeout=600)
        res[kind] = (dt, peak)
        print(f"  {kind:14s} {dt:8.3f} s   peak +{peak / 2**20:8.1f} MiB")
    r = res["tiled"][1] / max(res["materialised"][1], 1)
    print(f"  tiled / materialised peak memory {r:.3f} (target <= 0.25: {_verdict(r <= 0.25)}); "
          f"time {res['tiled'][0] / res['materialised'][0]:.2f}x")


# -- Muon -----------------------------------------------------------------------------------------
def _muon_child(stage: int | None, d: int, layers: int, steps: int) -> float:
    from dsfn.runtime import init_mesh
    from dsfn.testing.reference import train_step_for
    from dsfn.transforms import shard_zero
    init_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    apply_fn, params = dsfn.functionalize(model)
    stack = [] if stage is None else [shard_zero(stage)]
    step = dsfn.compose(*stack)(train_step_for(apply_fn))
    state = step.init_state(params, dsfn.optim.muon(lr=0.02, ns_method="standard", ns_dtype=torch.float32))
    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8 * world, d, generator=g), "y": torch.randn(8 * world, d, generator=g)}
    state, _ = step(state, batch)
    ts = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        state, m = step(state, batch)
        float(m["loss"])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_muon(d: int, layers: int, steps: int) -> None:
    print(f"\nMuon step ({layers} x Linear({d}, {d}), fp32 NS, 5 iterations), median of {steps}:")
    (t1,) = dsfn.launch.spawn(_muon_child, 1, args=(None, d, layers, steps), timeout=600)
    t2 = max(dsfn.launch.spawn(_muon_child, 2, args=(2, d, layers, steps), timeout=600))
    print(f"  one process           {t1 * 1e3:9.1f} ms")
    print(f"  2 ranks, shard_zero(2) {t2 * 1e3:9.1f} ms  ({t2 / t1:.2f}x; each matrix's NS runs once, on its owner)")


def bench_ce_cuda(n: int, v: int, d: int, repeats: int, device: str = "cuda", dtype=torch.bfloat16) -> None:
    """Tiled linear cross-entropy vs F.cross_entropy on materialised logits, forward+backward:
    time and peak allocated memory above the inputs (gradients included in both)."""
    sync = _sync_for(device)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, device=device) * d ** -0.5).to(dtype).requires_grad_()
    y = torch.randint(0, v, (n,), generator=g, device=device)

    def materialised():
        return torch.autograd.grad(torch.nn.functional.cross_entropy((h @ w.T).float(), y), (h, w))

    def tiled():
        return torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w))

    logits = n * v * torch.empty((), dtype=dtype).element_size()
    print(f"\ncross-entropy fused with the LM head, forward+backward, N={n} tokens, V={v}, D={d}, {dtype} on "
          f"{device} (logits: {logits / GIB:.2f} GiB in {dtype}, {n * v * 4 / GIB:.2f} GiB as fp32), "
          f"tile {ce_mod._auto_tile(n, v)}:")
    _implementation("linear_cross_entropy", tiled, (ce_mod, "_ce_fwd_tile_kernel"), (ce_mod, "_ce_bwd_tile_kernel"))
    res = {}
    for label, fn in (("materialised", materialised), ("tiled", tiled)):
        t = _time(fn, repeats, sync, warmup=2)
        peak = _peak_above_inputs(fn, device)
        res[label] = (t, peak)
        print(f"  {label:14s} {t * 1e3:9.2f} ms   peak +{peak / GIB:7.3f} GiB")
    (ga_h, ga_w), (gb_h, gb_w) = materialised(), tiled()
    err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
              for a, b in ((gb_h, ga_h), (gb_w, ga_w)))
    ratio = res["tiled"][1] / max(res["materialised"][1], 1)
    print(f"  tiled / materialised peak memory {ratio:.3f} (target <= 0.25: {_verdict(ratio <= 0.25)}); "
          f"time {res['tiled'][0] / res['materialised'][0]:.2f}x; grads agree to {err:.1e} of their max")


def _peak_above_inputs(fn, device: str) -> int:
    """Peak bytes allocated by `fn()` above what was allocated before it (CUDA allocator)."""
    if torch.device(device).type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def _gpt_matrices(d: int, layers: int, device: str) -> dict[str, torch.Tensor]:
    """The hidden matrices of a GPT block stack (what Muon trains): q, k, v, o [d, d],
    MLP up [4d, d] and down [d, 4d] per layer, fp32."""
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"attn.q_proj": (d, d), "attn.k_proj": (d, d), "attn.v_proj": (d, d), "attn.o_proj": (d, d),
              "mlp.up_proj": (4 * d, d), "mlp.down_proj": (d, 4 * d)}
    return {f"layers.{i}.{n}.weight": torch.randn(s, generator=g, device=device) * 0.02
            for i in range(layers) for n, s in shapes.items()}


def bench_muon_cuda(d: int, layers: int, repeats: int, device: str = "cuda") -> None:
    from dsfn.optim.muon import ns_compute_dtype
    sync = _sync_for(device)
    params = _gpt_matrices(d, layers, device)
    gen = torch.Generator(device=device).manual_seed(1)
    grads = {n: torch.randn(x.shape, generator=gen, device=device) for n, x in params.items()}
    numel = sum(x.numel() for x in params.values())
    auto = ns_compute_dtype(torch.device(device))
    print(f"\nMuon vs AdamW step on {device}: {layers} GPT layers at d={d} ({len(params)} matrices, "
          f"{numel / 1e6:.0f}M fp32 params), median of {repeats}; NS dtype on this device: {auto}")

    def stepper(tx):
        st = tx.init(params)
        return lambda: tx.apply(grads, st, params)
    rows = {}
    for method in ("gram", "standard"):
        for ns_dtype in (None, torch.float32):
            run = stepper(dsfn.optim.muon(lr=0.02, weight_decay=0.1, ns_method=method, ns_dtype=ns_dtype))
            new, _ = run()
            where = {x.device.type for x in new.values()}
            if where != {torch.device(device).type}:
                sys.exit(f"muon: updated params came back on {sorted(where)}, not on {device}")
            rows[f"dsfn.optim.muon ns_method={method!r}, NS in {ns_dtype or auto}"] = _time(run, repeats, sync, 2)
    adamw = dsfn.optim.adamw(lr=1e-3, weight_decay=0.1)
    run = stepper(adamw)
    if torch.device(device).type == "cuda":
        _implementation("dsfn.optim.adamw on these params", run, (adamw_mod, "_adamw_kernel"))
    t_adam = rows["dsfn.optim.adamw (fused Triton AdamW)"] = _time(run, repeats, sync, 2)
    for k, t in rows.items():
        print(f"  {k:58s} {t * 1e3:9.2f} ms  ({t / t_adam:5.1f}x AdamW)")
    gram, std = (rows[f"dsfn.optim.muon ns_method={m!r}, NS in {auto}"] for m in ("gram", "standard"))
    print(f"  gram / standard NS step time {gram / std:.2f}x (gram iterates on the d x d Gram matrix of the "
          f"{4 * d}x{d} MLP matrices)")
    print("  one GPU: sharded Muon (ZeRO; each matrix's NS once, on its owner rank via map_whole) needs several "
          "GPUs and is not measured here; tests/transforms/test_zero_muon.py checks it on CPU ranks")


def _cuda_preamble() -> None:
    """Make the GPU section unable to take a torch/CPU path silently: DSFN_KERNELS=triton
    (dispatch raises instead of falling back) and no interpreter."""
    os.environ["DSFN_KERNELS"] = "triton"
    if dispatch.interpreting():
        sys.exit("TRITON_INTERPRET is set: dsfn's kernels were created for Triton's CPU interpreter. "
                 "Unset it (or TRITON_INTERPRET=0) before running the GPU benchmarks")
    import triton
    cap = torch.cuda.get_device_capability()
    print(f"\n=== CUDA: {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}), "
          f"triton {triton.__version__}, DSFN_KERNELS=triton ===")
    probe = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    if not dispatch.use_triton(probe):          # raises with the reason under DSFN_KERNELS=triton
        sys.exit("dispatch does not pick Triton on this GPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cuda-only", action="store_true", help="skip the CPU section (needs a GPU)")
    a = ap.parse_args()
    q = a.quick
    # as in training (a Step applies it): freed blocks are reused instead of page-faulted in again,
    # which matters for the out-of-place (functional) updates
    dsfn.runtime.env.tune_host_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CUDA: {torch.cuda.is_available()}")
    if a.cuda_only and not torch.cuda.is_available():
        sys.exit("--cuda-only: torch sees no CUDA device")
    if not a.cuda_only:
        bench_adamw(4_000_000 if q else 64_000_000, a.repeats, "cpu")
        bench_rmsnorm(1024 if q else 8192, 1024 if q else 4096, a.repeats, "cpu")
        bench_ce(512 if q else 2048, 8192 if q else 32768, 64 if q else 256)
        bench_muon(128 if q else 512, 4 if q else 8, 3 if q else 5)
    if torch.cuda.is_available():
        _cuda_preamble()
        bench_adamw(16_000_000 if q else 256_000_000, a.repeats, "cuda")
        bench_rmsnorm(4096 if q else 32768, 8192, a.repeats, "cuda")
        bench_ce_cuda(1024 if q else 8192, 32768 if q else 131072, 1024 if q else 4096, a.repeats)
        bench_muon_cuda(512 if q else 2048, 2 if q else 8, a.repeats)


if __name__ == "__main__":
    main()
