"""The capstone's training step (cudabook.gpt_train): Chapter 7's GPT trained on the book's
kernels against PyTorch, in one run.

1. speed at GPT-2-small shapes (B x T tokens per step): PyTorch eager, PyTorch's whole step
   captured in a CUDA graph, torch.compile (max-autotune, no cudagraphs) captured whole, and the
   book's step captured whole; tokens/s, model-FLOP utilisation against the bf16 peak measured
   here, compile time;
2. same training: the tiny model (cudabook.gpt.TINY) trained for --steps steps from the same
   weights on the same batches by PyTorch (autocast bf16, fused AdamW) and by the book's step;
   the two loss curves and their largest relative difference, and the held-out loss after.

    PYTHONPATH=. python tools/dev/capstone_train.py [--torch-only] [--no-compile] [--steps 200]
                                                   [--batch 8] [--seq 1024] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time


def _time(fn, n: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``n`` calls (CUDA events), after 2 warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def speed(a, rows: list) -> None:
    import torch

    from cudabook import baselines, gpt, gpt_train

    cfg = gpt.GPT2_SMALL
    B, T = a.batch, a.seq
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, cfg.vocab, (B, T), device="cuda", generator=g)
    y = torch.randint(0, cfg.vocab, (B, T), device="cuda", generator=g)
    flops = gpt_train.step_flops(cfg, B, T)
    peak = baselines.peak_tflops("bf16")
    print(f"GPT-2-small shapes, B = {B}, T = {T}: {flops / 1e12:.2f} TFLOP per step; "
          f"bf16 peak measured here {peak:.0f} TFLOP/s")
    res = {}

    def report(name, ms, extra=""):
        tps = B * T / (ms * 1e-3)
        mfu = flops / (ms * 1e-3) / 1e12 / peak
        res[name] = ms
        print(f"  {name:40s} {ms:8.2f} ms  {tps / 1e3:8.1f} k tok/s  MFU {mfu:5.1%} {extra}")
        rows.append({"name": name, "ms": ms, "tokens_per_s": tps, "mfu": mfu})

    ref = gpt_train.TorchStep(cfg, B, T)
    report("PyTorch eager", _time(lambda: ref.step(x, y), 5))
    gr = baselines.torch_graph(lambda: ref.step(x, y))
    report("PyTorch CUDA graph", _time(gr))
    gr = ref = None  # free the memory for the next model
    if not a.no_compile:
        t0 = time.perf_counter()
        comp = gpt_train.TorchStep(cfg, B, T, compiled=True, mode=a.mode)
        with baselines.quiet_compiler():
            comp.step(x, y)
            torch.cuda.synchronize()
        tc = time.perf_counter() - t0
        gc = baselines.torch_graph(lambda: comp.step(x, y))
        label = "max-autotune" if a.mode.startswith("max-autotune") else a.mode
        report(f"torch.compile ({label}) + CUDA graph", _time(gc), f"(compile {tc:.0f} s)")
        gc = comp = None
    if a.torch_only:
        return
    own = gpt_train.BookStep(cfg, B, T)
    t0 = time.perf_counter()
    own.step(x, y)
    torch.cuda.synchronize()
    print(f"  book's step: first call (compiles kernels) {time.perf_counter() - t0:.1f} s")
    report("book's kernels, launched from Python", _time(lambda: own.step(x, y), 5))
    run = own.graph()
    report("book's kernels, CUDA graph", _time(lambda: run(x, y)))
    best = min(v for k, v in res.items() if k.startswith(("PyTorch CUDA", "torch.compile")))
    mine = res["book's kernels, CUDA graph"]
    print(f"  PyTorch's best captured step / the book's: {best / mine:.2f}x")


def agreement(a, rows: list) -> None:
    import torch

    from cudabook import gpt, gpt_train

    cfg = gpt.TINY
    B, T = 16, cfg.ctx
    data = torch.frombuffer(bytearray(gpt._split(gpt.corpus())[0]), dtype=torch.uint8)
    data = data.to("cuda").long()
    g = torch.Generator(device="cuda").manual_seed(1)
    ref = gpt_train.TorchStep(cfg, B, T)
    own = gpt_train.BookStep(cfg, B, T)
    own.load(ref.model)
    run = own.graph()
    lt, lo = [], []
    for _ in range(a.steps):
        i = torch.randint(0, len(data) - T - 1, (B,), device="cuda", generator=g)
        xy = data[i[:, None] + torch.arange(T + 1, device="cuda")]
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        lt.append(ref.step(x, y).clone())
        lo.append(run(x, y).clone())
    lt = torch.stack(lt).float().cpu()
    lo = torch.cat(lo).float().cpu()
    rel = ((lo - lt).abs() / lt.abs()).max().item()
    print(f"tiny GPT, {a.steps} steps, B = {B}, T = {T}: loss {lt[0]:.4f} -> {lt[-1]:.4f} "
          f"(PyTorch), {lo[0]:.4f} -> {lo[-1]:.4f} (book); largest relative difference {rel:.2e}")
    for s in (0, 1, 2, 10, 50, a.steps - 1):
        if s < a.steps:
            print(f"  step {s:4d}: PyTorch {lt[s]:.5f}  book {lo[s]:.5f}")
    rows.append({"name": "agreement", "steps": a.steps, "max_rel": rel,
                 "torch": lt.tolist(), "book": lo.tolist()})


def grads(a, rows: list) -> None:
    """Each weight's gradient after one forward and backward, book against PyTorch autocast."""
    import torch

    from cudabook import gpt, gpt_train

    cfg = gpt.GPTConfig(vocab=300, d=128, n_layer=2, n_head=2, ctx=128)
    B, T = 4, 96
    g = torch.Generator(device="cuda").manual_seed(0)
    xy = torch.randint(0, cfg.vocab, (B, T + 1), device="cuda", generator=g)
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
    ref = gpt_train.TorchStep(cfg, B, T)
    own = gpt_train.BookStep(cfg, B, T)
    own.load(ref.model)
    want, got = ref.gradients(x, y), own.gradients(x, y)
    print(f"gradients, {cfg}: loss PyTorch {want['loss']:.6f}, book {got['loss']:.6f}")
    errs = {}
    for name, w in want["grads"].items():
        o = got["grads"][name]
        errs[name] = ((o - w).norm() / w.norm().clamp_min(1e-30)).item()
        print(f"  {name:28s} |ref| {w.norm().item():.3e}  |book| {o.norm().item():.3e}  "
              f"rel {errs[name]:.2e}")
    rows.append({"name": "gradients", "loss": [want["loss"], got["loss"]], "rel": errs})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-only", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs", help="torch.compile mode")
    ap.add_argument("--grads", action="store_true", help="only the gradient comparison")
    a = ap.parse_args()
    rows: list = []
    if a.grads:
        grads(a, rows)
        return
    if not a.no_speed:
        speed(a, rows)
    if not a.torch_only and a.steps:
        agreement(a, rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
