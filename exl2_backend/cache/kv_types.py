"""KV cache storage types: which element format K and V are stored in, and what a token costs.

A cache type pairs a format for K with one for V (format doc e):

  type   K       V       bits/element (incl. scales)
  fp16   fp16    fp16    16
  fp8    e4m3    e4m3    8.5
  q8     int8    int8    8.5
  q6     int8    int4    6.5 average  (ExLlamaV2's "Q6": K at 8 bits, V at 4)
  q4     int4    int4    4.5

Every quantized format keeps one fp16 scale per GROUP consecutive elements of a (token, kv head) row. The
integer formats first rotate each group by the orthonormal 32-point Walsh-Hadamard transform (spreads
outliers over the group, so the absmax scale wastes fewer levels); attention then works in the rotated
domain (q·k is unchanged by a common rotation), so no read path ever undoes the rotation per key.
The exact arithmetic is in `exl2_backend/ops/reference_kvquant.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from exl2_backend.errors import ConfigError

GROUP = 32  # elements per scale, and per Hadamard block


@dataclass(frozen=True)
class KVFormat:
    """Storage format of one of K / V."""

    name: str  # "fp16" | "e4m3" | "int8" | "int4"
    bits: int  # bits of one stored element code
    abi: int  # format code of the C ABI (csrc/layers/kv_quant.cuh KVFmt); 0 = fp16 (not a quantized format)
    qmax: int  # largest code magnitude
    rotated: bool  # Hadamard-rotated in groups of GROUP before quantizing
    # Candidate divisors of the group absmax: scale = absmax / divisor; with several, the one with the smallest
    # squared error of the group wins (clipping the largest elements a little buys a finer grid for the rest).
    divisors: tuple[float, ...] = ()

    @property
    def scale_divisors(self) -> tuple[float, ...]:
        return self.divisors or (float(self.qmax),)

    @property
    def quantized(self) -> bool:
        return self.name != "fp16"

    def code_bytes(self, head_dim: int) -> int:
        """Bytes of codes per (token, kv head) row."""
        return head_dim * self.bits // 8

    def bytes_per_row(self, head_dim: int, fp_bytes: int = 2) -> int:
        """Codes plus scales of one (token, kv head) row; `fp_bytes` is the element size of an fp16 cache."""
        if not self.quantized:
            return head_dim * fp_bytes
        return self.code_bytes(head_dim) + 2 * (head_dim // GROUP)


FORMATS = {
    "fp16": KVFormat("fp16", 16, 0, 0, False),
    "e4m3": KVFormat("e4m3", 8, 1, 448, False),
    "int8": KVFormat("int8", 8, 2, 127, True),
    "int4": KVFormat("int4", 4, 3, 7, True, (7.0, 7.5, 8.0, 8.5, 9.0, 10.0)),
}


@dataclass(frozen=True)
class CacheType:
    name: str
    k: KVFormat
    v: KVFormat

    @property
    def quantized(self) -> bool:
        return self.k.quantized

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, fp_bytes: int = 2) -> int:
        """K+V bytes (codes and scales) one token occupies across all layers."""
        row = self.k.bytes_per_row(head_dim, fp_bytes) + self.v.bytes_per_row(head_dim, fp_bytes)
        return num_layers * num_kv_heads * row

    def check_head_dim(self, head_dim: int) -> None:
        if self.quantized and head_dim % GROUP:
            raise ConfigError(f"cache_type {self.name!r} needs head_dim to be a multiple of {GROUP} (scale groups), "
                              f"the model has head_dim {head_dim}; use cache_type='fp16'", field="cache_type")


CACHE_TYPES: dict[str, CacheType] = {
    "fp16": CacheType("fp16", FORMATS["fp16"], FORMATS["fp16"]),
    "fp8": CacheType("fp8", FORMATS["e4m3"], FORMATS["e4m3"]),
    "q8": CacheType("q8", FORMATS["int8"], FORMATS["int8"]),
    "q6": CacheType("q6", FORMATS["int8"], FORMATS["int4"]),
    "q4": CacheType("q4", FORMATS["int4"], FORMATS["int4"]),
}
CACHE_TYPE_NAMES = tuple(CACHE_TYPES)


def get_cache_type(name: str | CacheType) -> CacheType:
    """The CacheType of `name` (case-insensitive); ConfigError naming the choices otherwise."""
    if isinstance(name, CacheType):
        return name
    ct = CACHE_TYPES.get(str(name).strip().lower())
    if ct is None:
        raise ConfigError(f"cache_type must be one of {', '.join(CACHE_TYPE_NAMES)}, got {name!r}", field="cache_type")
    return ct
