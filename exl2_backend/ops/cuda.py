"""The CUDA implementations `ops/dispatch.py` looks up by name (a missing name falls back to the reference)."""

from __future__ import annotations

try:
    from exl2_backend.ops.cuda_kvquant import (  # noqa: F401
        dequantize_pages,
        kv_quant_write,
        paged_attention_quant,
        rope_kv_quant_write,
    )
    from exl2_backend.ops.cuda_layers import *
except ImportError:  # layer kernels not written yet: those ops run on the reference
    pass

# Imported last so the quantized-linear entry points are always these.
from exl2_backend.ops.cuda_quant import exl2_dequant, exl2_gemm, prepare_linear  # noqa: F401
