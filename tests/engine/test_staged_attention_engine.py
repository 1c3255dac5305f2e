"""The default decode attention for quantized pages (the staged tensor-core kernel of
csrc/layers/paged_attention_quant_mma.cu) inside the engine's captured decode graphs, where each launch follows the
q/k/v GEMV that writes the step's own key under programmatic dependent launch: teacher-forced logits of a small
random model with Llama 3's attention geometry (head_dim 128, 8 kv heads; 2 query heads each) and q8 / q4 caches
against the reference path on the CPU over the same cache type at every step, with the tolerance of
test_gpu_parity.py. A launch that read its newest key before the GEMV wrote it would miss the tolerance."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_parity import assert_teacher_forced_parity

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(200)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from exl2_backend import ops
    from tests.helpers.synth import llama3_attention_config_dict, write_tiny_exl2_model

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    return write_tiny_exl2_model(tmp_path_factory.mktemp("staged_attn") / "m", llama3_attention_config_dict(), seed=7)


@pytest.mark.parametrize("cache_type", ["q8", "q4"])
def test_teacher_forced_logits_through_the_staged_kernel(model_dir, cache_type):
    from exl2_backend.cache.kv_types import get_cache_type
    from exl2_backend.ops import cuda_layers
    from exl2_backend.runtime import Engine, LoadSettings

    load = {"model_dir": str(model_dir), "max_seq_len": 1024, "max_batch_size": 2, "cache_type": cache_type}
    cpu, gpu = Engine.load(LoadSettings(device="cpu", **load)), Engine.load(LoadSettings(device="cuda", **load))
    formats = get_cache_type(cache_type)
    assert cuda_layers.attn_staged(formats.k.name, formats.v.name, 2)  # decode: 2 query rows per kv head
    assert_teacher_forced_parity(cpu, gpu, seed=3)  # 300 prompt tokens, 32 decode steps
