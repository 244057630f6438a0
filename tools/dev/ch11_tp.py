"""Chapter 11's tensor-parallel layers at GPT-2-small shapes on every GPU count of this host:
eager and captured in a CUDA graph, against one GPU run the same way and torch's parallelize_module.

    PYTHONPATH=. python tools/dev/ch11_tp.py [--tokens-per-seq 1024 --batch 8] [--out tp.json]

For each world size (1, then 2, 4, 8 where the host has them and 12 heads split evenly) one
torchrun of cudabook/dist_scripts/tp_train.py (cudabook.tensor_parallel.gpu_timing): the MLP, the
block and the model forward + backward, eager and (MLP, block) as CUDA graphs with NCCL inside, the
host's time to issue each call, and one all-reduce of the step's activation alone; --decode adds
the split decode step (ParallelDecoder, CUDA graphs) at batch 1 and 8 against one GPU. Prints the
table the lesson prints and writes the raw results with --out. Re-run after changing
tensor_parallel.py or tp_train.py."""

from __future__ import annotations

import argparse
import json

from cudabook import dist, gpt
from cudabook import tensor_parallel as tp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--decode", action="store_true",
                    help="also ParallelDecoder's decode step per world size (tp_decode.py)")
    ap.add_argument("--out")
    a = ap.parse_args()
    n = dist.gpu_count()
    if n < 2:
        raise SystemExit(f"ch11_tp: needs 2 or more GPUs of one host, this one has {n}")
    worlds = [1] + [w for w in (2, 4, 8) if w <= n and gpt.GPT2_SMALL.n_head % w == 0]
    res = {w: tp.gpu_timing(w, batch=a.batch, seq=a.seq, steps=a.steps, timeout=500)
           for w in worlds}
    one = res[1]["ms"]
    cols = {"MLP eager": ("mlp unsplit", "mlp book"),
            "MLP graph": ("mlp unsplit graph", "mlp book graph"),
            "torch TP eager": ("mlp unsplit", "mlp torch TP"),
            "block eager": ("block unsplit", "block book"),
            "block graph": ("block unsplit graph", "block book graph"),
            "GPT eager": ("gpt unsplit", "gpt book")}
    print(f"{res[1]['device']}, GPT-2 small, {res[1]['tokens']} tokens, bf16, forward + backward: "
          "ms per call (speed-up over 1 GPU run the same way), host ms per call")
    print(f"{'GPUs':>4s} " + " ".join(f"{c:>22s}" for c in cols))
    for w, r in res.items():
        line = []
        for c, (base, mine) in cols.items():
            k = base if w == 1 else mine
            if k not in r["ms"] or base not in one or (w == 1 and "torch" in c):
                line.append(f"{'-':>22s}")
                continue
            t = r["ms"][k]
            line.append(f"{t:7.3f} ({one[base] / t:4.2f}) h {r['host_ms'][k]:5.2f}")
        print(f"{w:4d} " + " ".join(line))
        if w > 1:
            print(f"     one all-reduce of {r['message_bytes'] / 1e6:.1f} MB: "
                  f"{r['ms']['all-reduce']:.3f} ms; checks {r['check']}")
        for k, e in r["graph_errors"].items():
            print(f"     {w} GPUs, {k}: not captured ({e})")
    dec = {}
    if a.decode:
        for batch in (1, 8):
            for w in worlds:
                dec[f"{w} B{batch}"] = r = tp.decode_timing(w, batch=batch, timeout=300)
                base = dec[f"1 B{batch}"]["us_per_token"]
                print(f"decode, batch {batch}, {w} GPU(s): {r['us_per_token']:8.1f} us/token "
                      f"({base / r['us_per_token']:.2f}x one GPU); check {r['check']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"layers": {str(w): r for w, r in res.items()}, "decode": dec}, f,
                      indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
