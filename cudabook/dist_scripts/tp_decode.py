"""Tensor-parallel decode (cudabook.tensor_parallel.ParallelDecoder) of the GPT at GPT-2-small
shapes against one GPU, one process per GPU (Chapter 11). Launched by
cudabook.tensor_parallel.decode_timing (cudabook.dist.torchrun), or by hand:

    torchrun --standalone --nproc_per_node 2 cudabook/dist_scripts/tp_decode.py --batch 1

Every rank builds the same model (cudabook.gpt.build, seed 0, fp16) and prefills the same prompt
(--prompt tokens). World 1 runs decoder.StaticCacheDecoder, the book's PyTorch baseline (static
cache, position on the GPU); world N the split decoder, its two all-reduces a block by NCCL
(torch.distributed). Both are captured in a CUDA graph (NCCL's kernels inside) and replayed
--steps times back to back from the prompt's end (CUDA events, the slowest rank); before that,
--check eager steps of the split decoder are compared with the unsplit one on the same rank
(greedy tokens and logits). --device cpu: gloo processes, float32, eager only (a check).
"""

from __future__ import annotations

import argparse
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"          # multicast off, also if the caller forgot

import torch  # noqa: E402
import torch.distributed as td  # noqa: E402

from cudabook import gpt  # noqa: E402
from cudabook import tensor_parallel as tp  # noqa: E402
from cudabook.decoder import StaticCacheDecoder  # noqa: E402
from cudabook.dist import script_done, script_rank  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--length", type=int, default=1024, help="static cache positions")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--check", type=int, default=8)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    cfg = gpt.GPTConfig(vocab=a.vocab, d=a.dim, n_layer=a.layers, n_head=a.n_head,
                        ctx=a.length)
    if cfg.n_head % world:
        raise SystemExit(f"tp_decode: {world} ranks cannot split {cfg.n_head} heads")
    if a.prompt + a.check + a.steps + 8 > a.length:
        raise SystemExit(f"tp_decode: prompt {a.prompt} + {a.check} + {a.steps} steps do not fit "
                         f"a cache of {a.length}")
    rank, world, dev, dtype = script_rank("tp_decode", a.device, torch.float16)
    cuda = dev.type == "cuda"
    model = gpt.build(cfg, seed=0, device=dev, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab, (a.batch, a.prompt), generator=gen)
    ref = StaticCacheDecoder(model, batch=a.batch, length=a.length)
    ref.prefill(ids)
    out = {"world": world, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "batch": a.batch, "prompt": a.prompt, "length": a.length, "params": sum(
               p.numel() for p in model.parameters()), "check": {}}
    dec = ref
    if world > 1:
        dec = tp.ParallelDecoder(model, rank, world, tp.TorchAllReduce(), batch=a.batch,
                                 length=a.length)
        dec.prefill(ids)
        same, err = 0, 0.0
        for _ in range(a.check):
            ref.step()
            dec.step()
            same += int(torch.equal(ref.tok, dec.tok))
            err = max(err, float((ref.logits - dec.logits).abs().max()))
            dec.tok.copy_(ref.tok)              # the same next input on both, whatever the argmax
        out["check"] = {"steps": a.check, "same_tokens": same, "max_logit_diff": err,
                        "logit_scale": float(ref.logits.abs().max())}
        out["message_bytes"] = dec.log[0][2]
        out["allreduces_per_step"] = 2 * cfg.n_layer
        dec.reset(a.prompt)
    if cuda:
        from cudabook.baselines import torch_graph

        start, tok = dec.host_pos, dec.tok.clone()
        g = torch_graph(dec.step, name="decode step", capture_error_mode="thread_local")
        dec.reset(start)
        dec.tok.copy_(tok)
        torch.cuda.synchronize(dev)
        td.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g()                                     # one untimed replay: every rank has started
        torch.cuda.synchronize(dev)
        td.barrier()
        e0.record()
        for _ in range(a.steps):
            g()
        e1.record()
        torch.cuda.synchronize(dev)
        t = torch.tensor([e0.elapsed_time(e1) * 1e3 / a.steps], dtype=torch.float64, device=dev)
        td.all_reduce(t, op=td.ReduceOp.MAX)
        out["us_per_token"] = float(t)
        out["pos_after"] = int(dec.pos)
        # a graph holding NCCL work, still alive when the process group is destroyed, makes
        # destroy_process_group wait forever: free it first
        del g
        torch.cuda.synchronize(dev)
        td.barrier()
    script_done(out, rank)

if __name__ == "__main__":
    main()
