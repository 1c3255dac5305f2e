"""The GPU kernels' packed weight layout (csrc/quant/exl2_quant.cuh), written by cuda_quant._pack_run, read back
on the CPU by the layout's definition (which bits of which lane word hold each pair) for every width. The kernel
decoder's own arithmetic is transliterated in tests/kernels/test_exl2_dequant.py (test_layout_decodes_...)."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.ops import cuda_quant

WIDTHS = (2, 3, 4, 5, 6, 8)
MAIN_WORDS = {8: 8, 6: 4, 5: 4, 4: 4, 3: 2, 2: 2}


def _packed_tiles(bits: int, nch: int = 2, np_: int = 64, seed: int = 0):
    """Random values [64 nch, np_] and their packed words as [nch, J, 2 n-tiles, 32 lanes, bits] (MAIN then AUX
    words of each lane, as the kernel's load_lane_words reads them)."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(0, 1 << bits, (64 * nch, np_), generator=g, dtype=torch.int64).to(torch.uint8)
    words = cuda_quant._pack_run(vals, bits) & 0xFFFFFFFF
    J, m = np_ // 32, MAIN_WORDS[bits]
    per_tile = words.view(nch, J, 64 * bits)
    main = per_tile[..., : 64 * m].reshape(nch, J, 2, 32, m)
    aux = per_tile[..., 64 * m :].reshape(nch, J, 2, 32, bits - m)
    return vals, torch.cat([main, aux], dim=-1)


def _field(words: torch.Tensor, word: int, offset: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = words[..., word]
    return (w >> offset) & ((1 << width) - 1), (w >> (offset + 16)) & ((1 << width) - 1)


def _pair_values(words: torch.Tensor, bits: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) value of pair p from a lane's words, by the layout's definition (exl2_quant.cuh)."""
    if bits in (8, 4, 2):
        per = 16 // bits
        return _field(words, p // per, bits * (p % per), bits)
    if bits in (6, 5):
        lo = _field(words, p // 4, 4 * (p % 4), 4)
        hb, per = bits - 4, 16 // (bits - 4)
        hi = _field(words, 4 + p // per, hb * (p % per), hb)
        return lo[0] | (hi[0] << 4), lo[1] | (hi[1] << 4)
    if p < 15:
        return _field(words, p // 5, 3 * (p % 5), 3)
    lo = sum(_field(words, k, 15, 1)[0] << k for k in range(3))
    hi = sum(_field(words, k, 15, 1)[1] << k for k in range(3))
    return lo, hi


@pytest.mark.parametrize("bits", WIDTHS)
def test_packed_pairs_hold_the_values_of_their_rows_and_columns(bits):
    vals, words = _packed_tiles(bits, seed=bits)
    row, col = cuda_quant._lane_tables(torch.device("cpu"))  # [2, 32, 16]
    nch, J = words.shape[:2]
    for c in range(nch):
        for j in range(J):
            tile = vals[64 * c : 64 * (c + 1), 32 * j : 32 * (j + 1)].long()
            for p in range(16):
                lo, hi = _pair_values(words[c, j], bits, p)  # [2, 32]
                assert torch.equal(lo, tile[row[..., p], col[..., p]]), (bits, c, j, p)
                assert torch.equal(hi, tile[row[..., p] + 1, col[..., p]]), (bits, c, j, p)
