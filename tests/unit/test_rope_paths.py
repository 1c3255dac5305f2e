"""The three ways a layer rotates q/k and fills the KV cache give the same logits: rope_kv_write in one op (the
default), apply_rope + kv_cache_write apart (EXL2_BACKEND_FUSED_ROPE_KV=0), and on the GPU inside the q/k/v GEMV
(tests/kernels/test_gemv_rope_kv.py). Here on the CPU reference path: a prefill and decode steps of one and three
sequences through LlamaModel."""

from __future__ import annotations

import torch

from tests.helpers.forward_steps import prefill_then_decode
from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model


def test_rope_kv_write_and_the_separate_ops_give_the_same_logits(tmp_path, monkeypatch):
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel

    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(), seed=2), "cpu")

    def run(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "FUSED_ROPE_KV", fused)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
