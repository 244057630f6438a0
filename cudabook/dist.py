"""Running N ranks from a notebook: gloo CPU processes, torchrun workers, checked send/recv.

    from cudabook import dist
    out = dist.spawn(fn, 4)                 # fn(comm) in 4 forked CPU processes over gloo
    res = dist.torchrun("allreduce_sweep", 2, args=["--max-bytes", "1G"])   # cudabook/dist_scripts
    if dist.need_gpus(2, "the NCCL sweep"):  # False (and says why) with fewer than 2 GPUs
        ...

Every call has a timeout that turns a hang into a ``DistTimeout`` naming the ranks that did
not finish; an exception on one rank stops the others and is raised in the notebook with that
rank's traceback. ``Comm`` is the point-to-point interface the chapter's exercises use: its
``send`` is *synchronous* (it returns once the receiver has the message, as MPI's ``Ssend``),
so a send/recv order that can deadlock on a real network deadlocks here too, every time, and
the timeout reports it; ``recv`` checks that the sender sent as many elements as it expects.
NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``SAFE_ENV``) in every process started
here and in this one once ``cupy_nccl`` hands out NCCL; importing the module changes nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import multiprocessing as _mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["DistError", "DistTimeout", "Comm", "spawn", "torchrun", "torchrun_command",
           "torchrun_commands", "script_path", "cupy_nccl", "gpu_count", "need_gpus", "SAFE_ENV"]

#: NVLink multicast (NVLS) off, as the machines require: set in every process this module starts
#: (``spawn``'s ranks, ``torchrun``'s workers) and here before ``cupy_nccl`` returns NCCL, never
#: at import (chapter 1 imports cudabook too)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _apply_safe_env() -> None:
    """Put ``SAFE_ENV`` into this process's environment (before NCCL reads it, at the first
    communicator)."""
    os.environ.update(SAFE_ENV)


_TAG_HEAD, _TAG_DATA, _TAG_ACK = 11, 12, 13


class DistError(RuntimeError):
    """A rank failed; the message names the rank and what it raised."""


class DistTimeout(DistError):
    """Ranks did not finish in time: a deadlock (or far too much work)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Comm:
    """One rank's view of the group: ``rank``, ``world``, checked point-to-point calls and
    all-reduce, each logged in ``events`` as ``(seconds, op, peer_or_tag, elements)``."""

    def __init__(self, rank: int, world: int, sync: bool = True):
        self.rank, self.world, self.sync = rank, world, sync
        self.events: list[tuple[float, str, Any, int]] = []
        self.t0 = time.perf_counter()

    def log(self, op: str, what: Any = None, n: int = 0) -> None:
        self.events.append((time.perf_counter() - self.t0, op, what, n))

    def _peer(self, p: int, what: str) -> int:
        if not isinstance(p, int) or not 0 <= p < self.world:
            raise DistError(f"rank {self.rank}: {what} rank {p!r} is not in 0..{self.world - 1}")
        if p == self.rank:
            raise DistError(f"rank {self.rank}: {what} itself (rank {p}); with world size "
                            f"{self.world} a neighbour is (rank +- 1) % world")
        return p

    def _head(self, t) -> Any:
        import torch

        return torch.tensor([t.numel()], dtype=torch.int64)

    def _check_head(self, head, t, src: int) -> None:
        n = int(head[0])
        if n != t.numel():
            raise DistError(f"rank {self.rank}: recv from rank {src} expects {t.numel()} "
                            f"elements, rank {src} sent {n}: the sizes differ between ranks "
                            "(every rank must pass a tensor of the same size)")

    def send(self, t, dst: int) -> None:
        """Send ``t`` to ``dst``; returns once ``dst`` has received it (synchronous)."""
        import torch
        import torch.distributed as td

        dst = self._peer(dst, "send to")
        self.log("send", dst, t.numel())
        td.send(self._head(t), dst, tag=_TAG_HEAD)
        td.send(t.contiguous(), dst, tag=_TAG_DATA)
        if self.sync:
            td.recv(torch.zeros(1, dtype=torch.int64), dst, tag=_TAG_ACK)

    def recv(self, t, src: int) -> None:
        """Receive into ``t`` (contiguous) from ``src``; sizes must match the sender's."""
        import torch
        import torch.distributed as td

        src = self._peer(src, "recv from")
        if not t.is_contiguous():
            raise DistError(f"rank {self.rank}: recv needs a contiguous tensor (a slice of a 1-D "
                            "tensor is; a strided view is not)")
        head = torch.zeros(1, dtype=torch.int64)
        td.recv(head, src, tag=_TAG_HEAD)
        self._check_head(head, t, src)
        td.recv(t, src, tag=_TAG_DATA)
        self.log("recv", src, t.numel())
        if self.sync:
            td.send(torch.ones(1, dtype=torch.int64), src, tag=_TAG_ACK)

    def sendrecv(self, send_t, dst: int, recv_t, src: int) -> None:
        """Send ``send_t`` to ``dst`` and receive ``recv_t`` from ``src`` at the same time
        (both posted before either waits): the deadlock-free step of a ring."""
        import torch
        import torch.distributed as td

        dst, src = self._peer(dst, "send to"), self._peer(src, "recv from")
        if not recv_t.is_contiguous():
            raise DistError(f"rank {self.rank}: sendrecv needs a contiguous receive tensor")
        self.log("send", dst, send_t.numel())
        head_in = torch.zeros(1, dtype=torch.int64)
        ops = [td.isend(self._head(send_t), dst, tag=_TAG_HEAD),
               td.isend(send_t.contiguous(), dst, tag=_TAG_DATA)]
        td.irecv(head_in, src, tag=_TAG_HEAD).wait()
        self._check_head(head_in, recv_t, src)
        td.irecv(recv_t, src, tag=_TAG_DATA).wait()
        for w in ops:
            w.wait()
        self.log("recv", src, recv_t.numel())
        if self.sync:
            a = td.isend(torch.ones(1, dtype=torch.int64), src, tag=_TAG_ACK)
            td.recv(torch.zeros(1, dtype=torch.int64), dst, tag=_TAG_ACK)
            a.wait()

    def all_reduce(self, t, async_op: bool = False, tag: Any = None):
        """Sum ``t`` over the ranks in place (torch.distributed); ``async_op`` returns a handle
        whose ``wait()`` finishes it. ``tag`` names the call in ``events``."""
        import torch.distributed as td

        self.log("all_reduce" if async_op else "all_reduce (blocking)", tag, t.numel())
        work = td.all_reduce(t, async_op=async_op)
        if not async_op:
            return None
        comm = self

        class _Handle:
            def wait(self) -> None:
                work.wait()
                comm.log("wait", tag, t.numel())

        return _Handle()

    def barrier(self) -> None:
        import torch.distributed as td

        td.barrier()


