"""The default decode attention for fp16 pages over 8 kv heads (the tensor-core streamed kernel,
csrc/layers/paged_attention_stream_mma.cu) inside the engine's captured decode graphs: teacher-forced logits of a
small random model with Llama 3's attention geometry (head_dim 128, 8 kv heads; 2 query heads each) against the
reference path on the CPU at every step, with the tolerance of test_gpu_parity.py, over a context that crosses
many 16-token chunks and splits (partial last chunks included)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_gpu_parity import _step_logits, assert_step_logits_close

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from exl2_backend import ops
    from exl2_backend.ops import cuda_layers
    from exl2_backend.runtime import Engine, LoadSettings
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    if not torch.cuda.is_available() or not ops.cuda_enabled():
        pytest.skip("needs a GPU and the compiled kernel library")
    if not cuda_layers.ATTN_STREAM_FP16 or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the tensor-core streamed attention is off or needs sm_90+")
    cfg = tiny_config_dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=8,
                           num_hidden_layers=2, vocab_size=2048, bos_token_id=1, eos_token_id=2,
                           max_position_embeddings=1024)
    model_dir = write_tiny_exl2_model(tmp_path_factory.mktemp("stream_attn") / "m", cfg, seed=5)
    load = {"model_dir": str(model_dir), "max_seq_len": 1024, "max_batch_size": 2}
    return Engine.load(LoadSettings(device="cpu", **load)), Engine.load(LoadSettings(device="cuda", **load))


def test_teacher_forced_logits_through_the_streamed_kernel(engines):
    from exl2_backend.ops import cuda_layers

    cpu, gpu = engines
    assert type(gpu.runner).__name__ == "CudaGraphRunner"
    assert cuda_layers.attn_streamed((1, 1, 16, 128), (1, gpu.page_size, 8, 128), torch.device("cuda"))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 2000, (333,), generator=g).tolist()  # 300 prompt tokens, 32 decode steps
    with torch.inference_mode():
        ref = _step_logits(cpu, tokens, 300)
        out = _step_logits(gpu, tokens, 300)
    assert gpu.runner.replays > 0
    assert_step_logits_close(ref, out)
    gpu.assert_no_leaks()
