"""The GPU path (CUDA kernels + CUDA-graph decode) against the reference path, on the real SmolLM2 model.

Greedy tokens must be identical for 64 tokens, and teacher-forced logits must agree at every step: the
GPU step runs in fp16 with fp32 accumulation, the reference in fp32, so logits may differ by fp16 rounding
(tolerance below: 2% of the logit range), never by a wrong kernel (which gives errors of the logit scale).
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.runtime.generate import generate_stream
from exl2_backend.sampling import SamplingParams

pytestmark = pytest.mark.cuda

NEW_TOKENS = 64
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]
LOGIT_TOLERANCE = 0.02  # fraction of the reference logits' range (max - min) per step


def _engine(model_dir, device):
    return Engine.load(LoadSettings(model_dir=model_dir, device=device, max_seq_len=512, max_batch_size=4))


def _greedy(engine, prompt):
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [t for ev in generate_stream(engine, prompt, params) for t in ev.token_ids]


@pytest.fixture(scope="module")
def engines(default_model_dir):
    return _engine(default_model_dir, "cpu"), _engine(default_model_dir, "cuda")


def test_gpu_engine_uses_graphs(engines):
    _, gpu = engines
    assert type(gpu.runner).__name__ == "CudaGraphRunner"


@pytest.mark.parametrize("chat", CHATS, ids=["paris", "poem"])
def test_greedy_tokens_identical(engines, chat):
    cpu, gpu = engines
    prompt = cpu.tokenizer.encode_chat(chat)
    ref = _greedy(cpu, prompt)
    out = _greedy(gpu, prompt)
    assert gpu.runner.replays > 0  # the decode steps really replayed graphs
    assert out == ref, (cpu.tokenizer.decode(ref), gpu.tokenizer.decode(out))
    gpu.assert_no_leaks()


def test_teacher_forced_logits(engines):
    cpu, gpu = engines
    prompt = cpu.tokenizer.encode_chat(CHATS[1])
    tokens = prompt + _greedy(cpu, prompt)
    n = len(prompt)
    with torch.inference_mode():
        ref = _step_logits(cpu, tokens, n)
        out = _step_logits(gpu, tokens, n)
    assert_step_logits_close(ref, out)


def assert_step_logits_close(ref, out):
    """Each step's GPU logits within LOGIT_TOLERANCE of the reference logits' range."""
    assert len(ref) == len(out)
    for step, (r, o) in enumerate(zip(ref, out)):
        span = float(r.max() - r.min())
        err = float((o.cpu() - r).abs().max())
        assert err <= LOGIT_TOLERANCE * span, f"step {step}: max |gpu - ref| = {err:.4f}, range {span:.2f}"


def assert_teacher_forced_parity(cpu, gpu, seed, n_prompt=300, n_decode=32):
    """Random tokens (ids 3..1999): prefill n_prompt, then n_decode teacher-forced steps on both engines; the GPU
    engine's logits (through its captured graphs) within LOGIT_TOLERANCE of the CPU reference at every step."""
    assert type(gpu.runner).__name__ == "CudaGraphRunner"
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 2000, (n_prompt + n_decode + 1,), generator=g).tolist()
    with torch.inference_mode():
        ref = _step_logits(cpu, tokens, n_prompt)
        out = _step_logits(gpu, tokens, n_prompt)
    assert gpu.runner.replays > 0
    assert_step_logits_close(ref, out)
    gpu.assert_no_leaks()


def _step_logits(engine, tokens, n_prompt):
    """Prefill tokens[:n_prompt], then decode the rest one token at a time (teacher forcing): the last-token
    logits after every step, through the engine's runner (graphs on the GPU)."""
    pages = engine.pages.allocator.allocate(-(-len(tokens) // engine.page_size))
    try:
        out = [engine.runner.run([tokens[:n_prompt]], [0], [pages])[0].float().clone()]
        for pos in range(n_prompt, len(tokens) - 1):
            out.append(engine.runner.run([[tokens[pos]]], [pos], [pages])[0].float().clone())  # graph output is reused
        return out
    finally:
        engine.pages.allocator.free(pages)
