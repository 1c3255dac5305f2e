"""Quantizers that produce EXL2 tensors (RTN now; GPTQ, measurement and the optimizer later)."""

from exl2_backend.quant.rtn import quantize_rtn, runtime_scales, search_group_scales

__all__ = ["quantize_rtn", "runtime_scales", "search_group_scales"]
