"""The default decode attention for quantized pages (the staged tensor-core kernel of
csrc/layers/paged_attention_quant_mma.cu, which copies its first steps before the PDL wait when the previous kernel
wrote none of their keys) inside the engine's captured decode graphs: teacher-forced logits of a small random model
with Llama 3's attention geometry (head_dim 128, 8 kv heads; 2 query heads each) and q8 / q4 caches against the
reference path on the CPU over the same cache type at every step, with the tolerance of test_gpu_parity.py. A step
that read its own newest key before the previous kernel wrote it would see stale codes and miss the tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_parity import _step_logits, assert_step_logits_close

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(200)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from exl2_backend import ops
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    cfg = tiny_config_dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=8,
                           num_hidden_layers=2, vocab_size=2048, bos_token_id=1, eos_token_id=2,
                           max_position_embeddings=1024)
    return write_tiny_exl2_model(tmp_path_factory.mktemp("staged_attn") / "m", cfg, seed=7)


@pytest.mark.parametrize("cache_type", ["q8", "q4"])
def test_teacher_forced_logits_through_the_staged_kernel(model_dir, cache_type):
    from exl2_backend.ops import cuda_layers
    from exl2_backend.runtime import Engine, LoadSettings

    load = {"model_dir": str(model_dir), "max_seq_len": 1024, "max_batch_size": 2, "cache_type": cache_type}
    cpu, gpu = Engine.load(LoadSettings(device="cpu", **load)), Engine.load(LoadSettings(device="cuda", **load))
    assert type(gpu.runner).__name__ == "CudaGraphRunner"
    codes = {"q8": "int8", "q4": "int4"}[cache_type]  # PagedKVCache.k_format / v_format of the cache type
    assert cuda_layers.attn_staged(codes, codes, 2)  # decode: 2 query rows per kv head
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 2000, (333,), generator=g).tolist()  # 300 prompt tokens, 32 decode steps
    with torch.inference_mode():
        ref = _step_logits(cpu, tokens, 300)
        out = _step_logits(gpu, tokens, 300)
    assert gpu.runner.replays > 0
    assert_step_logits_close(ref, out)
    gpu.assert_no_leaks()
