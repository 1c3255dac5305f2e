"""Quantization options (bit widths, proportions, group sizes) and the group layout they imply.

An option such as "8:0.05@32 4:0.95@128" says: 5% of the K input rows at 8 bits in groups of 32 rows, the
rest at 4 bits in groups of 128. Widths are listed in descending order, which is also the order the groups
must appear in on disk (exl2-format.md b.1). The option tables are ExLlamaV2's (format doc d.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exl2_backend.format.qtensor import BIT_WIDTHS


@dataclass(frozen=True)
class QuantOption:
    """One option for one projection. Parallel tuples, widths strictly descending."""

    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    group_size: tuple[int, ...]
    scale_bits: int = 4  # scale codes are always 4-bit in EXL2

    def __post_init__(self) -> None:
        n = len(self.bits)
        if n == 0 or len(self.bits_prop) != n or len(self.group_size) != n:
            raise ValueError(f"option needs matching, non-empty bits/bits_prop/group_size lists: {self}")
        for b in self.bits:
            if b not in BIT_WIDTHS:
                raise ValueError(f"bit width {b} is not one of {sorted(BIT_WIDTHS)}")
        if any(a <= b for a, b in zip(self.bits, self.bits[1:])):
            raise ValueError(f"bit widths must be strictly descending, got {self.bits}")
        if any(p <= 0 for p in self.bits_prop) or abs(sum(self.bits_prop) - 1.0) > 1e-6:
            raise ValueError(f"proportions must be positive and sum to 1, got {self.bits_prop}")
        if any(g <= 0 or g % 32 for g in self.group_size):
            raise ValueError(f"group sizes must be positive multiples of 32, got {self.group_size}")

    @classmethod
    def parse(cls, text: str) -> QuantOption:
        """Parse "bits:proportion@group_size ..." (e.g. "8:0.05@32 4:0.95@128", "4:1@128")."""
        bits, props, sizes = [], [], []
        for part in text.split():
            try:
                head, gsize = part.split("@")
                b, p = head.split(":")
                bits.append(int(b))
                props.append(float(p))
                sizes.append(int(gsize))
            except ValueError as e:
                raise ValueError(f"bad quantization option part {part!r} in {text!r} (want bits:prop@gsize)") from e
        return cls(tuple(bits), tuple(props), tuple(sizes))

    def __str__(self) -> str:
        return " ".join(f"{b}:{p:g}@{g}" for b, p, g in zip(self.bits, self.bits_prop, self.group_size))

    def to_json(self) -> dict:
        """The record shape of ExLlamaV2's measurement.json (group_size keyed by width as a string)."""
        return {
            "group_size": {str(b): g for b, g in zip(self.bits, self.group_size)},
            "bits": list(self.bits),
            "bits_prop": list(self.bits_prop),
            "scale_bits": self.scale_bits,
        }

    @classmethod
    def from_json(cls, d: dict) -> QuantOption:
        bits = tuple(int(b) for b in d["bits"])
        return cls(bits, tuple(float(p) for p in d["bits_prop"]), tuple(int(d["group_size"][str(b)]) for b in bits))

    def group_counts(self, k: int) -> list[int]:
        """Groups per width by ExLlamaV2's sizing rule (adaptivegptq.configure); may overshoot K."""
        remaining = k
        counts = []
        for p, gsize in zip(self.bits_prop, self.group_size):
            n_g = max(0, math.ceil(min(k * p, remaining) / gsize))
            counts.append(n_g)
            remaining -= n_g * gsize
        if remaining > 0:
            raise ValueError(f"option {self} leaves {remaining} of K={k} rows unassigned")
        return counts

    def group_layout(self, k: int) -> list[tuple[int, int]]:
        """[(bits, rows)] in storage order: each width's groups of `gsize` rows, the last one cut at K.

        Groups that would start at or past K (possible when an earlier width overshoots) are dropped.
        """
        if k <= 0 or k % 32:
            raise ValueError(f"in_features K={k} must be a positive multiple of 32 for EXL2")
        layout = []
        row = 0
        for b, gsize, n_g in zip(self.bits, self.group_size, self.group_counts(k)):
            for _ in range(n_g):
                if row >= k:
                    break
                rows = min(gsize, k - row)
                layout.append((b, rows))
                row += rows
        return layout

    def total_bits(self, k: int, n: int, *, bias: bool = False) -> int:
        """Storage bits of a K x N linear (qparams.total_bits; format doc c). Pass N padded if you want Np."""
        layout = self.group_layout(k)
        g = len(layout)
        bits = sum(rows * n * b for b, rows in layout)
        bits += g * 16  # q_scale_max
        bits += g * 32  # q_groups (two int16 per group)
        bits += g * n * self.scale_bits  # q_scale
        bits += k * 32  # q_invperm
        if bias:
            bits += n * 16
        return bits

    def bits_per_weight(self, k: int, n: int) -> float:
        return self.total_bits(k, n) / (k * n)


def _table(rows: list[str]) -> tuple[tuple[QuantOption, ...], ...]:
    return tuple(tuple(QuantOption.parse(p) for p in row.split("|")) for row in rows)


