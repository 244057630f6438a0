"""Paged decode attention (kernels/paged_attention.cu) checked against float64 on ragged batches,
then timed against SDPA over a dense cache padded to the longest request, and against the bytes
it must read at the copy bandwidth.

    PYTHONPATH=. python tools/dev/ch12_paged.py            # GPT-2 heads and grouped-query heads
    PYTHONPATH=. python tools/dev/ch12_paged.py --splits 1 4 16   # the split count, swept

The baseline is what a PyTorch decoder does without paging: the cache of every request padded to
the longest one, one query per request, `F.scaled_dot_product_attention` with a mask for the
padding (`enable_gqa` for grouped heads). The bound counts the K and V bytes of the positions
that exist (no padding) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import cudabook as cb

pa = cb.load_launch("paged_attention")


def case(lens, H, Hkv, D, BS, seed=0):
    """A pool with each request's blocks drawn in random order; the same keys densely padded."""
    import cupy as cp

    rng = np.random.default_rng(seed)
    B, MB = len(lens), -(-max(lens) // BS)
    NB = sum(-(-n // BS) for n in lens) + 7
    table = np.full((B, MB), -1, np.int32)
    ids = rng.permutation(NB)
    for b, n in enumerate(lens):
        k = -(-n // BS)
        table[b, :k], ids = ids[:k], ids[k:]
    q = rng.standard_normal((B, H, D)).astype(np.float16)
    kp = rng.standard_normal((NB, Hkv, BS, D)).astype(np.float16)
    vp = rng.standard_normal((NB, Hkv, BS, D)).astype(np.float16)
    L = MB * BS
    kd = np.zeros((B, Hkv, L, D), np.float16)
    vd = np.zeros((B, Hkv, L, D), np.float16)
    for b, n in enumerate(lens):
        t = np.arange(n)
        kd[b, :, :n] = kp[table[b, t // BS], :, t % BS].transpose(1, 0, 2)
        vd[b, :, :n] = vp[table[b, t // BS], :, t % BS].transpose(1, 0, 2)
    mask = np.arange(L)[None, :] < np.array(lens)[:, None]                 # (B, L)
    dev = [cp.asarray(a) for a in (q, kp, vp, table, np.array(lens, np.int32))]
    dense = [torch.tensor(a, device="cuda") for a in (q[:, :, None], kd, vd)]
    tmask = torch.tensor(mask, device="cuda")[:, None, None, :]
    return (q, kp, vp, table, np.array(lens, np.int32)), dev, dense, tmask


def run(name, lens, H, Hkv, D, BS, splits_list):
    host, dev, (qd, kd, vd), tmask = case(lens, H, Hkv, D, BS)
    ref = pa.reference(*host)
    gqa = H != Hkv
    nbytes = 2 * sum(lens) * Hkv * D * 2 + len(lens) * H * D * 4           # K and V, q and out
    fns = {}
    for S in splits_list:
        for v in pa.VERSIONS:
            out = pa.decode(*dev, splits=S, check=True, version=v)
            cb.check(out, ref, atol=2e-3, rtol=2e-3)
            work = pa.Workspace(len(lens), H, D,
                                pa.plan(len(lens), Hkv, dev[3].shape[1], BS, S)[0])
            key = f"{v}, splits {S or 'auto'}"
            fns[key] = (lambda S=S, out=out, work=work, v=v: pa.decode(
                *dev, out=out, splits=S, work=work, version=v))

    def sdpa():
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=tmask, enable_gqa=gqa)

    got = sdpa()[:, :, 0].float().cpu().numpy()
    assert np.allclose(got, ref, atol=2e-3, rtol=2e-3), "SDPA baseline disagrees with float64"
    t = cb.bench(fns, baseline={"SDPA, dense padded cache": sdpa}, bytes=nbytes,
                 size=f"{name}, lengths {min(lens)}..{max(lens)}", quiet=True)
    print(f"--- {name}: B={len(lens)}, H={H}, Hkv={Hkv}, D={D}, block {BS}, "
          f"{sum(lens)} keys in all")
    print(t)
    gbs = cb.roofline.copy_gbs(1 << 30)
    for row in t.rows:
        print(cb.baselines.Bound(row.name, row.time_us, nbytes=nbytes, gbs=gbs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, nargs="*", default=None)
    a = ap.parse_args()
    splits = a.splits or [None]
    rng = np.random.default_rng(1)
    for B in (1, 8, 32):
        lens = [int(x) for x in rng.integers(256, 2049, B)]
        run("GPT-2 heads", lens, 12, 12, 64, 16, splits)
        run("grouped-query heads 32/8", lens, 32, 8, 128, 16, splits)
    print(f"GPU: {cb.env.info().name}; float16; time per decode step's attention for one layer")


if __name__ == "__main__":
    main()
