"""Tensor-parallel ranks as processes: the engine's process is rank 0; ranks 1..N-1 are spawned here
(torch.multiprocessing, "spawn"), one per GPU, each building its shard of the model from the same
`WeightSource` (model/weight_source.py).

Rank 0 mirrors the three calls that touch the other ranks' state -- making the KV cache, making the runner
(which captures decode graphs, NCCL collectives included, on every rank at once), and every forward step --
by sending them over a pipe before doing the same locally; the ranks meet inside the collectives. A step
sends only the runner's Python inputs (token ids, positions, block tables), a few hundred bytes. Page
copies of prefix caching are mirrored too. A rank that fails reports on its pipe and exits; rank 0 then
raises EngineUnhealthyError at its next step (a rank stuck in a collective with a dead peer fails after
model/tp_comm.TIMEOUT_S).
"""

from __future__ import annotations

import atexit
import logging
import traceback

import torch
import torch.multiprocessing as mp

from exl2_backend.errors import EngineUnhealthyError
from exl2_backend.model.tp_comm import free_port, init_rank, shutdown
from exl2_backend.runtime.model_runner import ModelRunner

log = logging.getLogger("exl2_backend")
READY_TIMEOUT_S = 1800.0  # loading a 70B shard from disk can take minutes


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def device_memory(device: torch.device) -> dict:
    """This process's allocator figures on `device` (bytes): allocated now, peak, reserved."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    return {"allocated": torch.cuda.memory_allocated(device), "max_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device)}


def build_runner(model, cache, max_pages: int, max_batch_size: int, use_graphs: bool) -> ModelRunner:
    """Decode graphs (NCCL collectives captured with the kernels) on CUDA with the kernel library, eager
    otherwise. Every rank must end with the same kind (they run the same collectives): a capture failure
    falls back to eager on the rank that hit it -- the same code fails the same way on every rank -- and
    rank 0 compares the kinds the ranks report (Coordinator.mirror_runner)."""
    from exl2_backend import ops

    if model.device.type == "cuda" and use_graphs and ops.cuda_enabled():
        from exl2_backend.runtime.cuda_graphs import CudaGraphRunner

        try:
            runner = CudaGraphRunner(model, cache, max_pages, max_batch_size)
            runner.capture_all()
            return runner
        except Exception as exc:  # noqa: BLE001 - eager steps give the same results, slower
            log.warning("exl2_backend: tensor-parallel graph capture failed on %s (%s); decoding eagerly",
                        model.device, exc)
            torch.cuda.synchronize(model.device)
    return ModelRunner(model, cache, max_pages)


def _build_model(source, rank: int, world: int, device_type: str, port: int):
    from exl2_backend.model.tensor_parallel import TPLlamaModel

    comm = init_rank(rank, world, port, device_type)
    device = rank_device(device_type, rank)
    config = source.config()
    return TPLlamaModel(config, source.weights(config, device), device, comm=comm)


def _worker(rank: int, world: int, port: int, source, device_type: str, conn) -> None:
    """Ranks 1..N-1: build the shard, then serve mirrored calls until "stop" or the pipe closes."""
    try:
        model = _build_model(source, rank, world, device_type, port)
        conn.send(("ready", None))
        cache = runner = cmd = None
        while cmd != "stop":  # until "stop", or the pipe closes (rank 0 gone)
            try:
                cmd, args, kwargs = conn.recv()
            except EOFError:
                break
            if cmd == "run":
                runner.run(*args, **kwargs)
            elif cmd == "copy_pages":
                cache.copy_pages(*args)
            elif cmd == "make_cache":
                cache = model.make_cache(*args, **kwargs)
                conn.send(("ok", None))
            elif cmd == "make_runner":
                runner = build_runner(model, cache, *args)
                conn.send(("ok", type(runner).__name__))
            elif cmd == "memory":
                conn.send(("ok", device_memory(model.device)))
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank exits
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        shutdown()


class _MirroredCache:
    """Rank 0's KV cache; page copies (prefix caching) are applied on every rank."""

    def __init__(self, cache, coordinator):
        self._cache, self._coordinator = cache, coordinator

    @property
    def local(self):
        return self._cache

    def copy_pages(self, src, dst) -> None:
        self._coordinator.send("copy_pages", list(src), list(dst))
        self._cache.copy_pages(src, dst)

    def __getattr__(self, name):
        return getattr(self._cache, name)


