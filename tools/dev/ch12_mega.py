"""The decode megakernel (kernels/decode_mega.cu) at GPT-2-small shapes, fp16, random weights:
checked against the book's step and float64, then timed against the book's graph and PyTorch.

1. each version compiled and launched: registers, shared memory, grid, splits (v4, v5: the most,
   and the splits they take at CTX cached positions);
2. logits against the book's step (KernelGPT.step) and a float64 PyTorch reference at positions
   0, 1, 2, after a prompt of 511 and a ragged one (37), batch 1 and 8; 32 greedy tokens from
   both engines; graph replays against launches, bit for bit;
3. at CTX cached positions, batch 1 and 8, in this process: (a) the megakernel captured in a CUDA
   graph, (b) the book's graph of ~113 kernels, (c) PyTorch's static-cache step torch.compile'd
   and captured (decoder.StaticCacheDecoder, with the uncompiled captured step beside it): us
   per token, (c) / (a), and the memory bound (decoder.step_bytes at the measured copy
   bandwidth); every timed step validated before and after timing (decoder.timed_step);
4. with --phases, each phase alone with every barrier, and the barriers alone (MegaStep.
   phase_times; v5 has 4 barriers a layer, and its "attention" alone leaves out the wait for the
   heads' counts); with --variants, v2 at 2 blocks per SM (refused where it does not fit);
5. a summary table: us per token and the ratio to the baseline for each version and batch, and
   the phase breakdowns.

A part that fails prints its error and the rest still runs; --out writes everything as JSON. A
step whose error word is set (or whose token after timing is not its largest logit's) gets no
timing: the error word is cleared and checked before a version is timed and checked after.
--checks quick keeps, at batch 1 only, the comparison after a prompt of 511, the greedy tokens
and the graph replays.

    PYTHONPATH=. python tools/dev/ch12_mega.py [--ctx 512] [--batch 1 8] [--versions v3 v4 v5]
                                               [--checks full|quick] [--no-compile]
                                               [--phases] [--variants] [--out mega.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time
import traceback

import numpy as np

RESULTS: dict = {"errors": []}


def part(name: str):
    """Run the decorated function now; print and record its failure, and go on."""
    def wrap(fn):
        t0 = time.perf_counter()
        print(f"\n=== {name}", flush=True)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            msg = f"{name}: {type(e).__name__}: {e}"
            print("FAILED " + msg)
            traceback.print_exc(limit=4, file=sys.stdout)
            RESULTS["errors"].append(msg)
        print(f"    ({time.perf_counter() - t0:.1f} s)", flush=True)
        return fn
    return wrap


def summary(res: dict, versions: tuple) -> None:
    """One table: us per token and the ratio of speeds to the baseline (torch.compile + CUDA
    graph, else the captured PyTorch step) of every version and batch timed; then each phase
    breakdown (phase cost = its time alone minus the barriers alone)."""
    print("\n=== 5. summary")
    for bkey, row in res.get("timing", {}).items():
        base_name = "torch_compile_graph" if "torch_compile_graph" in row else "torch_graph"
        base = row.get(base_name)
        print(f"{bkey}, {res['ctx']} cached positions; baseline {base_name}"
              f"{f' {base:.1f} us' if base else ' (not timed)'}; memory bound "
              f"{row.get('bound_us', float('nan')):.1f} us")
        for k in (*versions, "book_graph", "torch_graph", "torch_compile_graph"):
            if k in row:
                ratio = f"{base / row[k]:5.2f}x" if base else "  -  "
                print(f"  {k:>22} {row[k]:8.1f} us/token  {ratio} of the baseline's speed")
            elif k in versions:
                print(f"  {k:>22}   failed: no timing")
    for version, t in res.get("phases", {}).items():
        bar = t["barriers only"]
        parts = ", ".join(f"{k} {t[k] - bar:.1f}" for k in t if k not in ("step", "barriers only"))
        print(f"  {version} B=1 phases (us): step {t['step']:.1f}, barriers {bar:.1f}; {parts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512, help="cached positions when timed")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--versions", nargs="+", default=None, help="default: all")
    ap.add_argument("--checks", choices=("full", "quick"), default="full")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--n", type=int, default=100, help="timed steps")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--phases", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import cudabook as cb

    if not cb.HAS_GPU:
        print("ch12_mega.py needs a CUDA GPU (this machine has none: simulator mode)")
        return 2
    import cupy as cp
    import torch

    from cudabook import decoder, gpt

    dm = cb.load_launch("decode_mega")
    versions = tuple(dict.fromkeys(cb.launch.version_name(dm.ALL_VERSIONS, v, "decode_mega")
                                   for v in (a.versions or dm.VERSIONS)))
    quick = a.checks == "quick"
    L = gpt.GPT2_SMALL.ctx
    if not 1 <= a.ctx <= L - a.n - 8:
        print(f"--ctx {a.ctx}: the timed steps must fit the cache of {L} (ctx <= {L - a.n - 8})")
        return 2
    RESULTS.update(gpu=cb.env.info().name, date=datetime.date.today().isoformat(),
                   ctx=a.ctx, checks={}, timing={}, phases={}, compile={})
    print(f"GPU: {cb.env.info().name}, cc {cb.env.cc()}")
    t0 = time.perf_counter()
    model = gpt.build(gpt.GPT2_SMALL, 0, "cuda", torch.float16)
    model64 = copy.deepcopy(model).double()           # the same fp16 weights, in float64
    print(f"model built in {time.perf_counter() - t0:.1f} s")
    mks: dict = {}

    def pair(B: int, version: str):
        key = (B, version)
        if key not in mks:
            mk = dm.megakernel(model, batch=B, length=L, version=version)
            mks[key] = (mk, decoder.KernelGPT(model, batch=B, length=L, share=mk.run))
        return mks[key]

    @part("1. compile and launch records")
    def _compile():
        for version in versions:
            for B in a.batch:
                try:
                    t1 = time.perf_counter()
                    mk, _ = pair(B, version)
                    res = mk.kernel.attributes
                    fit = cb.occupancy.driver_blocks_per_sm(mk.kernel, dm.THREADS,
                                                            mk.launch.shared)
                    rec = {"seconds": round(time.perf_counter() - t1, 1),
                           "registers": int(res["num_regs"]),
                           "static_smem": int(res["shared_size_bytes"]),
                           "local_bytes": int(res["local_size_bytes"]),
                           "dynamic_smem": mk.launch.shared, "grid": mk.launch.grid[0],
                           "splits": mk.launch.splits, "blocks_per_sm_fit": fit}
                    if version in ("decode_mega_v4", "decode_mega_v5"):    # pos = ctx
                        rec["splits_at_ctx"] = dm.active_splits(a.ctx + 1, mk.launch.splits)
                    print(f"{version} B={B}: {rec}")
                    RESULTS["compile"][f"{version}_b{B}"] = rec
                except Exception as e:  # noqa: BLE001
                    print(f"FAILED {version} B={B}: {type(e).__name__}: {e}")
                    RESULTS["errors"].append(f"compile {version} B={B}: {e}")

    rng = np.random.default_rng(0)

    @part("2. logits against the book's step and float64")
    def _check():
        for version in versions:
            for B in a.batch:
                if (B, version) not in mks:
                    continue
                mk, book = mks[(B, version)]
                if quick and B != 1:
                    continue
                cases = [("positions 0, 1, 2", None, 3)] if B == 1 and not quick else []
                cases += [("after 511", rng.integers(0, 50257, (B, 511)), 2)]
                if not quick:
                    cases += [("after 37 (ragged)", rng.integers(0, 50257, (B, 37)), 3)]
                for name, prompt, steps in cases:
                    try:
                        e = dm.compare(mk, book, model64, prompt, steps, start=464)
                        ok = e["mega_vs_ref"] <= 2 * e["book_vs_ref"] + 1e-3
                        print(f"{'ok  ' if ok else 'BAD '}{version} B={B} {name}: positions "
                              f"{e['positions']}; max |mega - book| {e['mega_vs_book']:.3g}, "
                              f"|mega - f64| {e['mega_vs_ref']:.3g} ({e['mega_tol_ratio']:.2f} "
                              f"of tol), |book - f64| {e['book_vs_ref']:.3g} "
                              f"({e['book_tol_ratio']:.2f} of tol); argmax = f64's: "
                              f"{e['tokens_equal_ref']}")
                        RESULTS["checks"][f"{version}_b{B}_{name}"] = {**e, "ok": ok}
                        if not ok:
                            RESULTS["errors"].append(f"mismatch {version} B={B} {name}")
                    except Exception as ex:  # noqa: BLE001
                        print(f"FAILED {version} B={B} {name}: {type(ex).__name__}: {ex}")
                        RESULTS["errors"].append(f"check {version} B={B} {name}: {ex}")
                        mk.reset()

    @part(f"2b. {a.steps} greedy tokens, megakernel graph against the book's graph")
    def _greedy():
        for version in versions:
            if (1, version) not in mks:
                continue
            mk, book = mks[(1, version)]
            try:
                r = dm.greedy_agreement(mk, book, rng.integers(0, 50257, 20), a.steps)
            except Exception as ex:  # noqa: BLE001
                print(f"FAILED {version}: {type(ex).__name__}: {ex}")
                RESULTS["errors"].append(f"greedy {version}: {ex}")
                mk.reset()
                continue
            RESULTS["checks"][f"{version}_greedy"] = r
            if r["same"]:
                print(f"ok   {version}: the same {a.steps} tokens: {r['mega'][0][:12]} ...")
            else:
                print(f"DIFF {version}: first at step {r['first_difference']}, the book's top-2 "
                      f"gap there {r['book_top2_gap']:.3g}\n  mega {r['mega'][0]}\n  book "
                      f"{r['book'][0]}")

    @part("2c. graph replays against launches, bit for bit")
    def _replay():
        for version in versions:
            if (1, version) not in mks:
                continue
            mk, _ = mks[(1, version)]
            run = mk.run
            run.prefill(np.arange(100, 140))
            state = [x.copy() for x in (run.kc, run.vc, run.tok, run.pos)]
            eager = []
            for _ in range(4):
                mk.step()
                eager.append((run.logits.copy(), run.tok.copy()))
            for x, y in zip((run.kc, run.vc, run.tok, run.pos), state):
                x[...] = y
            g = mk.capture()
            same = []
            for i in range(4):
                g()
                same.append(bool((run.logits == eager[i][0]).all()) and
                            bool((run.tok == eager[i][1]).all()))
            try:
                mk.check()
            except cb.CheckError as ex:
                print(f"FAILED {ex}")
                RESULTS["errors"].append(f"replay {version}: {ex}")
                mk.reset()
                continue
            print(f"{'ok  ' if all(same) else 'BAD '}{version}: replays equal launches: {same}; "
                  f"graph nodes {g.nodes}")
            RESULTS["checks"][f"{version}_replay"] = same

    gbs = cb.roofline.copy_gbs(1 << 30)
    print(f"\ncopy bandwidth {gbs:.0f} GB/s")
    RESULTS["copy_gbs"] = gbs

    for B in a.batch:
        @part(f"3. timing at {a.ctx} cached positions, batch {B}")
        def _time():
            row: dict = {}
            ids = rng.integers(0, 50257, (B, a.ctx))
            bound = decoder.step_bytes(model, B, a.ctx)["total"] / gbs / 1e3
            row["bound_us"] = bound
            for version in versions:                # MegaStep.step_us: checked before and after
                if (B, version) not in mks:
                    continue
                try:
                    row[version] = mks[(B, version)][0].step_us(ids, a.n)
                except Exception as e:  # noqa: BLE001
                    print(f"FAILED {version}: {type(e).__name__}: {e}")
                    RESULTS["errors"].append(f"time {version} B={B}: {e}")
            try:
                share = next((m.run for (b, _), (m, _) in mks.items() if b == B), None)
                book = decoder.KernelGPT(model, batch=B, length=L, share=share)
                row["book_graph"] = book.step_us(ids, a.n)
                row["book_graph_nodes"] = book.graph.nodes
                del book
            except Exception as e:  # noqa: BLE001
                print(f"FAILED book graph: {type(e).__name__}: {e}")
                RESULTS["errors"].append(f"time book B={B}: {e}")
            sd = decoder.StaticCacheDecoder(model, batch=B, length=L)
            sd.prefill(torch.as_tensor(ids, device="cuda"))
            for compiled in ((False,) if a.no_compile else (False, True)):
                name = "torch_compile_graph" if compiled else "torch_graph"
                try:
                    us, why = sd.step_us(compiled, a.n)
                    if us is None:
                        print(f"{name}: {why}")
                        row[name + "_why"] = why
                        continue
                    row[name] = us
                except Exception as e:  # noqa: BLE001
                    print(f"FAILED {name}: {type(e).__name__}: {e}")
                    RESULTS["errors"].append(f"time {name} B={B}: {e}")
            del sd
            torch.cuda.empty_cache()
            base_name = "torch_compile_graph" if "torch_compile_graph" in row else "torch_graph"
            base = row.get(base_name)
            for k in (*versions, "book_graph", "torch_graph", "torch_compile_graph"):
                if k not in row:
                    continue
                us = row[k]
                ratio = f"{base / us:5.2f}x faster than {base_name}" if base else ""
                print(f"B={B} {k:>22}: {us:8.1f} us/token = {B * 1e6 / us:9.0f} tokens/s; "
                      f"{bound / us:5.1%} of the memory bound ({bound:.1f} us); {ratio}")
            RESULTS["timing"][f"B{B}"] = row

    if a.phases:
        for version in versions:
            if (1, version) not in mks:
                continue

            @part(f"4. {version} phase by phase, batch 1, at {a.ctx} positions")
            def _phases():
                mk, _ = mks[(1, version)]
                mk.reset()
                mk.run.prefill(rng.integers(0, 50257, (1, a.ctx)))
                t = mk.phase_times()
                bar = t["barriers only"]
                for k, v in t.items():
                    extra = f"  (phase {v - bar:7.1f} us over the barriers)" \
                        if k in dm.PHASES else ""
                    print(f"{k:>14}: {v:8.1f} us per step{extra}")
                RESULTS["phases"][version] = t

    if a.variants:
        @part("4b. v2 at 2 blocks per SM")
        def _variants():
            try:
                mk = dm.megakernel(model, batch=1, length=L, version="v2", blocks_per_sm=2)
            except cb.LaunchError as e:
                print(f"refused: {e}")
                RESULTS["variants"] = {"bps2": str(e)}
                return
            us = mk.step_us(rng.integers(0, 50257, (1, a.ctx)), a.n)
            print(f"v2, 2 blocks per SM (grid {mk.launch.grid[0]}): {us:.1f} us/token")
            RESULTS["variants"] = {"bps2_us": us}

    summary(RESULTS, versions)
    cp.cuda.Device().synchronize()
    print(f"\n{len(RESULTS['errors'])} failures" + (":\n  " + "\n  ".join(RESULTS["errors"])
                                                    if RESULTS["errors"] else ""))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=str)
        print(f"wrote {a.out}")
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