def _worker(fn, rank, world, port, backend, args, q, timeout) -> None:
    _apply_safe_env()                      # in the rank, before init_process_group
    # a forked rank cannot initialise CUDA (its parent may have): PyTorch warns about it on
    # stderr from C++ and from Python. The ranks' errors travel back through the queue, so their
    # stderr goes nowhere (their stdout, a student's print, still shows)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (the process ends with os._exit)
    import warnings

    warnings.simplefilter("ignore")
    try:
        import torch
        import torch.distributed as td

        torch.set_num_threads(1)
        td.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                              world_size=world, timeout=_dt.timedelta(seconds=timeout))
        comm = Comm(rank, world)
        out = fn(comm, *args)
        q.put((rank, True, out))
    except BaseException as e:  # noqa: BLE001  (everything goes back to the notebook)
        msg = str(e) if isinstance(e, DistError) else \
            f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
        q.put((rank, False, msg))
    q.close()
    q.join_thread()          # the result is in the pipe before the process ends
    sys.stdout.flush()
    os._exit(0)  # no atexit handlers, no process-group teardown that waits for dead peers


def _autograd_fork_safe() -> bool:
    """False when a forked child could not run autograd: PyTorch marks every child forked after
    its autograd engine started GPU threads (the first backward that touched a GPU) as a "bad
    fork" and refuses backward there. Without CUDA initialised it cannot have; otherwise a child
    is forked and tries a backward on the CPU (a few milliseconds)."""
    import torch

    if not torch.cuda.is_initialized():
        return True
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: no CUDA call, CPU autograd only
        ok = b"0"
        try:
            os.close(r)
            x = torch.ones(2, requires_grad=True)
            (x * 3).sum().backward()
            ok = b"1"
        except BaseException:  # noqa: BLE001, S110  (the answer is the byte written)
            pass
        os.write(w, ok)
        os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return got == b"1"


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 30.0,
          backend: str = "gloo") -> list:
    """Run ``fn(comm, *args)`` on ``world`` forked CPU processes joined by ``backend`` (gloo);
    return the ranks' return values in rank order (they must pickle: numpy arrays, numbers).
    After a backward pass on a GPU in this process, forked children cannot run autograd: the
    ranks then start as new interpreters ("spawn") and ``fn`` must be importable from a module.

    A rank that raises stops the group and its error is raised here (``DistError``); ranks still
    running after ``timeout`` seconds are killed and ``DistTimeout`` says which.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"spawn: world must be an int >= 1, got {world!r}")
    if "fork" not in _mp.get_all_start_methods():
        raise DistError("spawn needs the 'fork' start method (Linux; on macOS run the chapter on "
                        "Colab or Linux)")
    if _autograd_fork_safe():
        ctx = _mp.get_context("fork")
    else:
        # This process ran a backward on a GPU: PyTorch then refuses autograd in any forked
        # child. New interpreters ("spawn") import fn by name instead of inheriting it.
        mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if mod in (None, "__main__") or "<locals>" in name:
            raise DistError(
                f"spawn: this process has run a backward pass on a GPU, after which PyTorch "
                f"forbids autograd in forked processes, so the ranks must start as new "
                f"interpreters and import {name or fn!r} by name; a function defined in a notebook "
                f"or inside another function cannot be imported. Define it in a module (a .py "
                f"file on sys.path), or run this cell in a fresh kernel before any GPU training")
        ctx = _mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, backend, args, q, timeout),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    err = None
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, out = q.get(timeout=min(left, 0.5))
            except Exception:  # noqa: BLE001  (queue.Empty: poll for dead ranks)
                dead = [r for r, p in enumerate(procs)
                        if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    err = DistError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                                    "without a result")
                    break
                continue
            if not ok:
                err = DistError(f"rank {rank} of {world} failed: {out}")
                break
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=0.2 if err is None and len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
    if err is not None:
        raise err
    if len(results) < world:
        missing = [r for r in range(world) if r not in results]
        raise DistTimeout(
            f"ranks {missing} of {world} did not finish within {timeout:g} s: a deadlock? "
            "Typically every rank sends before it receives, so each waits for a receive that "
            "its neighbour never posts (use comm.sendrecv, or let even ranks send first)")
    return [results[r] for r in range(world)]


def cupy_nccl():
    """CuPy's NCCL bindings (``cupy.cuda.nccl``: one process drives every GPU), or None after
    printing why not. CuPy loads libnccl.so.2 from a pip package; where it finds none, the copy
    that PyTorch's wheels ship (``nvidia/.../libnccl.so.2``) is loaded first."""
    import ctypes
    import glob
    import importlib
    import warnings

    _apply_safe_env()          # this process creates the communicators (NcclCommunicator)
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels (PyTorch depends on them)

        for root in list(nvidia.__path__):
            libs = sorted(glob.glob(os.path.join(root, "**", "libnccl.so*"), recursive=True))
            if libs:
                ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
                break
    except (ImportError, OSError):
        pass
    with warnings.catch_warnings():        # CuPy warns on stderr when it finds no library
        warnings.simplefilter("ignore")
        nccl = importlib.import_module("cupy.cuda.nccl")
    if not getattr(nccl, "available", False):
        print("skipped: CuPy finds no NCCL library here (pip install nvidia-nccl-cu12 or -cu13, "
              "matching CuPy's CUDA); torch.distributed's NCCL above is the same library")
        return None
    return nccl


