"""o_proj over the decode attention's split partials (CudaLinearOp.attn_combined: the attention leaves its
partials, exl2_gemv_attn combines them in the GEMV's input gather): bit-identical to paged_attention then the
GEMV, over batches, query lengths (a verify's k + 1 rows), contexts from one key to several splits' worth, both
head sizes, under CUDA-graph replay, and through the model's decode (EXL2_BACKEND_ATTN_COMBINE_IN_GEMV). Where the
route does not apply it declines (None) and the caller runs the two ops."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.synth import random_qtensor
from tests.helpers.tolerances import assert_exact
from tests.kernels.test_exl2_dequant import _to_cuda
from tests.kernels.test_paged_attention import build, cl

pytestmark = pytest.mark.cuda

_OPS: dict[int, object] = {}


def o_proj(k: int):
    """A CudaLinearOp of a random 4-bit K x 640 weight (one per K)."""
    from exl2_backend.ops import cuda_quant

    if k not in _OPS:
        qt = _to_cuda(random_qtensor("o_proj", k, 640, "4:1@128", seed=k))
        _OPS[k] = (qt, cuda_quant._op_for(qt, torch.device("cuda")))
    return _OPS[k][1]


def inputs(lens, tq, hq, hkv, d, page=16, seed=0):
    kc, vc, tables, lens_t, _ = build(lens, hkv, d, page, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    q = torch.randn(len(lens), tq, hq, d, generator=g, device="cuda").half()
    return q, kc, vc, tables, lens_t


def separate(op, q, kc, vc, tables, lens, scale):
    b, tq, hq, d = q.shape
    return op(cl().paged_attention(q, kc, vc, tables, lens, scale).reshape(b * tq, hq * d))


@pytest.mark.parametrize(("lens", "tq", "hq", "hkv", "d"), [
    ([1000], 1, 32, 8, 128),           # the 8B's decode shape at 1k
    ([700], 5, 32, 8, 128),            # a k = 4 verify
    ([300, 1, 90, 513], 1, 32, 8, 128),  # a batch with a one-key context
    ([2, 129], 3, 16, 4, 64),          # head size 64, short contexts
    ([1500, 40], 4, 16, 16, 64),       # no GQA, 8 tokens
])
def test_attn_combined_is_bit_identical(lens, tq, hq, hkv, d):
    q, kc, vc, tables, lens_t = inputs(lens, tq, hq, hkv, d, seed=len(lens) * 7 + tq)
    op = o_proj(hq * d)
    scale = d**-0.5
    nsplit = cl().attention_partials_splits(q, kc, vc, tables)
    assert nsplit is not None and nsplit >= 2
    got = op.attn_combined(q, kc, vc, tables, lens_t, scale)
    assert got is not None
    assert_exact(got, separate(op, q, kc, vc, tables, lens_t, scale), msg=f"lens={lens} tq={tq} nsplit={nsplit}")


def test_attn_combined_declines_where_it_does_not_apply(monkeypatch):
    op = o_proj(32 * 128)
    q, kc, vc, tables, lens_t = inputs([20], 1, 32, 8, 128)  # 4 table columns of 16 keys: one split
    assert cl().attention_partials_splits(q, kc, vc, tables) is None
    assert op.attn_combined(q, kc, vc, tables, lens_t, 0.1) is None
    q9, kc9, vc9, t9, l9 = inputs([300] * 9, 1, 32, 8, 128)  # 9 tokens
    assert op.attn_combined(q9, kc9, vc9, t9, l9, 0.1) is None
    q, kc, vc, tables, lens_t = inputs([900], 1, 16, 4, 128)  # K = 2048, not this op's 4096
    assert op.attn_combined(q, kc, vc, tables, lens_t, 0.1) is None
    monkeypatch.setattr(cl(), "ATTN_COMBINE_MAX_SPLITS", 2)
    q, kc, vc, tables, lens_t = inputs([1000], 1, 32, 8, 128)
    assert op.attn_combined(q, kc, vc, tables, lens_t, 0.1) is None


def test_attn_o_proj_op_rejects_what_the_route_declines():
    """Called directly, the custom op raises a typed error instead of launching (CudaLinearOp checks first)."""
    from exl2_backend.errors import InvalidRequestError, TensorShapeError

    op = o_proj(32 * 128)
    ws, counters = op.workspace.buffers()

    def call(q, kc, vc, tables, lens_t):
        return torch.ops.exl2_backend.exl2_attn_o_proj(q, kc, vc, tables, lens_t, 0.1, op.launch.parts[0].packed,
                                                       op.launch.handle, ws, counters)

    with pytest.raises(TensorShapeError, match="1..8 tokens"):
        call(*inputs([300] * 9, 1, 32, 8, 128))  # 9 tokens
    with pytest.raises(TensorShapeError, match="1..8 tokens"):
        call(*inputs([900], 1, 16, 4, 128))  # K = 2048
    with pytest.raises(InvalidRequestError, match="reduce"):
        call(*inputs([20], 1, 32, 8, 128))  # one split


def test_attn_combined_under_graph_replay():
    q, kc, vc, tables, lens_t = inputs([400], 1, 32, 8, 128, seed=3)
    op = o_proj(32 * 128)
    op.attn_combined(q, kc, vc, tables, lens_t, 0.125)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.attn_combined(q, kc, vc, tables, lens_t, 0.125)
    for ctx in (400, 257, 33):  # the same graph over shorter contexts (fewer used splits)
        lens_t.fill_(ctx)
        graph.replay()
        torch.cuda.synchronize()
        assert_exact(out, separate(op, q, kc, vc, tables, lens_t, 0.125), msg=f"replay at {ctx}")


def test_model_decode_with_the_combination_in_o_proj(monkeypatch):
    """Greedy decode of a small random Llama through the engine's decode graphs: the same tokens and the same
    last-step logits with the switch on as off."""
    from exl2_backend.bench.random_weights import RandomSource
    from exl2_backend.model import LlamaModel
    from exl2_backend.model import layers as model_layers
    from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
    from exl2_backend.sampling import SamplingParams

    shape = {"hidden_size": 2048, "num_hidden_layers": 2, "intermediate_size": 4096, "num_attention_heads": 16,
             "num_key_value_heads": 4, "vocab_size": 8192, "tie_word_embeddings": False,
             "max_position_embeddings": 4096}
    source = RandomSource(shape, 4.0)
    config = source.config()
    model = LlamaModel(config, source.weights(config, torch.device("cuda")), "cuda")
    settings = LoadSettings(device="cuda", max_seq_len=1024, cache_tokens=2048, max_batch_size=2, page_size=16,
                            prefix_caching=False)
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=12, ignore_eos=True)
    prompts = {"a": list(range(100, 700)), "b": list(range(5, 45))}

    def run():
        engine = Engine(model, None, settings)
        toks = {sid: [] for sid in prompts}
        for sid, p in prompts.items():
            engine.add_sequence(sid, p, params)
        for ev in engine.prefill(list(prompts)):
            toks[ev.seq_id] += ev.token_ids
        for _ in range(11):
            for ev in engine.decode(list(prompts)):
                toks[ev.seq_id] += ev.token_ids
        for sid in prompts:
            engine.release(sid)
        engine.assert_no_leaks()
        return toks

    monkeypatch.setattr(model_layers, "ATTN_COMBINE_IN_GEMV", False)
    plain = run()
    monkeypatch.setattr(model_layers, "ATTN_COMBINE_IN_GEMV", True)
    combined = run()
    assert combined == plain
