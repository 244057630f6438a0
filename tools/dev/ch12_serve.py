"""Chapter 12's serving engine (cudabook.serving) at GPT-2-small shapes, fp16, random weights:

1. the decode step of each batch size (bucket), every row at CTX cached positions, as a CUDA
   graph, against PyTorch's static-cache step torch.compile'd and captured (the strongest
   PyTorch decoder) at the same batch and length, and against the bytes it must read;
2. a workload of requests served with continuous batching and with padded static batching:
   tokens/s, decode steps, rows computed, latency percentiles, peak cache blocks;
3. every request's tokens against the same request served alone (batch invariance);
4. with --fused, the same for PagedGPT(fused=True) (kernels/decode_gemv.cu): step times per
   bucket, its op breakdown, and whether its tokens are the unfused engine's.

    PYTHONPATH=. python tools/dev/ch12_serve.py [--requests 64] [--ctx 512] [--no-compile]
                                                [--fused]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--alone", type=int, default=None, help="check this many requests alone")
    ap.add_argument("--fused", action="store_true", help="also the fused engine")
    a = ap.parse_args()

    import cupy as cp
    import torch

    import cudabook as cb
    from cudabook import decoder, gpt, serving

    t0 = time.perf_counter()
    model = gpt.build(gpt.GPT2_SMALL, 0, "cuda", torch.float16)
    eng = serving.PagedGPT(model, slots=32, max_len=1024)
    print(f"engine built in {time.perf_counter() - t0:.1f} s; splits {eng.splits}, "
          f"{eng.table.alloc.num_blocks} blocks of {eng.BS}")
    gbs = cb.roofline.copy_gbs(1 << 30)
    print(f"GPU: {cb.env.info().name}; copy {gbs:.0f} GB/s")

    # 1. step time per bucket
    ctx = a.ctx
    nblk = -(-ctx // eng.BS)
    for B in serving.BUCKETS:
        bk = eng.bucket(B)
        rows = np.full((B, eng.MB), -1, np.int32)
        rows[:, :nblk] = np.arange(B * nblk, dtype=np.int32).reshape(B, nblk)
        bk.load(np.zeros(B, np.int32), np.full(B, ctx, np.int32), rows, eng.scratch)
        us = decoder.per_step_us(bk.graph, n=100)
        bound = decoder.step_bytes(model, B, ctx)["total"] / gbs / 1e3
        line = f"B={B:2d} ctx={ctx}: paged graph {us:7.1f} us; bound {bound:6.1f} us " \
               f"({bound / us:.0%})"
        if not a.no_compile and B in (1, 8, 32):
            sd = decoder.StaticCacheDecoder(model, batch=B, length=ctx + 120)
            sd.prefill(torch.randint(0, 50257, (B, ctx - 1), device="cuda"))
            for compiled in (False, True):
                run, why = sd.capture(compiled=compiled)
                if run is None:
                    line += f"; compile: {why}"
                    continue
                sd.reset(ctx - 1)
                pt = decoder.per_step_us(run, n=100)
                sd.reset(ctx - 1)
                line += f"; {'compile+graph' if compiled else 'torch graph'} {pt:7.1f} us " \
                        f"(book {pt / us:.2f}x)"
            del sd
            torch.cuda.empty_cache()
        print(line, flush=True)

    # 2. a workload, both policies
    reqs = serving.workload(a.requests, vocab=model.cfg.vocab, seed=0)
    total = sum(r.max_new_tokens for r in reqs)
    print(f"workload: {len(reqs)} requests, prompts {min(len(r.prompt) for r in reqs)}.."
          f"{max(len(r.prompt) for r in reqs)}, outputs {min(r.max_new_tokens for r in reqs)}.."
          f"{max(r.max_new_tokens for r in reqs)}, {total} tokens to generate")
    eng.serve(reqs[:4])                                       # warm: prefill kernels compiled
    res = {}
    for pol in ("continuous", "static"):
        res[pol] = eng.serve(reqs, policy=pol)
        print(res[pol].summary())
        print(f"    prefill {res[pol].prefill_s:.3f} s, buckets {res[pol].bucket_rows}")
    c, s = res["continuous"], res["static"]
    print(f"continuous / static: throughput {c.tokens_per_s / s.tokens_per_s:.2f}x, "
          f"p50 latency {s.latency(50) / c.latency(50):.2f}x lower, "
          f"p90 {s.latency(90) / c.latency(90):.2f}x lower")

    # 3. batch invariance
    n = a.alone if a.alone is not None else len(reqs)
    t1 = time.perf_counter()
    same = sum(eng.serve([r]).tokens[r.id] == c.tokens[r.id] == s.tokens[r.id]
               for r in reqs[:n])
    print(f"alone: {same} of {n} requests got the same tokens batched (continuous and static) "
          f"as alone ({time.perf_counter() - t1:.1f} s)")
    if a.fused:
        fz = serving.PagedGPT(model, slots=32, max_len=1024, fused=True)
        for B in serving.BUCKETS:
            bu, bf = eng.bucket(B), fz.bucket(B)
            for e, bk in ((eng, bu), (fz, bf)):
                rows = np.full((B, e.MB), -1, np.int32)
                rows[:, :nblk] = np.arange(B * nblk, dtype=np.int32).reshape(B, nblk)
                bk.load(np.zeros(B, np.int32), np.full(B, ctx, np.int32), rows, e.scratch)
            print(f"B={B:2d}: unfused {decoder.per_step_us(bu.graph, n=100):7.1f} us, fused "
                  f"{decoder.per_step_us(bf.graph, n=100):7.1f} us; graph nodes {bu.graph.nodes} "
                  f"and {bf.graph.nodes}")
            if B in (1, 32):
                print("    fused ops:", {k: round(v, 1) for k, v in fz.op_times(bf).items()})
        fr = fz.serve(reqs)
        print(fr.summary())
        print(f"fused engine: {sum(fr.tokens[r.id] == c.tokens[r.id] for r in reqs)} of "
              f"{len(reqs)} requests got the unfused engine's tokens")
    cp.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