class TPRunner:
    """Rank 0's runner: each step is sent to the other ranks, then run here (logits from here)."""

    def __init__(self, inner: ModelRunner, coordinator):
        self.inner, self.coordinator = inner, coordinator

    def run(self, tokens, starts, block_tables, logits: str = "last") -> torch.Tensor:
        self.coordinator.check()
        self.coordinator.send("run", [list(t) for t in tokens], list(starts), [list(p) for p in block_tables],
                              logits)
        return self.inner.run(tokens, starts, block_tables, logits)

    def __getattr__(self, name):  # page_size, device, buckets, replays, ... are the local runner's
        if name.startswith("_"):  # never the local graphs: replaying them alone would hang in a collective
            raise AttributeError(name)
        return getattr(self.inner, name)


class Coordinator:
    """Rank 0's side of the group: the worker processes and their pipes."""

    def __init__(self, model, procs, conns):
        self.model, self.procs, self.conns = model, procs, conns
        self.closed = False

    def send(self, cmd: str, *args, **kwargs) -> None:
        for c in self.conns:
            c.send((cmd, args, kwargs))

    def check(self) -> None:
        """Raise EngineUnhealthyError if a rank reported a failure or died."""
        for r, (c, p) in enumerate(zip(self.conns, self.procs), start=1):
            if c.poll():
                _kind, detail = c.recv()
                raise EngineUnhealthyError(f"tensor-parallel rank {r} failed: {detail}")
            if not p.is_alive():
                raise EngineUnhealthyError(f"tensor-parallel rank {r} exited (code {p.exitcode})")

    def _acks(self, what: str, timeout: float = READY_TIMEOUT_S) -> list:
        out = []
        for r, c in enumerate(self.conns, start=1):
            if not c.poll(timeout):
                raise EngineUnhealthyError(f"tensor-parallel rank {r} did not answer {what} in {timeout:.0f} s")
            kind, detail = c.recv()
            if kind == "error":
                raise EngineUnhealthyError(f"tensor-parallel rank {r} failed during {what}: {detail}")
            out.append(detail)
        return out

    def rank_memory(self) -> list[dict]:
        """device_memory of every rank (rank 0 first)."""
        self.send("memory")
        out = [device_memory(self.model.device)]
        for r, c in enumerate(self.conns, start=1):
            if not c.poll(60):
                raise EngineUnhealthyError(f"tensor-parallel rank {r} did not report its memory")
            kind, detail = c.recv()
            if kind == "error":
                raise EngineUnhealthyError(f"tensor-parallel rank {r} failed: {detail}")
            out.append(detail)
        return out

    def mirror_cache(self, cache, num_pages: int, page_size: int, args, kwargs):
        self.send("make_cache", num_pages, page_size, *args, **kwargs)
        self._acks("make_cache")
        return _MirroredCache(cache, self)

    def mirror_runner(self, cache, max_pages: int, max_batch_size: int, use_graphs: bool) -> TPRunner:
        self.send("make_runner", max_pages, max_batch_size, use_graphs)
        local = cache.local if isinstance(cache, _MirroredCache) else cache
        inner = build_runner(self.model, local, max_pages, max_batch_size, use_graphs)
        kinds = [type(inner).__name__, *self._acks("make_runner")]
        if len(set(kinds)) != 1:
            raise EngineUnhealthyError(f"tensor-parallel ranks built different runners {kinds}; load with "
                                       "use_cuda_graphs=False")
        return TPRunner(inner, self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send(("stop", (), {}))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        shutdown()


def launch_tensor_parallel(source, world: int, device_type: str):
    """Start ranks 1..world-1, join the group as rank 0, build rank 0's shard and wait for the others.
    Returns rank 0's TPLlamaModel (with its `coordinator`); `model.close()` stops the ranks."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    for rank in range(1, world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, world, port, source, device_type, child), daemon=True,
                        name=f"exl2-tp-rank{rank}")
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    coordinator = Coordinator(None, procs, conns)
    try:
        model = _build_model(source, 0, world, device_type, port)
        coordinator.model = model
        coordinator._acks("load")
    except BaseException:
        coordinator.close()
        raise
    model.coordinator = coordinator
    atexit.register(coordinator.close)
    log.info("exl2_backend: tensor parallel over %d ranks (%s) ready", world, device_type)
    return model

