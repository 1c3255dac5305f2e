"""RoPE and the fp16 KV-cache write inside the q/k/v GEMV (csrc/quant/exl2_gemv_rope.cuh,
CudaLinearOp.add_normed_rope_kv, layers.norm_qkv).

Exact: the block writing a column block's final values rotates the same fp16 values with the same arithmetic as
rope_kv_write (rope_math.cuh), so the q / k / v output and both caches are bit-identical to add_normed followed by
ops.rope_kv_write. Shapes: head_dim 128, 64 and 32 (two, four and eight heads per 256-column block), 1..32 tokens
(split-K with the last block's reduction, and the pre-gathering norm past one pass), every bit width, a q/k/v bias,
slots that are skipped (negative, past the cache); eager and graph-replayed; the model forward with it on and off.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import TensorShapeError
from tests.kernels.test_exl2_dequant import _to_cuda
from tests.kernels.tma_gemv import needs_tma_gemv, rand_half

pytestmark = pytest.mark.cuda

PAGES, PAGE = 4, 16


def _qkv(k: int, hq: int, hk: int, d: int, option: str, seed: int, bias: bool = False):
    from exl2_backend.ops import cuda_quant
    from tests.helpers.synth import random_qtensor

    parts = [random_qtensor(name, k, h * d, option, seed=seed + i, bias=bias)
             for i, (name, h) in enumerate((("q", hq), ("k", hk), ("v", hk)))]
    return cuda_quant.prepare_linear([_to_cuda(p) for p in parts], "cuda")


def _step(m: int, hk: int, d: int, seed: int):
    """positions, inv_freq, caches [P, S, Hk, D] and distinct slots, the second one skipped (-1) and, from three
    tokens, one past the cache."""
    from exl2_backend import ops

    g = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, 4096, (m,), generator=g, device="cuda")
    slots = torch.randperm(PAGES * PAGE, generator=g, device="cuda")[:m].clone()
    if m > 1:
        slots[1] = -1
    if m > 2:
        slots[2] = PAGES * PAGE
    inv_freq = ops.rope_inv_freq(d, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192}).cuda()
    kc, vc = rand_half((PAGES, PAGE, hk, d), seed + 1), rand_half((PAGES, PAGE, hk, d), seed + 2)
    return positions, inv_freq, kc, vc, slots


def _both(op, h, residual, w, hq, hk, d, step, pregather=None):
    """(fused qkv, residual, caches) and (add_normed + rope_kv_write, the same), from the same cache contents."""
    from exl2_backend import ops

    positions, inv_freq, kc, vc, slots = step
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = op.add_normed_rope_kv(h, residual, w, 1e-5, positions, inv_freq, kc1, vc1, slots, pregather=pregather)
    assert got is not None, "the fused rope declined"
    want = op.add_normed(h, residual, w, 1e-5, pregather=pregather)
    qkv = want[0]
    t = qkv.shape[0]
    q, k, v = qkv.split(op.splits, dim=-1)
    ops.rope_kv_write(q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d), positions, inv_freq, kc2, vc2, slots)
    return (got[0], got[1], kc1, vc1), (qkv, want[1], kc2, vc2)


@pytest.mark.parametrize("hq,hk,d,k", [(8, 2, 128, 1024), (9, 3, 64, 576), (8, 4, 32, 512)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 17, 32])
def test_fused_rope_kv_is_bit_identical(hq, hk, d, k, m):
    needs_tma_gemv("the fused rope and KV write")
    op = _qkv(k, hq, hk, d, "8:0.05@32 6:0.1@32 5:0.2@64 4:0.3@128 3:0.2@128 2:0.15@128", seed=m)
    h, r, w = rand_half((m, k), m), rand_half((m, k), m + 1), rand_half((k,), 3, 0.2) + 1
    got, want = _both(op, h, r, w, hq, hk, d, _step(m, hk, d, seed=m))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pregather", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_fused_rope_kv_both_norm_paths_with_bias_and_no_residual(pregather, m):
    needs_tma_gemv("the fused rope and KV write")
    hq, hk, d, k = 4, 2, 128, 512
    op = _qkv(k, hq, hk, d, "4:1@128", seed=10 + m, bias=True)
    if not (op.launch.can_norm_pregather(m) if pregather else op.launch.can_norm(m)):
        pytest.skip("this norm path does not take these rows")
    h, w = rand_half((m, k), m), rand_half((k,), 4, 0.2) + 1
    got, want = _both(op, h, None, w, hq, hk, d, _step(m, hk, d, seed=20 + m), pregather=pregather)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fused_rope_kv_in_a_cuda_graph():
    """Captured once; replays follow new positions, slots and inputs written into the static buffers."""
    needs_tma_gemv("the fused rope and KV write")
    hq, hk, d, k, m = 8, 2, 128, 1024, 2
    op = _qkv(k, hq, hk, d, "5:0.1@128 4:0.9@128", seed=5)
    w = rand_half((k,), 9, 0.2) + 1
    h, r = rand_half((m, k), 1), rand_half((m, k), 2)
    positions, inv_freq, kc, vc, slots = _step(m, hk, d, seed=3)
    op.add_normed_rope_kv(h, r, w, 1e-5, positions, inv_freq, kc, vc, slots)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.add_normed_rope_kv(h, r, w, 1e-5, positions, inv_freq, kc, vc, slots)
    for seed in (11, 12):
        step = _step(m, hk, d, seed=seed)
        h.copy_(rand_half((m, k), seed))
        positions.copy_(step[0])
        slots.copy_(step[4])
        kc.copy_(step[2])
        vc.copy_(step[3])
        before = (kc.clone(), vc.clone())
        graph.replay()
        torch.cuda.synchronize()
        got = (out[0], out[1], kc.clone(), vc.clone())
        kc.copy_(before[0])
        vc.copy_(before[1])
        _, want = _both(op, h, r, w, hq, hk, d, (positions, inv_freq, kc, vc, slots))
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_fused_rope_kv_refuses_what_it_cannot_take():
    needs_tma_gemv("the fused rope and KV write")
    from exl2_backend.ops import cuda_quant

    hq, hk, d, k, m = 4, 2, 128, 512, 1
    op = _qkv(k, hq, hk, d, "4:1@128", seed=1)
    h, w = rand_half((m, k), 1), rand_half((k,), 2) + 1
    positions, inv_freq, kc, vc, slots = _step(m, hk, d, seed=1)
    ws, counters = op.workspace.buffers()
    packed, handle = op.launch.parts[0].packed, op.launch.handle
    call = torch.ops.exl2_backend.exl2_gemv_add_norm_rope_kv
    with pytest.raises(TensorShapeError, match="k_cache"):
        call(h, None, w, 1e-5, packed, handle, ws, counters, False, positions, inv_freq, kc.float(), vc, slots)
    with pytest.raises(TensorShapeError, match="kv heads"):
        call(h, None, w, 1e-5, packed, handle, ws, counters, False, positions, inv_freq, kc[:, :, :1].contiguous(),
             vc[:, :, :1].contiguous(), slots)
    with pytest.raises(TensorShapeError, match="slots"):
        call(h, None, w, 1e-5, packed, handle, ws, counters, False, positions, inv_freq, kc, vc, slots.int())
    # the routing entry declines instead (the caller then runs the two ops)
    assert op.add_normed_rope_kv(h, None, w, 1e-5, positions, inv_freq, kc, vc, slots.int()) is None
    from tests.helpers.synth import random_qtensor

    qk = cuda_quant.prepare_linear([_to_cuda(random_qtensor(n, k, h * d, "4:1@128", seed=i))
                                    for i, (n, h) in enumerate((("q", hq), ("k", hk)))], "cuda")  # no v part
    with pytest.raises(TensorShapeError, match="q, k and v"):
        cuda_quant._rope_args(qk.launch, m, positions, inv_freq, kc, vc, slots)


@pytest.mark.parametrize("d,heads", [(128, (4, 2)), (64, (6, 2))])
def test_model_forward_bit_identical_with_rope_in_the_gemv(tmp_path, monkeypatch, d, heads):
    """LlamaModel: a prefill (M = 5: rope apart or in the pre-gathering norm's GEMV), decode steps of 1 and 3
    sequences; logits equal bit for bit with layers.ROPE_IN_GEMV on and off, and the fused path runs."""
    from exl2_backend.model import layers
    from exl2_backend.model.llama import LlamaModel
    from exl2_backend.ops import cuda_quant
    from tests.helpers.forward_steps import prefill_then_decode
    from tests.helpers.synth import tiny_config_dict, write_tiny_exl2_model

    needs_tma_gemv("the fused rope and KV write")
    hq, hk = heads
    cfg = tiny_config_dict(hidden_size=hq * d, intermediate_size=512, num_attention_heads=hq,
                           num_key_value_heads=hk, head_dim=d)
    model = LlamaModel.from_dir(write_tiny_exl2_model(tmp_path / "m", cfg, seed=4), "cuda")
    fused = []
    real = cuda_quant.CudaLinearOp.add_normed_rope_kv

    def counting(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(cuda_quant.CudaLinearOp, "add_normed_rope_kv", counting)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(layers, "ROPE_IN_GEMV", on)
        return prefill_then_decode(model)

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    assert any(fused) and len(fused) == 3 * len(model.layers)  # every q/k/v of the three steps was offered it
