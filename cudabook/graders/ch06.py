"""Graders of Chapter 6, "A complete training pipeline on your own kernels".

ex06_1  Numba: softmax cross-entropy forward + backward fused, one thread per row   simulator
ex06_2  Numba: the bias gradient, a column sum with a shared-memory block            simulator
ex06_3  Numba: the AdamW update (weight decay, bias correction) for arrays of any strides  simulator
ex06_4  Python: a linear layer as a torch.autograd.Function through DLPack (gradcheck)  CPU or GPU

Every reference is PyTorch autograd (or torch.optim.AdamW) in float64.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import env
from ..check import close, to_numpy
from ._core import (
    GradeError,
    call,
    canary_ok,
    ceil_div,
    error_summary,
    fresh_rng,
    guarded,
    padded,
    passed,
    to_device,
    xp,
)
from ._race import simulate
from ._static import refuse_stub

__all__ = ["ex06_1", "ex06_2", "ex06_3", "ex06_4"]

#: (atol, rtol) of a float32 gradient against the float64 reference
GRAD_TOL = (1e-6, 1e-4)


def _torch():
    import torch

    return torch


def _same(o: np.ndarray, r: np.ndarray, atol: float, rtol: float) -> bool:
    return o.shape == r.shape and bool(close(o, r, atol, rtol).all())


# ----------------------------------------------------------------------------- ex06.1
CE_THREADS = 32


def _ce_reference(z: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    torch = _torch()
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(zt, torch.tensor(labels, dtype=torch.int64))
    (dz,) = torch.autograd.grad(loss, zt)
    return float(loss.detach()), dz.numpy()


def _ce_cases(rng) -> list[tuple[str, np.ndarray, np.ndarray]]:
    out = []
    for M, C in ((3, 7), (37, 13), (CE_THREADS + 1, 10), (1, 40)):
        z = (rng.standard_normal((M, C)) * 3).astype(np.float32)
        out.append((f"M={M}, C={C}", z, rng.integers(0, C, M).astype(np.int32)))
    big = (rng.standard_normal((5, 20)) * 3).astype(np.float32)
    big[:, 3] += 1000.0                       # exp(1000) overflows float32 and float64
    out.append(("logits near 1000 (M=5, C=20)", big, rng.integers(0, 20, 5).astype(np.int32)))
    return out


def ex06_1(kernel) -> None:
    """``kernel(z, labels, loss, dz)``: a @cuda.jit kernel, one thread per row of the (M, C)
    float32 logits ``z``, launched [ceil(M / 32), 32]. It adds the row's loss divided by M to
    ``loss[0]`` (zeroed by the grader) with ``cuda.atomic.add`` and writes the gradient of the
    MEAN loss, (softmax(z_r) - onehot(y_r)) / M, to ``dz``. ``z`` must not change.
    """
    ex = "ex06.1"
    refuse_stub(ex, kernel)
    rng, seed = fresh_rng()
    m = xp()
    for rep in range(2):
        for what, z, labels in _ce_cases(rng):
            M, C = z.shape
            case = f"{what} (seed {seed}, call {rep + 1})"
            ref_loss, ref_dz = _ce_reference(z, labels)
            # padded to the rows the launch covers: a kernel without its guard reads zeros
            # (labels 0) on a GPU instead of faulting; its writes land in dz's canary
            extra = ceil_div(M, CE_THREADS) * CE_THREADS - M
            z_d, y_d = padded(z, extra * C), padded(labels, extra)
            loss = m.zeros(1, dtype=np.float32)
            dz, buf = guarded((M, C))

            def run(z_d=z_d, loss=loss, dz=dz, y_d=y_d, M=M, case=case):
                try:
                    kernel[ceil_div(M, CE_THREADS), CE_THREADS](z_d, y_d, loss, dz)
                except OverflowError:   # the simulator's math.exp raises where a GPU gives inf
                    raise GradeError(f"{ex}: {case}: exp overflowed: subtract the row's maximum "
                                     "before exp (z - max <= 0), and use the same max in the "
                                     "loss, log(sum) + max - z[y]") from None
            call(ex, case, run)
            if not np.array_equal(to_numpy(z_d), z):
                raise GradeError(f"{ex}: {case}: the logits z changed: the kernel writes into "
                                 "its input (in place). dz is a separate output; z must stay "
                                 "as it was (autograd may still need it, and the gradient of "
                                 "a row is computed from all of its z)")
            if not canary_ok(buf, M * C):
                raise GradeError(f"{ex}: {case}: wrote past the end of dz: missing bounds guard "
                                 "(if r < M)?")
            o = to_numpy(dz).astype(np.float64)
            lv = float(to_numpy(loss)[0])
            nan = np.isnan(o)
            if nan.all():
                raise GradeError(f"{ex}: {case}: dz never written (all NaN): the stub's body, "
                                 "or no thread reached the write?")
            if nan.any() and "1000" in what:    # the small cases before it were all written
                raise GradeError(f"{ex}: {case}: NaN in dz where the logits are near 1000: "
                                 "exp overflowed to inf and inf / inf is NaN: subtract the row's "
                                 "maximum before exp (z - max <= 0)")
            if nan.any():
                r, j = (int(v) for v in np.argwhere(nan)[0])
                raise GradeError(f"{ex}: {case}: dz[{r}, {j}] never written ({int(nan.sum())} "
                                 "of dz's elements): every element of the row gets "
                                 "p - [j == y], the label's column too")
            if not np.isfinite(o).all() or not np.isfinite(lv):
                hint = ("subtract the row's maximum before exp (z - max <= 0)"
                        if "1000" in what else "a division by a zero sum?")
                raise GradeError(f"{ex}: {case}: inf or NaN in the result: {hint}")
            atol, rtol = GRAD_TOL
            if not _same(o, ref_dz, atol, rtol):
                if M > 1 and _same(o, ref_dz * M, atol * M, rtol):
                    raise GradeError(f"{ex}: {case}: dz is {M}x the reference: the gradient of "
                                     "the SUM of the row losses; the loss is the mean over the "
                                     f"M = {M} rows, so scale by 1/M")
                if M > 1 and _same(o, ref_dz / M, atol / M, rtol):
                    raise GradeError(f"{ex}: {case}: dz is 1/{M} of the reference: divided by "
                                     "M twice?")
                if _same(-o, ref_dz, atol, rtol):
                    raise GradeError(f"{ex}: {case}: dz has the wrong sign: it is "
                                     "(p - onehot) / M, softmax minus the one-hot label")
                bad = ~close(o, ref_dz, atol, rtol)
                raise GradeError(f"{ex}: {case}: dz wrong: {error_summary(o, ref_dz, bad)}; "
                                 "dz[r, j] = (exp(z[r, j] - max) / sum - [j == y[r]]) / M")
            tol = 1e-6 + 1e-5 * abs(ref_loss)
            if abs(lv - ref_loss) > tol:
                if M > 1 and abs(lv - M * ref_loss) <= M * tol:
                    raise GradeError(f"{ex}: {case}: loss {lv:.6g} is the SUM of the row losses "
                                     f"(the mean is {ref_loss:.6g}): add each row's loss / M")
                raise GradeError(f"{ex}: {case}: loss {lv:.6g}, expected {ref_loss:.6g}: a row "
                                 "adds (log(sum of exp(z - max)) + max - z[y]) / M to loss[0] "
                                 "with cuda.atomic.add (a plain += races between threads)")
    passed(ex)


# ----------------------------------------------------------------------------- ex06.2
BG_BLOCK = (32, 4)      # (columns, row groups) of ex06.2's block
_BG_SYNC_HINT = ("a cuda.syncthreads() between writing the partial sums to shared memory and "
                 "reading them")


def ex06_2(kernel) -> None:
    """``kernel(dz, db)``: a @cuda.jit kernel launched [ceil(N / 32), (32, 4)] on the (M, N)
    float32 ``dz``: db[j] = sum over the M rows of dz[:, j]. Thread (tx, ty) of block bx owns
    column j = 32 bx + tx and rows ty, ty + 4, ...; the 4 partial sums meet in shared memory.
    """
    ex = "ex06.2"
    refuse_stub(ex, kernel)
    rng, seed = fresh_rng()
    # square first: a transposed index gives the row sums there (on other shapes it reads out
    # of range); then non-square shapes, more columns than one block, a single row
    sizes = [(33, 33), (37, 45), (45, 37), (6, 70), (1, 5)]
    if not env.SIM:
        sizes += [(1000, 33), (4096, 1024)]
    for rep in range(2):
        for M, N in sizes:
            case = f"dz of M={M} rows x N={N} columns (seed {seed}, call {rep + 1})"
            dz = rng.standard_normal((M, N)).astype(np.float32)
            ref = dz.astype(np.float64).sum(0)
            db, buf = guarded((N,))
            # a missing column guard or a transposed index reads the zero tail on a GPU
            big = max(M, N)
            dz_d = padded(dz, big * (big + BG_BLOCK[0]))

            def run(dz_d=dz_d, db=db, N=N, case=case):
                try:
                    kernel[ceil_div(N, BG_BLOCK[0]), BG_BLOCK](dz_d, db)
                except IndexError as e:
                    raise GradeError(f"{ex}: {case}: index out of range ({e}): missing guard "
                                     "(j < N) on the column, or dz indexed [column, row]? dz "
                                     "is (M, N): dz[i, j] with i the row, j = the column") \
                        from None
            call(ex, case, run)
            if not canary_ok(buf, N):
                raise GradeError(f"{ex}: {case}: wrote past the end of db: missing guard "
                                 "(if j < N) before the write?")
            o = to_numpy(db).astype(np.float64)
            nan = np.isnan(o)
            if nan.all():
                raise GradeError(f"{ex}: {case}: db never written (all NaN)")
            if nan.any():
                j = int(np.argmax(nan))
                raise GradeError(f"{ex}: {case}: db[{j}] never written: is every column covered "
                                 "(the grid has ceil(N / 32) blocks of 32 columns)?")
            atol, rtol = 1e-4 * max(1.0, np.sqrt(M)), 1e-5
            if _same(o, ref, atol, rtol):
                continue
            if M > 1 and _same(o, ref / M, atol / M, rtol):
                raise GradeError(f"{ex}: {case}: db is the MEAN of each column (1/{M} of the sum): "
                                 "a bias gradient is the SUM over the batch rows (the 1/M of a "
                                 "mean loss is already inside dz)")
            rows = dz.astype(np.float64).sum(1)
            if N <= M and _same(o, rows[:N], atol, rtol):
                raise GradeError(f"{ex}: {case}: db holds the sums of the ROWS of dz (a "
                                 "transposition): db[j] sums column j, dz[:, j], over the M rows")
            bad = ~close(o, ref, atol, rtol)
            part = [dz[t::BG_BLOCK[1]].astype(np.float64).sum(0) for t in range(BG_BLOCK[1])]
            if any(_same(o, p, atol, rtol) for p in part):
                raise GradeError(f"{ex}: {case}: db is the partial sum of one thread row only: "
                                 "add the 4 partials from shared memory before writing; or is "
                                 f"{_BG_SYNC_HINT} missing?")
            raise GradeError(f"{ex}: {case}: db wrong: {error_summary(o, ref, bad)}. Rows "
                             "skipped or counted twice (thread row ty adds rows ty, ty + 4, ...), "
                             f"or {_BG_SYNC_HINT} missing?")
    simulate(ex, "ex06_2", [("bias_grad", kernel)], hint=_BG_SYNC_HINT)
    passed(ex)


# ----------------------------------------------------------------------------- ex06.3
ADAMW_HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _adamw_torch(p0: np.ndarray, grads: list[np.ndarray], **hp) -> list[np.ndarray]:
    torch = _torch()
    p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([p], **hp, foreach=False)
    out = []
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(p.detach().numpy().copy())
    return out


def _adamw_variant(p0, grads, *, correct=True, decoupled=True, decay=True, keep=True, lr, betas,
                   eps, weight_decay):
    """AdamW by hand with one thing changed (the mistakes ex06.3 names)."""
    b1, b2 = betas
    p, m, v, out = p0.copy(), np.zeros_like(p0), np.zeros_like(p0), []
    wd = weight_decay if decay else 0.0
    for t, g in enumerate(grads, start=1):
        if not keep:
            m, v = np.zeros_like(p0), np.zeros_like(p0)
        if not decoupled:
            g = g + wd * p
        else:
            p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if correct:
            p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
        else:
            p = p - lr * m / (np.sqrt(v) + eps)
        out.append(p)
    return out


def ex06_3(adamw_update: Callable) -> None:
    """``adamw_update(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay)`` updates the 2D
    float64 arrays p, m, v in place at step t (1 at the first step), as torch.optim.AdamW
    does; the arrays may be views with any strides (a transposed weight). Three steps from the
    same start, step 1 included, against torch.optim.AdamW in float64.
    """
    ex = "ex06.3"
    rng, seed = fresh_rng()
    hp = ADAMW_HP
    args = dict(lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                weight_decay=hp["weight_decay"])
    for layout in ("contiguous", "transposed view"):
        for R, C in ((7, 5), (3, 40)):
            case = f"{R}x{C} parameters, {layout} (seed {seed})"
            p0 = rng.standard_normal((R, C))
            grads = [rng.standard_normal((R, C)) for _ in range(3)]
            ref = _adamw_torch(p0, grads, **hp)
            if layout == "contiguous":
                dev = [to_device(a.copy()) for a in (p0, np.zeros((R, C)), np.zeros((R, C)))]
                views = dev
            else:   # arrays stored (C, R), handed over as their transposes: (R, C) views
                dev = [to_device(np.ascontiguousarray(a.T)) for a in
                       (p0, np.zeros((R, C)), np.zeros((R, C)))]
                views = [a.T for a in dev]
            p, m, v = views
            for t, g in enumerate(grads, start=1):
                gd = to_device(g) if layout == "contiguous" else \
                    to_device(np.ascontiguousarray(g.T)).T
                def run(t=t, gd=gd, case=case):
                    try:
                        adamw_update(p, gd, m, v, t, **args)
                    except ZeroDivisionError:
                        raise GradeError(f"{ex}: {case}, step {t}: division by zero: at step "
                                         "t = 1 the corrections are 1 - beta^1, not 1 - beta^0 "
                                         "= 0: t counts from 1") from None
                call(ex, f"{case}, step {t}", run)
                o = to_numpy(p).astype(np.float64)
                r = ref[t - 1]
                if _same(o, r, 1e-12, 1e-9):
                    continue
                where = f"{case}, step {t}"
                before = p0 if t == 1 else ref[t - 2]
                if np.array_equal(o, before):
                    if layout != "contiguous":
                        raise GradeError(f"{ex}: {where}: p did not change. It is a transposed "
                                         "view (not C-contiguous): p.ravel() / reshape(-1) of it "
                                         "is a COPY, and the update went into the copy. Index "
                                         "the 2D arrays (cuda.grid(2), p[i, j]), which works for "
                                         "any strides")
                    raise GradeError(f"{ex}: {where}: p did not change: is the kernel launched, "
                                     "and does it write p in place?")
                if not np.isfinite(o).all():
                    raise GradeError(f"{ex}: {where}: inf or NaN in p: at step t = 1 the "
                                     "corrections are 1 - beta^1 (not 1 - beta^0 = 0): t "
                                     "counts from 1")
                hints = [
                    (dict(correct=False), "no bias correction: divide m by 1 - beta1^t and v by "
                     "1 - beta2^t (at step 1 m is 10x too small without it)"),
                    (dict(decoupled=False), "the weight decay is added to the gradient (Adam + "
                     "L2); AdamW decays the parameter itself: p *= 1 - lr * weight_decay"),
                    (dict(decay=False), "no weight decay: p *= 1 - lr * weight_decay first"),
                ]
                hist = grads[:t]
                fits = [hint for kw, hint in hints
                        if _same(o, _adamw_variant(p0, hist, **kw, **hp)[-1], 1e-12, 1e-9)]
                if len(fits) == 1:
                    raise GradeError(f"{ex}: {where}: {fits[0]}")
                if len(fits) > 1:
                    # at step 1 Adam's step is about lr * sign(g), so Adam + L2 and no decay can
                    # give the same p; the moments they carry differ, and so does the next step
                    if t < len(grads):
                        continue
                    raise GradeError(f"{ex}: {where}: one of: " + "; or ".join(fits))
                if t > 1 and _same(o, _adamw_variant(p0, hist, keep=False, **hp)[-1], 1e-12,
                                   1e-9):
                    raise GradeError(f"{ex}: {where}: p is what AdamW gives when m and v restart "
                                     "from zero at every step: are m and v updated in place "
                                     "(the moments carry over between steps)?")
                bad = ~close(o, r, 1e-12, 1e-9)
                raise GradeError(f"{ex}: {where}: p wrong: {error_summary(o, r, bad)}")
    passed(ex)


# ----------------------------------------------------------------------------- ex06.4
def _spy_dlpack():
    """Count calls of torchops.as_array / as_tensor while the block runs."""
    import contextlib

    from .. import torchops

    @contextlib.contextmanager
    def spy():
        counts = {"as_array": 0, "as_tensor": 0}
        orig = {k: getattr(torchops, k) for k in counts}

        def wrap(k):
            def f(*a, **kw):
                counts[k] += 1
                return orig[k](*a, **kw)
            return f
        for k in counts:
            setattr(torchops, k, wrap(k))
        try:
            yield counts
        finally:
            for k, f in orig.items():
                setattr(torchops, k, f)
    return spy()


def ex06_4(Linear: Any) -> None:
    """``Linear``: a torch.autograd.Function with forward(ctx, x, W, b) = x @ W + b for x (M, K),
    W (K, N), b (N,), computed on arrays from ``torchops.as_array`` (DLPack, no copy) and
    returned with ``torchops.as_tensor``; backward returns dx, dW, db. Checked against autograd
    in float64 on non-square shapes (with transposed inputs and a non-contiguous grad_output),
    inputs and grad_output unchanged, and torch.autograd.gradcheck.
    """
    ex = "ex06.4"
    torch = _torch()
    dev = "cuda" if env.HAS_GPU else "cpu"
    kw = dict(dtype=torch.float64, device=dev)
    apply = getattr(Linear, "apply", None)
    if apply is None:
        raise GradeError(f"{ex}: Linear must be a torch.autograd.Function subclass (it has no "
                         ".apply)")
    g = torch.Generator().manual_seed(int(fresh_rng()[1]) % 2**31)
    for M, K, N, layout in ((5, 3, 4, "contiguous"), (6, 7, 2, "x transposed"),
                            (4, 4, 4, "square")):
        case = f"x {M}x{K}, W {K}x{N} ({layout})"
        x0 = torch.randn(M, K, generator=g, dtype=torch.float64)
        if layout == "x transposed":
            x0 = torch.randn(K, M, generator=g, dtype=torch.float64).t()
        W0 = torch.randn(K, N, generator=g, dtype=torch.float64)
        b0 = torch.randn(N, generator=g, dtype=torch.float64)
        gy = torch.randn(N, M, generator=g, dtype=torch.float64).t()      # non-contiguous
        x = x0.to(dev).requires_grad_()
        W, b = W0.to(dev).requires_grad_(), b0.to(dev).requires_grad_()
        keep = [t.detach().clone() for t in (x, W, b)]
        gyd = gy.to(dev) if dev == "cpu" else gy.to(dev).t().contiguous().t()
        gy_keep = gyd.clone()
        with _spy_dlpack() as counts:
            try:
                y = apply(x, W, b)
            except NotImplementedError:
                raise GradeError(f"{ex}: not implemented yet (the stub still raises "
                                 "NotImplementedError)") from None
            except Exception as e:  # noqa: BLE001
                raise GradeError(f"{ex}: {case}: forward raised {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None
            fwd_calls = dict(counts)
            if not isinstance(y, torch.Tensor) or tuple(y.shape) != (M, N):
                raise GradeError(f"{ex}: {case}: forward returned "
                                 f"{tuple(getattr(y, 'shape', ())) or type(y).__name__}, "
                                 f"expected a tensor of shape ({M}, {N})")
            if any(not torch.equal(a.detach(), k) for a, k in zip((x, W, b), keep)):
                raise GradeError(f"{ex}: {case}: forward changed one of its inputs in place "
                                 "(x, W or b): compute the result into a new array "
                                 "(xa @ Wa + ba), never xa += ... on the input's memory")
            ref_y = x0 @ W0 + b0
            if not torch.allclose(y.detach().cpu(), ref_y, atol=1e-12, rtol=1e-10):
                raise GradeError(f"{ex}: {case}: forward wrong: expected x @ W + b")
            try:
                y.backward(gyd)
            except NotImplementedError:
                raise GradeError(f"{ex}: backward not implemented yet (the stub still raises "
                                 "NotImplementedError)") from None
            except (RuntimeError, ValueError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                if any(w in msg for w in ("invalid gradient", "shape", "mismatch", "dimension",
                                          "aligned")):
                    raise GradeError(f"{ex}: {case}: backward returned a gradient of the wrong "
                                     f"shape ({msg}): a transposition? dx = dy @ W^T is "
                                     f"({M}, {K}), dW = x^T @ dy is ({K}, {N}), db = the column "
                                     f"sums of dy ({N},)") from None
                raise GradeError(f"{ex}: {case}: backward raised {type(e).__name__}: {msg}") \
                    from None
            except Exception as e:  # noqa: BLE001
                raise GradeError(f"{ex}: {case}: backward raised {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}") from None
            bwd_calls = {k: counts[k] - fwd_calls[k] for k in counts}
        if not torch.equal(gyd, gy_keep):
            raise GradeError(f"{ex}: {case}: backward changed grad_output in place: autograd "
                             "may hand the same tensor to other Functions; compute new arrays")
        if fwd_calls["as_array"] == 0 or bwd_calls["as_array"] == 0:
            where = "forward" if fwd_calls["as_array"] == 0 else "backward"
            raise GradeError(f"{ex}: {case}: {where} never called torchops.as_array: compute on "
                             "arrays seen through DLPack (as_array), not with torch operations")
        dx_r, dW_r, db_r = gy @ W0.t(), x0.t() @ gy, gy.sum(0)
        for name, got, want in (("dx", x.grad, dx_r), ("dW", W.grad, dW_r), ("db", b.grad, db_r)):
            if got is None:
                raise GradeError(f"{ex}: {case}: backward returned None for {name}")
            got = got.detach().cpu()
            if torch.allclose(got, want, atol=1e-12, rtol=1e-10):
                continue
            if name == "db" and torch.allclose(got, want / M, atol=1e-12, rtol=1e-10):
                raise GradeError(f"{ex}: {case}: db is the MEAN of dy over the rows; the bias "
                                 "gradient is the SUM (dy already carries the loss's 1/M)")
            if name in ("dx", "dW") and got.shape[0] == got.shape[1] and \
                    torch.allclose(got.t(), want, atol=1e-12, rtol=1e-10):
                raise GradeError(f"{ex}: {case}: {name} is the transpose of the right answer "
                                 "(on a square layer the shape cannot tell): dx = dy @ W^T, "
                                 "dW = x^T @ dy")
            raise GradeError(f"{ex}: {case}: {name} wrong: dx = dy @ W^T, dW = x^T @ dy, "
                             "db = dy summed over the rows")
    xs = torch.randn(3, 4, **kw, requires_grad=True)
    Ws = torch.randn(4, 2, **kw, requires_grad=True)
    bs = torch.randn(2, **kw, requires_grad=True)
    try:
        ok = torch.autograd.gradcheck(apply, (xs, Ws, bs), eps=1e-6, atol=1e-7,
                                      raise_exception=False)
    except Exception as e:  # noqa: BLE001
        raise GradeError(f"{ex}: gradcheck raised {type(e).__name__}: {e}") from None
    if not ok:
        raise GradeError(f"{ex}: torch.autograd.gradcheck failed (float64): the backward does "
                         "not match finite differences of the forward")
    passed(ex)
