"""Chunked prefill never spikes memory (GPU): a 128k-token prompt on a small random EXL2 model allocates no more
than the engine's planned scratch budget (Engine.prefill_scratch_bytes, runtime/scratch.py) beyond weights and
KV cache, and no more than a 16k-token prompt does: scratch is bounded by max_input_len, not the prompt length.

Measured with torch's allocator statistics (max_memory_allocated growth over the allocation at admission),
after a warm-up prefill that makes cuBLAS's workspaces and other first-use allocations.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.format.random_model import write_random_exl2_model
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams

pytestmark = pytest.mark.cuda

LONG = 131072  # prompt + 1 new token = max_seq_len
CHUNK = 2048
MIB = 1 << 20
# Llama-style, GQA 8/2 with head_dim 128 (the CUDA kernels' shapes), long rope context; ~0.2 GB of weights,
# 2 GB of fp16 KV cache at 128k tokens.
SHAPE = {"hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 3584, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": LONG + 1,
         "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_random_exl2_model(tmp_path_factory.mktemp("long") / "model", SHAPE, bpw=4.0)
    eng = Engine.load(LoadSettings(model_dir=str(model_dir), device="cuda", max_seq_len=LONG + 1,
                                   cache_tokens=LONG + 1, max_batch_size=1, max_chunk_size=CHUNK,
                                   use_cuda_graphs=False))
    yield eng
    del eng
    torch.cuda.empty_cache()


def prefill_peak(engine, n: int, seed: int) -> int:
    """Bytes allocated at the peak of prefilling an n-token prompt, over what was allocated before it."""
    ids = torch.randint(3, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    engine.add_sequence("p", ids, GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=1,
                                                   ignore_eos=True))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(n // CHUNK + 2):
        if engine.prefill(["p"])[0].token_ids:
            break
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert engine.seqs["p"].finish_reason == "length"
    engine.release("p")
    return peak


def test_128k_prefill_stays_within_planned_scratch(engine):
    budget = engine.prefill_scratch_bytes()
    prefill_peak(engine, 3 * CHUNK + 17, seed=0)  # warm-up: first-use allocations (cuBLAS workspaces, ...)
    short = prefill_peak(engine, 8 * CHUNK, seed=1)
    long = prefill_peak(engine, LONG, seed=2)
    print(f"\nprefill scratch: planned {budget / MIB:.1f} MiB, 16k prompt {short / MIB:.1f} MiB, "
          f"128k prompt {long / MIB:.1f} MiB")
    assert long <= budget, f"128k prefill peaked at {long / MIB:.1f} MiB > planned {budget / MIB:.1f} MiB"
    assert long <= short + 16 * MIB, "prefill scratch grew with the prompt length"
    engine.assert_no_leaks()