def gpu_count() -> int:
    """CUDA devices visible here (0 in simulator mode or without a driver)."""
    from . import env

    if not env.HAS_GPU:
        return 0
    try:
        import cupy as cp

        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return 0


def need_gpus(n: int, what: str = "this cell") -> bool:
    """True with at least ``n`` GPUs; otherwise print why ``what`` is skipped and return False."""
    have = gpu_count()
    if have >= n:
        return True
    print(f"skipped: {what} needs {n} or more GPUs of one host; this machine has {have}.")
    return False


def script_path(script: str | os.PathLike) -> Path:
    """A script's path: a name such as ``"ddp_train"`` is one of the package's
    ``cudabook/dist_scripts/``; anything else is a path to a file."""
    here = Path(__file__).resolve().parent / "dist_scripts"
    s = str(script)
    if os.sep not in s and "/" not in s:
        p = here / (s if s.endswith(".py") else s + ".py")
        if p.is_file() and p.name != "__init__.py":
            return p
        names = sorted(q.stem for q in here.glob("*.py") if q.name != "__init__.py")
        if not Path(s).is_file():
            raise FileNotFoundError(f"torchrun: no script {s!r}: the package's scripts are "
                                    f"{names}, or give a path to a file")
    p = Path(script)
    if not p.is_file():
        raise FileNotFoundError(f"torchrun: no script {p}")
    return p


