"""The default decode attention for fp16 pages over 8 kv heads (the tensor-core streamed kernel,
csrc/layers/paged_attention_stream_mma.cu) inside the engine's captured decode graphs: teacher-forced logits of a
small random model with Llama 3's attention geometry (head_dim 128, 8 kv heads; 2 query heads each) against the
reference path on the CPU at every step, with the tolerance of test_gpu_parity.py, over a context that crosses
many 16-token chunks and splits (partial last chunks included)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_parity import assert_teacher_forced_parity

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from exl2_backend import ops
    from exl2_backend.ops import cuda_layers
    from exl2_backend.runtime import Engine, LoadSettings
    from tests.helpers.synth import llama3_attention_config_dict, write_tiny_exl2_model

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    if not cuda_layers.ATTN_STREAM_FP16 or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the tensor-core streamed attention is off or needs sm_90+")
    model_dir = write_tiny_exl2_model(tmp_path_factory.mktemp("stream_attn") / "m", llama3_attention_config_dict(),
                                      seed=5)
    load = {"model_dir": str(model_dir), "max_seq_len": 1024, "max_batch_size": 2}
    return Engine.load(LoadSettings(device="cpu", **load)), Engine.load(LoadSettings(device="cuda", **load))


def test_teacher_forced_logits_through_the_streamed_kernel(engines):
    from exl2_backend.ops import cuda_layers

    cpu, gpu = engines
    assert cuda_layers.attn_streamed((1, 1, 16, 128), (1, gpu.page_size, 8, 128), torch.device("cuda"))
    assert_teacher_forced_parity(cpu, gpu, seed=2)  # 300 prompt tokens, 32 decode steps
