"""Planned scratch memory of one prefill forward: an upper bound that depends on max_input_len, the chunk
size and the model's shapes, never on the prompt length (issue: chunked prefill never spikes memory).

What a forward of T = max_input_len tokens allocates beyond weights and KV cache, on the CUDA path:
- hidden-sized activations: at most 5 [T, H] buffers live at once (h, residual, normed x, and the two
  outputs of add_rms_norm while the old ones are still bound), plus ids / positions / slots (int64 [T]);
- then the largest of three phases, which never overlap:
  attention: the fused q/k/v output (pieces and concatenation), dequantized weight slices (<= 2 live,
    DEQUANT_SLICE columns each), prefill attention scratch for one chunk (ops/attention_prefill.py: the
    chunk's own K/V expanded for GQA, one gathered history block of KEY_BLOCK keys, fp32 accumulators)
    or, for chunks of <= 16 queries, the decode kernel's split workspace at max_seq_len; the o_proj output;
  MLP: the gate/up output (pieces and concatenation), silu * up, the down output, weight slices;
  head and sampling: logits of the finishing sequences (fp16 and fp32) and the sampler's [B, V] buffers.
The measured peak is checked against this by tests/engine/test_prefill_memory.py on the GPU.
"""

from __future__ import annotations

import math

from exl2_backend.format.qtensor import pad32
from exl2_backend.ops.attention_prefill import KEY_BLOCK
from exl2_backend.ops.cuda_quant import DEQUANT_SLICE
from exl2_backend.ops.dispatch import DECODE_KERNEL_MAX_QUERIES

_I64 = 8
_F32 = 4
_F16 = 2  # dequantized weight slices are fp16 whatever the activation dtype


def linear_scratch(op, m: int, elem: int) -> int:
    """A linear op on m rows: its output twice (per-slice pieces + their concatenation) and two
    dequantized fp16 weight slices [K, <= DEQUANT_SLICE]."""
    cols = max(min(pad32(n), DEQUANT_SLICE) for n in op.splits)
    return 2 * m * op.out_features * elem + 2 * op.in_features * cols * _F16


def prefill_attention_scratch(tq: int, hq: int, hkv: int, d: int, page_size: int, max_seq_len: int,
                              elem: int) -> int:
    """ops/attention_prefill.py for one sequence's chunk of tq queries."""
    qd = tq * hq * d
    own = (tq + 2 * page_size) * hkv * d * elem * 2 + 2 * qd * elem  # gathered pages of the chunk, GQA-expanded
    kb = min(KEY_BLOCK, max_seq_len)
    block = (kb + 2 * page_size) * hkv * d * elem * 2  # one gathered history block (k and v)
    fixed = 6 * qd * elem + 2 * qd * _F32 + 8 * hq * tq * _F32  # q copies, block outputs, acc + merge temp, lse
    return own + block + fixed


def decode_kernel_workspace(max_rows: int, max_batch_size: int, hq: int, hkv: int, d: int, max_seq_len: int,
                            num_sms: int) -> int:
    """Split workspace of the paged decode kernel (ops/cuda_layers.paged_attention), which takes chunks of
    <= DECODE_KERNEL_MAX_QUERIES queries per sequence, at a context of max_seq_len: the largest over the batch
    shapes that fit."""
    from exl2_backend.ops.cuda_layers import (
        _ATTN_CTAS_PER_SM,
        ATTN_CTAS_PER_SM_8BIT,
        ATTN_TILES_PER_CTA_MAX,
        MMA_ROW_TILE,
        _attn_keys_max,
        _attn_row_tile,
        attention_splits,
    )

    ctas = max(_ATTN_CTAS_PER_SM, ATTN_CTAS_PER_SM_8BIT)  # the split of any cache type

    worst = 0
    for tq in range(1, DECODE_KERNEL_MAX_QUERIES + 1):
        b = max(1, min(max_batch_size, max_rows // tq))
        # The most splits of any kernel: the CUDA-core kernel's tiles, the tensor-core kernels' (one or several
        # per CTA), each at the largest CTA target.
        splits = max(attention_splits(b, tq, hq, hkv, max_seq_len, num_sms, ctas),
                     attention_splits(b, tq, hq, hkv, max_seq_len, num_sms, ctas, MMA_ROW_TILE),
                     attention_splits(b, tq, hq, hkv, max_seq_len, num_sms, ctas, MMA_ROW_TILE,
                                      ATTN_TILES_PER_CTA_MAX))
        splits = max(splits, math.ceil(max_seq_len / _attn_keys_max(_attn_row_tile((hq // hkv) * tq))))
        worst = max(worst, b * tq * hq * splits * (d + 2) * _F32)
    return worst


def prefill_scratch_bytes(model, max_input_len: int, max_chunk: int, max_batch_size: int, max_seq_len: int,
                          page_size: int) -> int:
    """Upper bound of the device bytes one prefill forward allocates (see the module docstring)."""
    t = max_input_len
    tq = min(max_chunk, t)
    elem = model.dtype.itemsize
    cfg = model.config
    h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    v = model.vocab_size
    base = 5 * t * h * elem + 3 * t * _I64
    num_sms = 132  # H200; the real count when on a GPU
    if model.device.type == "cuda":
        import torch

        num_sms = torch.cuda.get_device_properties(model.device).multi_processor_count
    attn_core = max(prefill_attention_scratch(tq, hq, hkv, d, page_size, max_seq_len, elem),
                    decode_kernel_workspace(t, max_batch_size, hq, hkv, d, max_seq_len, num_sms))
    attn = mlp = 0
    for layer in model.layers:
        attn = max(attn, linear_scratch(layer.qkv, t, elem) + 2 * t * hq * d * elem + attn_core
                   + linear_scratch(layer.o, t, elem))
        inter = layer.gate_up.splits[0]
        mlp = max(mlp, linear_scratch(layer.gate_up, t, elem) + t * inter * elem + linear_scratch(layer.down, t, elem))
    b = min(max_batch_size, t)  # sequences finishing their prompt in one forward
    head = linear_scratch(model.lm_head, b, elem) if model.lm_head is not None else 0
    head += b * pad32(v) * (elem + _F32) + 8 * b * v * _F32  # logits fp16 + fp32, sampler buffers
    return base + max(attn, mlp, head)