def torchrun(script: str | os.PathLike, nproc: int, args: Sequence[str] = (),
             timeout: float = 300.0, env: dict | None = None, quiet: bool = True) -> Any:
    """Run ``script`` (a name from ``cudabook/dist_scripts``, or a path) with ``torchrun
    --standalone --nproc_per_node nproc`` and return the JSON
    that rank 0 writes to the path in ``$CUDABOOK_DIST_OUT`` (None if it writes none).

    The run is killed after ``timeout`` seconds (``DistTimeout``); a non-zero exit raises
    ``DistError`` with the last lines of the output. The same script runs unchanged on several
    nodes: ``torchrun --nnodes 2 --node_rank i --rdzv_endpoint host:port ... script``.
    """
    if nproc < 1:
        raise ValueError(f"torchrun: nproc must be >= 1, got {nproc}")
    script = script_path(script)
    fd, out = tempfile.mkstemp(suffix=".json", prefix="cudabook-dist-")
    os.close(fd)
    os.unlink(out)
    e = {**os.environ, **SAFE_ENV, **(env or {}), "CUDABOOK_DIST_OUT": out,   # the workers' env
         "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = str(Path(__file__).resolve().parent.parent)
    e["PYTHONPATH"] = root + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *map(str, args)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=e, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)                 # torchrun and every worker it started
        try:
            log, _ = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            log = ""
        raise DistTimeout(f"{script.name} on {nproc} ranks did not finish within {timeout:g} s "
                          f"(killed). Last output:\n{_tail(log)}") from None
    if p.returncode != 0:
        raise DistError(f"{script.name} on {nproc} ranks failed (exit {p.returncode}):\n"
                        f"{_tail(log)}")
    if not quiet:
        print(log)
    if not os.path.exists(out):
        return None
    try:
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (torchrun's workers may run in
    sessions of their own), the descendants found before anything is killed."""
    below = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for c in [pid, *below]:
        try:
            os.kill(c, signal.SIGKILL)
        except OSError:
            pass


def _tail(log: str, n: int = 25) -> str:
    """The last ``n`` lines of a run's output, and before them the first traceback of a worker
    when it lies further up (torchrun's own summary of a failure fills the last lines and says
    only "exitcode 1": the cause is in the worker's traceback)."""
    lines = [ln for ln in (log or "").splitlines() if ln.strip()]
    tail = lines[-n:]
    first = next((i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln),
                 None)
    if first is None or first >= len(lines) - n:
        return "\n".join(tail)
    block = [lines[first]]
    for ln in lines[first + 1:first + 60]:
        block.append(ln)
        body = ln.split("]:", 1)[1] if ln.startswith("[rank") and "]:" in ln else ln
        if body and not body[0].isspace():           # the exception line closes the block
            break
    return "\n".join(["the first worker traceback:", *block, "...", *tail])


def write_result(obj: Any) -> None:
    """In a torchrun script: rank 0 hands ``obj`` (JSON) back to ``torchrun``'s caller."""
    path = os.environ.get("CUDABOOK_DIST_OUT")
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f)
        shutil.move(tmp, path)


