"""Training Chapter 7's GPT on the book's own kernels: the capstone's training step.

    from cudabook import gpt, gpt_train
    cfg = gpt.GPT2_SMALL
    ref = gpt_train.TorchStep(cfg, batch=8, seq=1024)     # PyTorch: autocast bf16, fused AdamW
    own = gpt_train.BookStep(cfg, batch=8, seq=1024)      # the same model, the book's kernels
    own.load(ref.model)                                          # the same initial weights
    loss = own.step(x, y)          # x, y (B, T) int64 token ids on the GPU; loss (1,) float32
    g = own.graph(x, y)            # the whole step (forward, backward, clipping, AdamW) captured

What one step does, op by op (M = B T rows, d the width, fp32 residual stream and master
weights, bf16 matmuls, like PyTorch's autocast; every op a kernel of ``kernels/``):

    forward                                 backward (reverse order)
    embedding_train   x = wte[tok]          embedding_train   dwte += scatter(dx) (deterministic)
    layernorm_train   y = LN(x) (bf16)      layernorm_train   dx += LN'(dy), dw, db
    gemm_train        qkv = y Wqkv^T        gemm_train         dy = dqkv Wqkv, dWqkv = dqkv^T y
    heads, rope_train q, k, v (B H, T, D)   rope_train, heads  dqkv from dq, dk, dv
    attention         o, lse (causal)       attention (bwd)    dq, dk, dv
    heads, gemm_train x += merge(o) Wo^T    ...
    layernorm_train, gemm_train, gelu_train, gemm_train: the MLP, x += fc2(gelu(fc(LN(x))))
    layernorm_train, gemm_train  logits (bf16, vocabulary padded to a multiple of 8)
    cross_entropy_vocab     losses and dlogits written over the logits (no second copy)
    adamw_flat        the global gradient norm, clipping and AdamW over one flat fp32 buffer,
                      writing the bf16 copy of the weights the next step's matmuls read

The matmul on Hopper is ``kernels/gemm_train.cu``: the forward's x W^T, the backward's dY W and
dY^T X, each operand read where it lies (wgmma's transpose bits), the weight gradients written in
fp32 straight into the gradient buffer, split-K deterministic. Elsewhere (and with
``versions={"matmul": "hgemm"}``) it is chapter 8's ``kernels/hgemm.cu``, which computes C = A B^T
with both operands K-major only: then W^T is kept (transposed after each update) and both
activations of a weight gradient are transposed first (``transpose16``), the step's first version.

``TorchStep`` is the same model in PyTorch the way a practitioner trains it: fp32 weights,
``torch.autocast`` bf16, SDPA (cuDNN on Hopper), fused capturable AdamW, ``clip_grad_norm_``;
``compiled=True`` puts the model and loss through ``torch.compile`` (max-autotune, CUDA graphs
left to the caller, who captures the whole step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainHyper", "TorchStep", "BookStep", "param_order", "step_flops", "schedule"]


@dataclass(frozen=True)
class TrainHyper:
    """The optimizer's settings, those of ``gpt.train`` (AdamW on every weight, clip at 1)."""

    lr: float = 6e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_norm: float = 1.0


def step_flops(cfg: Any, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 forwards; matmuls and attention,
    causal attention counted at half): the numerator of model-FLOP utilisation."""
    d, L, V, M = cfg.d, cfg.n_layer, cfg.vocab, batch * seq
    matmul = 2 * M * (L * 12 * d * d + d * V)
    attn = L * 4 * batch * seq * seq * d / 2
    return 3 * (matmul + attn)


def schedule(step: int, steps: int, lr: float, warmup: int = 100) -> float:
    """``gpt.train``'s learning rate at ``step`` of ``steps``: linear warm-up, cosine decay."""
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def param_order(cfg: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The flat buffer's layout: (PyTorch parameter name, shape), in the order they are stored.
    Embedding and LayerNorm parameters first (their gradients are accumulated with +=, so that
    prefix is the one zeroed before a step), then the LM head, then each layer's matrices."""
    d, L = cfg.d, cfg.n_layer
    out: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (cfg.vocab, d))]
    for i in range(L):
        for ln in ("ln1", "ln2"):
            out += [(f"blocks.{i}.{ln}.weight", (d,)), (f"blocks.{i}.{ln}.bias", (d,))]
    out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("head.weight", (cfg.vocab, d))]
    for i in range(L):
        out += [(f"blocks.{i}.qkv.weight", (3 * d, d)), (f"blocks.{i}.proj.weight", (d, d)),
                (f"blocks.{i}.fc.weight", (4 * d, d)), (f"blocks.{i}.fc2.weight", (d, 4 * d))]
    return out