# Attention options (q, k, v, o), cheapest first (format doc d.2, from ExLlamaV2's qparams.py).
ATTENTION_OPTIONS: tuple[tuple[QuantOption, QuantOption, QuantOption, QuantOption], ...] = _table([
    "3:0.05@64 2:0.95@64 | 3:0.05@64 2:0.95@64 | 3:0.05@64 2:0.95@64 | 3:0.05@64 2:0.95@64",
    "3:0.1@64 2:0.9@64 | 3:0.1@64 2:0.9@64 | 3:0.25@64 2:0.75@64 | 3:0.1@64 2:0.9@64",
    "3:0.1@64 2:0.9@64 | 3:0.1@64 2:0.9@64 | 4:0.1@128 3:0.9@128 | 3:0.1@64 2:0.9@64",
    "3:0.1@64 2:0.9@64 | 3:0.1@64 2:0.9@64 | 4:0.1@128 3:0.9@128 | 4:0.1@128 3:0.9@128",
    "4:0.1@128 3:0.9@128 | 4:0.1@128 3:0.9@128 | 4:0.1@128 3:0.9@128 | 4:0.1@128 3:0.9@128",
    "4:0.1@128 3:0.9@128 | 4:0.1@128 3:0.9@128 | 4:0.1@64 3:0.9@64 | 4:0.1@128 3:0.9@128",
    "4:1@128 | 4:1@128 | 4:1@128 | 4:1@128",
    "4:1@128 | 4:1@128 | 4:1@64 | 4:1@128",
    "4:1@64 | 4:1@64 | 4:1@32 | 4:1@64",
    "4:1@32 | 4:1@32 | 4:1@32 | 4:1@32",
    "5:0.1@128 4:0.9@128 | 5:0.1@128 4:0.9@128 | 5:0.1@64 4:0.9@64 | 5:0.1@128 4:0.9@128",
    "5:0.1@64 4:0.9@64 | 5:0.1@64 4:0.9@64 | 5:0.1@32 4:0.9@32 | 5:0.1@64 4:0.9@64",
    "5:0.1@64 4:0.9@64 | 5:0.1@64 4:0.9@64 | 5:1@64 | 5:0.1@64 4:0.9@64",
    "5:0.1@32 4:0.9@32 | 5:0.1@32 4:0.9@32 | 5:1@32 | 5:0.1@32 4:0.9@32",
    "6:0.1@128 5:0.9@128 | 6:0.1@128 5:0.9@128 | 6:1@128 | 6:0.1@128 5:0.9@128",
    "6:0.1@32 5:0.9@32 | 6:0.1@32 5:0.9@32 | 6:1@32 | 6:0.1@32 5:0.9@32",
    "6:1@128 | 6:1@128 | 6:1@128 | 6:1@128",
    "6:1@32 | 6:1@32 | 8:1@32 | 6:1@32",
    "8:1@128 | 8:1@128 | 8:1@128 | 8:1@128",
])

# MLP options (gate, up, down), cheapest first.
MLP_OPTIONS: tuple[tuple[QuantOption, QuantOption, QuantOption], ...] = _table([
    "3:0.05@64 2:0.95@64 | 3:0.05@64 2:0.95@64 | 6:0.05@32 3:0.2@64 2:0.75@64",
    "3:0.1@64 2:0.9@64 | 3:0.25@64 2:0.75@64 | 6:0.05@32 3:0.2@64 2:0.75@64",
    "3:0.1@64 2:0.9@64 | 3:0.3@64 2:0.7@64 | 5:0.05@32 3:0.95@32",
    "3:0.1@64 2:0.9@64 | 3:0.3@64 2:0.7@64 | 5:0.05@32 4:0.95@32",
    "4:0.1@128 3:0.9@128 | 4:0.25@128 3:0.75@128 | 8:0.05@32 4:0.1@128 3:0.85@128",
    "4:0.1@32 3:0.9@32 | 4:0.25@32 3:0.75@32 | 8:0.05@32 4:0.1@32 3:0.85@32",
    "4:0.1@32 3:0.9@32 | 4:0.25@32 3:0.75@32 | 8:0.05@32 4:0.95@128",
    "4:1@128 | 4:1@32 | 8:0.05@32 4:0.95@128",
    "4:1@32 | 4:1@32 | 8:0.05@32 4:0.95@32",
    "5:0.1@128 4:0.9@128 | 5:0.25@128 4:0.75@128 | 8:0.05@32 5:0.1@128 4:0.85@128",
    "5:0.1@32 4:0.9@32 | 5:0.25@32 4:0.75@32 | 8:0.05@32 5:0.1@32 4:0.85@32",
    "6:0.1@128 5:0.9@128 | 6:0.25@128 5:0.75@128 | 8:0.05@32 6:0.1@128 5:0.85@128",
    "6:0.1@32 5:0.9@32 | 6:0.25@32 5:0.75@32 | 8:0.05@32 6:0.1@32 5:0.85@32",
    "6:1@128 | 6:1@128 | 8:0.05@32 6:0.95@128",
    "8:0.1@128 6:0.9@128 | 8:0.1@128 6:0.9@128 | 8:0.15@128 6:0.85@128",
    "8:0.1@128 6:0.9@128 | 8:0.1@128 6:0.9@128 | 8:1@128",
    "8:1@128 | 8:1@128 | 8:1@128",
])

# Head option by head_bits (not part of the optimization).
HEAD_OPTIONS: dict[int, QuantOption] = {
    2: QuantOption.parse("4:0.3@32 2:0.7@32"),
    3: QuantOption.parse("4:0.15@32 3:0.85@32"),
    4: QuantOption.parse("6:0.15@32 4:0.85@32"),
    5: QuantOption.parse("6:0.15@128 5:0.85@128"),
    6: QuantOption.parse("8:0.15@128 6:0.85@128"),
    8: QuantOption.parse("8:1@128"),
}