def script_rank(script: str, device: str, cuda_dtype: Any) -> tuple[int, int, Any, Any]:
    """In a torchrun script of ``dist_scripts``: this rank's ``(rank, world, device, dtype)``
    after ``init_process_group``. ``device="cuda"``: NCCL on the GPU ``LOCAL_RANK`` names,
    ``cuda_dtype``; ``"cpu"``: gloo, one thread, float32 (the check that runs anywhere)."""
    import torch
    import torch.distributed as td

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"{script}: no CUDA GPU here (run with --device cpu for gloo)")
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        td.init_process_group("nccl", device_id=dev)
        return rank, world, dev, cuda_dtype
    td.init_process_group("gloo")
    torch.set_num_threads(1)
    return rank, world, torch.device("cpu"), torch.float32


def script_done(out: Any, rank: int) -> None:
    """The end of a torchrun script: rank 0 hands ``out`` to the caller (``write_result``, or
    prints it as JSON when started by hand); then the process group is destroyed."""
    import torch.distributed as td

    if rank == 0:
        if os.environ.get("CUDABOOK_DIST_OUT"):
            write_result(out)
        else:
            print(json.dumps(out, indent=1))
    td.destroy_process_group()


def torchrun_command(script: str | os.PathLike, nproc: int, nnodes: int = 1,
                     node_rank: int | str = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "cudabook", args: Sequence[str] = (),
                     launcher: Sequence[str] = ("torchrun",),
                     rdzv_backend: str = "c10d") -> list[str]:
    """The argv that starts ``script`` on one node: ``nproc`` workers there, ``nnodes`` nodes in
    all, this node being ``node_rank`` (an int, or a shell variable such as ``"$SLURM_NODEID"``).

    One node without an endpoint: ``torchrun --standalone --nproc-per-node P script``. Several
    nodes: the c10d rendezvous, identical on every node but for ``--node-rank``::

        torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d
                 --rdzv-endpoint head:29500 --rdzv-id cudabook -m cudabook.dist_scripts.ddp_train

    ``rdzv_endpoint`` is ``host:port`` of a node every node can reach (the rendezvous store runs
    there; a variable such as ``"$HEAD_NODE:29500"`` is kept as written); ``rdzv_id`` names the
    job, the same on every node. The c10d rendezvous numbers the nodes in the order they join
    (``GROUP_RANK``; global rank 0 may be on any node) and ignores ``--node-rank`` (torchrun says
    so); the line keeps it so that every node's line names its node. With
    ``rdzv_backend="static"`` the node ranks are fixed by ``--node-rank`` and node 0 must be the
    endpoint's host (``--master-addr``/``--master-port``; no ``--rdzv-id``).

    A script of the package (``"ddp_train"``) is started as a module
    (``-m cudabook.dist_scripts.ddp_train``), so the line works on every node where cudabook is
    installed, whatever its path; any other script by its path as given. Nothing is run: pass
    the list to ``subprocess``, or print the lines of ``torchrun_commands``.
    """
    import re

    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"torchrun_command: nproc must be an int >= 1, got {nproc!r}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"torchrun_command: nnodes must be an int >= 1, got {nnodes!r}")
    if isinstance(node_rank, str):
        if not node_rank.startswith("$"):
            raise ValueError(f"torchrun_command: node_rank must be an int in 0..{nnodes - 1} or "
                             f"a shell variable ('$SLURM_NODEID'), got {node_rank!r}")
    elif not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(f"torchrun_command: node_rank {node_rank!r} is not in 0..{nnodes - 1}")
    if not rdzv_id or re.search(r"\s", str(rdzv_id)):
        raise ValueError(f"torchrun_command: rdzv_id must be a non-empty word, got {rdzv_id!r}")
    if rdzv_backend not in ("c10d", "static"):
        raise ValueError(f"torchrun_command: rdzv_backend is 'c10d' or 'static', got "
                         f"{rdzv_backend!r}")
    if rdzv_endpoint is not None:
        host, _, port = str(rdzv_endpoint).rpartition(":")
        port_ok = "$" in port or (port.isdigit() and 0 < int(port) < 65536)
        if not host or not port_ok:
            raise ValueError(f"torchrun_command: rdzv_endpoint must be host:port (port "
                             f"1..65535), got {rdzv_endpoint!r}")
    elif nnodes > 1:
        raise ValueError(f"torchrun_command: {nnodes} nodes need rdzv_endpoint='host:port' of a "
                         "node that every node can reach (the rendezvous runs there)")
    here = Path(__file__).resolve().parent / "dist_scripts"
    p = script_path(script)                                  # refuses a missing script
    target = (["-m", f"cudabook.dist_scripts.{p.stem}"] if p.parent == here
              else [str(script)])
    cmd = [*launcher]
    if rdzv_endpoint is None:
        cmd += ["--standalone", "--nproc-per-node", str(nproc)]
    elif rdzv_backend == "static":
        host, _, port = str(rdzv_endpoint).rpartition(":")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node",
                str(nproc), "--master-addr", host, "--master-port", port]
    else:
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node",
                str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", str(rdzv_endpoint),
                "--rdzv-id", str(rdzv_id)]
    return cmd + target + [str(a) for a in args]