def _torch():
    import torch

    return torch


# ============================================================================ PyTorch's step


class TorchStep:
    """Chapter 7's GPT trained by PyTorch: ``step(x, y)`` runs forward, backward, clipping and
    AdamW and returns the loss (a (,) float32 tensor, not read back). ``compiled=True``:
    ``torch.compile`` (``mode``) of the model's forward and the loss; capture the step with
    ``cudabook.baselines.torch_graph`` for the strongest PyTorch baseline."""

    def __init__(self, cfg: Any, batch: int, seq: int, seed: int = 0,
                 hyper: TrainHyper = TrainHyper(), compiled: bool = False,
                 mode: str = "max-autotune-no-cudagraphs", device: str = "cuda"):
        torch = _torch()
        from cudabook import gpt

        if seq > cfg.ctx:
            raise ValueError(f"seq = {seq} is longer than the model's context ({cfg.ctx})")
        self.cfg, self.batch, self.seq, self.hyper = cfg, batch, seq, hyper
        self.model = gpt.build(cfg, seed, device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=hyper.lr,
                                     betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                     weight_decay=hyper.weight_decay, fused=True,
                                     capturable=True)
        V = cfg.vocab

        def loss_fn(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(x, check=False)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))

        self._loss = torch.compile(loss_fn, mode=mode) if compiled else loss_fn

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next (uncaptured) steps."""
        for g in self.opt.param_groups:
            g["lr"] = float(lr)

    def step(self, x, y):
        torch = _torch()
        loss = self._loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper.max_norm,
                                       foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return loss.detach()

    def gradients(self, x, y) -> dict:
        """The loss (float) and each parameter's gradient after one forward and backward (no
        update, no clipping): the reference for ``BookStep.gradients``."""
        self.opt.zero_grad(set_to_none=True)
        loss = self._loss(x, y)
        loss.backward()
        out = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        self.opt.zero_grad(set_to_none=False)
        return {"loss": float(loss.detach()), "grads": out}


# ============================================================================ the book's step


def _ptr(t) -> int:
    return t.data_ptr()


class BookStep:
    """Chapter 7's GPT trained on the book's kernels (see the module docstring).

    All state lives in flat buffers: ``params`` (fp32 master weights), ``grads`` (fp32),
    ``m``, ``v`` (AdamW), ``shadow`` (bf16 copy of the weights), each weight a view into them
    (``view(buf, name)``); activations are preallocated for (batch, seq), so a step is a fixed
    sequence of launches that a CUDA graph captures whole.
    """

    ALIGN = 64          # every view starts at a multiple of 64 elements (256 bytes in fp32)

    def __init__(self, cfg: Any, batch: int, seq: int, hyper: TrainHyper = TrainHyper(),
                 device: str = "cuda", versions: dict | None = None):
        torch = _torch()
        import cudabook as cb

        if cfg.head_dim not in (64, 128):
            raise ValueError(f"head dimension {cfg.head_dim}: the attention kernels take 64 or "
                             "128")
        if seq > cfg.ctx:
            raise ValueError(f"seq = {seq} is longer than the model's context ({cfg.ctx})")
        if cfg.d % 8:
            raise ValueError(f"width d = {cfg.d} must be a multiple of 8 (16-byte rows)")
        self.cfg, self.B, self.T, self.hyper = cfg, batch, seq, hyper
        self.M = M = batch * seq
        self.Vp = Vp = (cfg.vocab + 7) // 8 * 8      # logits rows of 16 bytes
        d, L, H, D = cfg.d, cfg.n_layer, cfg.n_head, cfg.head_dim
        dev = torch.device(device)
        self.dev = dev
        # ---------------------------------------------------------------- the flat buffers
        self.offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
        n = 0
        for name, shape in param_order(cfg):
            if name == "head.weight":
                shape = (Vp, d)                        # padded rows: zero forever
            self.offsets[name] = (n, shape)
            n += (math.prod(shape) + self.ALIGN - 1) // self.ALIGN * self.ALIGN
            if name == "ln_f.bias":
                self.n_zeroed = n                      # grads [0, n_zeroed) are += targets
        self.n = n
        f32, bf16 = torch.float32, torch.bfloat16
        self.params = torch.zeros(n, dtype=f32, device=dev)
        self.grads = torch.zeros(n, dtype=f32, device=dev)
        self.m = torch.zeros(n, dtype=f32, device=dev)
        self.v = torch.zeros(n, dtype=f32, device=dev)
        self.shadow = torch.zeros(n, dtype=bf16, device=dev)
        # the matmul: gemm_train (Hopper: every product reads its operands where they lie) or
        # hgemm (C = A B^T only: transposed weights kept after each update, activations
        # transposed before each weight gradient)
        cc = tuple(cb.launch.device().cc) if dev.type == "cuda" else (0, 0)
        self.matmul = (versions or {}).get("matmul", "gemm_train" if cc == (9, 0) else "hgemm")
        if self.matmul not in ("gemm_train", "hgemm"):
            raise ValueError(f"versions['matmul']: 'gemm_train' or 'hgemm', got {self.matmul!r}")
        if self.matmul == "gemm_train" and cc != (9, 0):
            raise ValueError(f"versions['matmul'] = 'gemm_train' needs compute capability 9.0 "
                             f"(wgmma); this GPU is {cc[0]}.{cc[1]}: use 'hgemm'")
        self.wT = {name: torch.empty(shape[::-1], dtype=bf16, device=dev)
                   for name, (_, shape) in self.offsets.items() if len(shape) == 2
                   and name != "wte.weight"} if self.matmul == "hgemm" else {}
        # ---------------------------------------------------------------- activations
        e = torch.empty
        self.x = [e(M, d, dtype=f32, device=dev) for _ in range(2 * L + 1)]  # residual stream
        self.stats = [(e(M, dtype=f32, device=dev), e(M, dtype=f32, device=dev))
                      for _ in range(2 * L + 1)]                             # mean, rstd per LN
        self.ln = [e(M, d, dtype=bf16, device=dev) for _ in range(2 * L + 1)]  # LN outputs
        self.q = [e(batch * H, seq, D, dtype=bf16, device=dev) for _ in range(L)]
        self.k = [e(batch * H, seq, D, dtype=bf16, device=dev) for _ in range(L)]
        self.vv = [e(batch * H, seq, D, dtype=bf16, device=dev) for _ in range(L)]
        self.o = [e(batch * H, seq, D, dtype=bf16, device=dev) for _ in range(L)]
        self.lse = [e(batch * H, seq, dtype=f32, device=dev) for _ in range(L)]
        self.att = [e(M, d, dtype=bf16, device=dev) for _ in range(L)]       # merged heads
        self.h = [e(M, 4 * d, dtype=bf16, device=dev) for _ in range(L)]     # fc output
        self.g = [e(M, 4 * d, dtype=bf16, device=dev) for _ in range(L)]     # gelu(h)
        self.qkv = e(M, 3 * d, dtype=bf16, device=dev)
        self.y = e(M, d, dtype=bf16, device=dev)                             # a branch output
        self.logits = e(M, Vp, dtype=bf16, device=dev)
        self.losses = e(M, dtype=f32, device=dev)
        self.loss = e(1, dtype=f32, device=dev)
        # backward scratch
        self.dx = e(M, d, dtype=f32, device=dev)                 # d(residual stream), fp32
        self.dx16 = e(M, d, dtype=bf16, device=dev)              # its bf16 copy
        self.dy = e(M, d, dtype=bf16, device=dev)                # d(LN output) from a matmul
        self.dbig = e(M, 4 * d, dtype=bf16, device=dev)          # dg, then dh (in place)
        self.dqkv = e(M, 3 * d, dtype=bf16, device=dev)
        self.dq = e(batch * H, seq, D, dtype=bf16, device=dev)
        self.dk = torch.empty_like(self.dq)
        self.dv = torch.empty_like(self.dq)
        self.do = torch.empty_like(self.dq)
        if self.matmul == "hgemm":
            big = max(M * 4 * d, M * Vp)                         # transposed activations
            self.tA = e(big, dtype=bf16, device=dev)
            self.tB = e(max(M * 4 * d, M * d), dtype=bf16, device=dev)
            self.dW = e(max(Vp * d, 4 * d * d), dtype=bf16, device=dev)   # a weight's bf16 grad
        self.norm = e(1, dtype=f32, device=dev)
        self.lr = torch.full((1,), hyper.lr, dtype=f32, device=dev)   # read on the device
        self.wpe0 = torch.zeros(seq, d, dtype=f32, device=dev)   # no learned positions (RoPE)
        self.dwpe0 = torch.zeros(seq, d, dtype=f32, device=dev)
        cos, sin = _rope_tables(cfg, seq, dev)
        self.cos, self.sin = cos, sin
        self.tok = torch.zeros(batch, seq, dtype=torch.int64, device=dev)
        self.tgt = torch.zeros(batch, seq, dtype=torch.int64, device=dev)
        # ---------------------------------------------------------------- kernels
        self.k_ = _Kernels(cb, versions or {})
        self.work = None
        if self.matmul == "gemm_train":             # split-K scratch, sized once (capture-safe)
            shapes = []
            for n_out, k_in in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d), (Vp, d)):
                shapes += [("nt", M, n_out, k_in, "bfloat16"), ("nn", M, k_in, n_out, "bfloat16"),
                           ("tn", n_out, k_in, M, "float32")]
            self.work = self.k_.gt.Workspace.for_shapes(self.params, shapes)
        self.state = self.k_.adamw.new_state(self.params)
        self._graph = None

    # ------------------------------------------------------------------------- views
    def view(self, buf, name: str):
        off, shape = self.offsets[name]
        return buf[off:off + math.prod(shape)].view(shape)

    def load(self, model) -> None:
        """Copy a PyTorch twin's weights (``gpt.GPT``, fp32) into the flat buffer; the bf16
        shadow and the transposes follow. Optimizer state is reset."""
        torch = _torch()
        sd = dict(model.named_parameters())
        with torch.no_grad():
            self.params.zero_()
            for name in self.offsets:
                p = sd[name].detach().float()
                dst = self.view(self.params, name)
                dst[:p.shape[0]].copy_(p)
            self.m.zero_()
            self.v.zero_()
        self.state = self.k_.adamw.new_state(self.params)
        self.k_.cast.to_bf16(self.params, self.shadow)
        self._transpose_weights()

    def state_dict(self) -> dict:
        """The weights as PyTorch tensors named like ``gpt.GPT``'s (head without its padding)."""
        out = {}
        for name in self.offsets:
            w = self.view(self.params, name)
            out[name] = w[:self.cfg.vocab].clone() if name == "head.weight" else w.clone()
        return out

    def _transpose_weights(self) -> None:
        for name, t in self.wT.items():          # (hgemm only: gemm_train reads W as it is)
            self.k_.transpose.transpose(self.view(self.shadow, name), out=t)

    # ------------------------------------------------------------------------- the step
    def _mm(self, A, W, C):
        """C = A W^T: a layer's forward."""
        if self.matmul == "gemm_train":
            return self.k_.gt.gemm(A, W, "nt", out=C, work=self.work)
        return self.k_.matmul(A, W, C)

    def _mm_dx(self, dY, name: str, C):
        """C = dY W: the gradient of a layer's input (W the bf16 weight ``name``)."""
        if self.matmul == "gemm_train":
            return self.k_.gt.gemm(dY, self.view(self.shadow, name), "nn", out=C, work=self.work)
        return self.k_.matmul(dY, self.wT[name], C)

    def _weight_grad(self, dY, X, name: str) -> None:
        """grad[name] = dY^T X in fp32: gemm_train writes the fp32 sums straight into the
        gradient buffer; hgemm rounds them to bf16 (as autocast's product does) and casts."""
        k = self.k_
        M = dY.shape[0]
        N, K = dY.shape[1], X.shape[1]
        if self.matmul == "gemm_train":
            k.gt.gemm(dY, X, "tn", out=self.view(self.grads, name)[:N], work=self.work)
            return
        dYt = self.tA[:N * M].view(N, M)
        Xt = self.tB[:K * M].view(K, M)
        k.transpose.transpose(dY, out=dYt)
        k.transpose.transpose(X, out=Xt)
        dW = self.dW[:N * K].view(N, K)
        self._mm(dYt, Xt, dW)
        k.cast.to_f32(dW, self.view(self.grads, name)[:N])

    def forward(self) -> None:
        """Forward from ``self.tok`` / ``self.tgt`` to ``self.loss`` (dlogits left in
        ``self.logits`` for the backward)."""
        cfg, k, B, T = self.cfg, self.k_, self.B, self.T
        H, L = cfg.n_head, cfg.n_layer
        P = lambda name: self.view(self.params, name)        # noqa: E731 - fp32 master
        S = lambda name: self.view(self.shadow, name)        # noqa: E731 - bf16 copy
        k.embedding.forward(self.tok, P("wte.weight"), self.wpe0, self.x[0])
        for i in range(L):
            pre = f"blocks.{i}."
            a, b = 2 * i, 2 * i + 1
            # attention branch: LN1 (the residual add of the previous MLP branch fused in)
            if i == 0:
                k.ln.forward(self.x[0], P(pre + "ln1.weight"), P(pre + "ln1.bias"), self.ln[a],
                             *self.stats[a], eps=cfg.eps)
            else:
                k.ln.forward(self.x[a - 1], P(pre + "ln1.weight"), P(pre + "ln1.bias"),
                             self.ln[a], *self.stats[a], residual=self.y, x_out=self.x[a],
                             eps=cfg.eps)
            self._mm(self.ln[a], S(pre + "qkv.weight"), self.qkv)
            k.heads.split_qkv(self.qkv, B, T, H, self.q[i], self.k[i], self.vv[i])
            k.rope(self.q[i], self.cos, self.sin, inverse=False)
            k.rope(self.k[i], self.cos, self.sin, inverse=False)
            k.attn_fwd(self.q[i], self.k[i], self.vv[i], causal=True,
                       out=(self.o[i], self.lse[i]))
            k.heads.merge(self.o[i], B, T, H, self.att[i])
            self._mm(self.att[i], S(pre + "proj.weight"), self.y)
            # MLP branch: LN2 with x += attention output
            k.ln.forward(self.x[a], P(pre + "ln2.weight"), P(pre + "ln2.bias"), self.ln[b],
                         *self.stats[b], residual=self.y, x_out=self.x[b], eps=cfg.eps)
            self._mm(self.ln[b], S(pre + "fc.weight"), self.h[i])
            k.gelu.forward(self.h[i], self.g[i])
            self._mm(self.g[i], S(pre + "fc2.weight"), self.y)
        f = 2 * L
        k.ln.forward(self.x[f - 1], P("ln_f.weight"), P("ln_f.bias"), self.ln[f],
                     *self.stats[f], residual=self.y, x_out=self.x[f], eps=cfg.eps)
        self._mm(self.ln[f], S("head.weight"), self.logits)
        k.xent.forward_backward(self.logits, self.tgt.view(-1), self.losses, cfg.vocab)
        k.xent.mean(self.losses, self.loss)

    def backward(self) -> None:
        """Gradients of every weight into ``self.grads`` (the prefix [0, n_zeroed) zeroed
        first: those are accumulated with +=)."""
        cfg, k, B, T = self.cfg, self.k_, self.B, self.T
        H, L = cfg.n_head, cfg.n_layer
        P = lambda name: self.view(self.params, name)        # noqa: E731
        G = lambda name: self.view(self.grads, name)         # noqa: E731
        self.grads[:self.n_zeroed].zero_()
        f = 2 * L
        # LM head: dlogits (in self.logits) -> d(ln_f output), dW_head
        self._mm_dx(self.logits, "head.weight", self.dy)
        self._weight_grad(self.logits, self.ln[f], "head.weight")
        k.ln.backward(self.dy, self.x[f], P("ln_f.weight"), *self.stats[f], self.dx,
                      G("ln_f.weight"), G("ln_f.bias"), dx16=self.dx16, accumulate=False)
        for i in reversed(range(L)):
            pre = f"blocks.{i}."
            a, b = 2 * i, 2 * i + 1
            # MLP branch: x[b+1] = x[b] + fc2(gelu(fc(LN2(x[b]))))
            self._weight_grad(self.dx16, self.g[i], pre + "fc2.weight")
            self._mm_dx(self.dx16, pre + "fc2.weight", self.dbig)        # dg
            k.gelu.backward(self.dbig, self.h[i], self.dbig)                    # dh in place
            self._weight_grad(self.dbig, self.ln[b], pre + "fc.weight")
            self._mm_dx(self.dbig, pre + "fc.weight", self.dy)
            k.ln.backward(self.dy, self.x[b], P(pre + "ln2.weight"), *self.stats[b], self.dx,
                          G(pre + "ln2.weight"), G(pre + "ln2.bias"), dx16=self.dx16)
            # attention branch: x[b] = x[a] + proj(attn(LN1(x[a])))
            self._weight_grad(self.dx16, self.att[i], pre + "proj.weight")
            self._mm_dx(self.dx16, pre + "proj.weight", self.y)         # d(att), bf16
            k.heads.split(self.y, B, T, H, self.do)
            k.attn_bwd(self.q[i], self.k[i], self.vv[i], self.o[i], self.lse[i], self.do,
                       causal=True, out=(self.dq, self.dk, self.dv))
            k.rope(self.dq, self.cos, self.sin, inverse=True)
            k.rope(self.dk, self.cos, self.sin, inverse=True)
            k.heads.merge_qkv(self.dq, self.dk, self.dv, B, T, H, self.dqkv)
            self._weight_grad(self.dqkv, self.ln[a], pre + "qkv.weight")
            self._mm_dx(self.dqkv, pre + "qkv.weight", self.dy)
            k.ln.backward(self.dy, self.x[a], P(pre + "ln1.weight"), *self.stats[a], self.dx,
                          G(pre + "ln1.weight"), G(pre + "ln1.bias"), dx16=self.dx16)
        k.embedding.backward(self.tok, self.dx, G("wte.weight"), self.dwpe0)

    def update(self) -> None:
        """Clip by the global gradient norm and take an AdamW step; rewrite the bf16 shadow and
        the transposed weights."""
        h, k = self.hyper, self.k_
        k.adamw.grad_norm(self.grads, self.norm)
        k.adamw.step(self.params, self.grads, self.m, self.v, self.shadow, self.state, self.n,
                     self.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                     weight_decay=h.weight_decay, max_norm=h.max_norm, norm=self.norm)
        self._transpose_weights()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (a device scalar the captured step reads, so a
        schedule needs no re-capture)."""
        self.lr.fill_(float(lr))

    def gradients(self, x, y) -> dict:
        """Forward and backward only (no update) on a batch: the loss (float) and each weight's
        gradient as a PyTorch tensor named like ``gpt.GPT``'s parameters (the head without its
        padding rows), before clipping. For checking against PyTorch's autograd."""
        self._set_batch(x, y)
        self.forward()
        self.backward()
        out = {name: self.view(self.grads, name).clone() for name in self.offsets}
        out["head.weight"] = out["head.weight"][:self.cfg.vocab]
        return {"loss": float(self.loss), "grads": out}

    def _run(self) -> None:
        self.forward()
        self.backward()
        self.update()

    def step(self, x, y):  # noqa: D401
        """One training step on token ids x and targets y ((B, T) on the GPU); returns the loss
        (a (1,) float32 tensor, not read back)."""
        self._set_batch(x, y)
        self._run()
        return self.loss

    def _set_batch(self, x, y) -> None:
        for t, name in ((x, "x"), (y, "y")):
            if tuple(t.shape) != (self.B, self.T):
                raise ValueError(f"{name} must be ({self.B}, {self.T}) token ids, got "
                                 f"{tuple(t.shape)}")
            if not t.is_cuda:
                raise ValueError(f"{name} must be on the GPU")
        self.tok.copy_(x)
        self.tgt.copy_(y)

    def graph(self):
        """The whole step (forward, backward, update) captured in one CUDA graph; returns
        ``run(x, y)``, which copies the batch in and replays it (returns the loss tensor).

        Capturing needs one warm-up step; the weights, optimizer state and step count are
        saved before it and put back after, so the first replay is the first step."""
        from cudabook import baselines

        keep = [t.clone() for t in (self.params, self.m, self.v, self.state)]
        g = baselines.torch_graph(self._run, warmup=1, name="book's training step")
        for t, k in zip((self.params, self.m, self.v, self.state), keep):
            t.copy_(k)
        self.k_.cast.to_bf16(self.params, self.shadow)
        self._transpose_weights()
        self._graph = g

        def run(x, y):
            self._set_batch(x, y)
            g()
            return self.loss

        return run