def torchrun_commands(script: str | os.PathLike, nproc: int, nnodes: int, rdzv_endpoint: str,
                      rdzv_id: str = "cudabook", args: Sequence[str] = (),
                      launcher: Sequence[str] = ("torchrun",),
                      node_rank: str | None = None, rdzv_backend: str = "c10d") -> list[str]:
    """The shell lines that start ``script`` on ``nnodes`` nodes of ``nproc`` workers each, as
    ``torchrun_command`` builds them: one line per node (run line i on node i; the endpoint's
    host is usually node 0), or, with ``node_rank`` a shell variable (``"$SLURM_NODEID"``), the
    one line that every node runs. Words holding a ``$VAR`` are double-quoted, so the shell
    expands them; everything else is quoted as ``shlex.quote`` does."""
    import re
    import shlex

    def word(w: str) -> str:
        if "$" in w and re.fullmatch(r"[$\w{}:./-]+", w):
            return f'"{w}"'
        return shlex.quote(w)

    ranks = [node_rank] if node_rank is not None else list(range(nnodes))
    if node_rank is not None and not str(node_rank).startswith("$"):
        raise ValueError(f"torchrun_commands: node_rank is a shell variable ('$SLURM_NODEID') or "
                         f"None (one line per node), got {node_rank!r}")
    return [" ".join(word(w) for w in torchrun_command(script, nproc, nnodes, r, rdzv_endpoint,
                                                        rdzv_id, args, launcher, rdzv_backend))
            for r in ranks]