def _rope_tables(cfg: Any, n: int, device) -> tuple[Any, Any]:
    from cudabook import gpt

    cos, sin = gpt.rope_tables(cfg, n, device)
    return cos.contiguous(), sin.contiguous()


class _Kernels:
    """The launchers the step uses, loaded once (``kernels/*_launch.py``)."""

    def __init__(self, cb: Any, versions: dict):
        import importlib

        load = lambda op: importlib.import_module(f"kernels.{op}_launch")   # noqa: E731
        self.embedding = load("embedding_train")
        self.ln = load("layernorm_train")
        self.heads = load("heads")
        self.transpose = load("transpose16")
        self.cast = load("cast16")
        self.gelu = load("gelu_train")
        self.xent = load("cross_entropy_vocab")
        self.adamw = load("adamw_flat")
        self.rope_mod = load("rope_train")
        self.hgemm = load("hgemm")
        self.gt = load("gemm_train")
        self.attn = load("attention")
        fwd, bwd = self.attn.op_versions("bfloat16", cb.launch.device().cc)
        self.fwd_version = versions.get("attention", fwd)
        self.bwd_version = versions.get("attention_bwd", bwd)
        self.mm_version = versions.get("hgemm", "v9")

    def matmul(self, A, W, C):
        return self.hgemm.matmul(A, W, version=self.mm_version, out=C)

    def rope(self, x, cos, sin, inverse: bool = False):
        return self.rope_mod.rope(x, cos, sin, inverse=inverse)

    def attn_fwd(self, q, k, v, causal: bool, out):
        return self.attn.forward(q, k, v, causal=causal, version=self.fwd_version, out=out)

    def attn_bwd(self, q, k, v, o, lse, do, causal: bool, out):
        return self.attn.backward(q, k, v, o, lse, do, causal=causal,
                                  version=self.bwd_version, out=out)
