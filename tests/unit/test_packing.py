"""Bit packing of q_weight / q_scale against the format doc's word layout (b.3, b.4) and build_qtensor."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.errors import UnsupportedBitWidthError
from exl2_backend.format.build import build_qtensor
from exl2_backend.format.layout import QuantOption
from exl2_backend.format.packing import pack_columns, pack_scales, unpack_columns, unpack_scales
from exl2_backend.format.qtensor import pad32

WIDTHS = (2, 3, 4, 5, 6, 8)


def _u32(t: torch.Tensor) -> list[int]:
    return [int(x) & 0xFFFFFFFF for x in t.flatten()]


def _stream_reference(values: list[int], bits: int) -> list[int]:
    """One column's words from the definition: value k at stream bits [k*b, (k+1)*b), bit j -> word j//32."""
    stream = 0
    for k, v in enumerate(values):
        stream |= v << (k * bits)
    return [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(len(values) * bits // 32)]


@pytest.mark.parametrize("bits", WIDTHS)
def test_pack_matches_bitstream_definition_and_roundtrips(bits):
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (96, 40), generator=g)  # [rows, Np]
    packed = pack_columns(values, bits)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (96 * bits // 32, 40)
    for col in (0, 17, 39):
        assert _u32(packed[:, col]) == _stream_reference(values[:, col].tolist(), bits)
    assert torch.equal(unpack_columns(packed, bits), values.to(torch.int32))


@pytest.mark.parametrize("bits", WIDTHS)
def test_each_value_slot_occupies_its_stream_bits(bits):
    for k in range(32):
        values = torch.zeros(32, 1, dtype=torch.int64)
        values[k, 0] = (1 << bits) - 1
        words = _u32(pack_columns(values, bits))
        set_bits = {32 * w + j for w, word in enumerate(words) for j in range(32) if word >> j & 1}
        assert set_bits == set(range(k * bits, (k + 1) * bits)), (bits, k)


def _words(bits: int, slot: int, value: int) -> list[int]:
    values = torch.zeros(32, 1, dtype=torch.int64)
    values[slot, 0] = value
    return _u32(pack_columns(values, bits))


def test_word_layout_table_of_the_format_doc():
    # 3-bit: v10 = w0[30:31] (low 2 bits) + w1[0] (top bit); v21 = w1[31] (low bit) + w2[0:1]
    assert _words(3, 10, 0b101) == [1 << 30, 1, 0]
    assert _words(3, 21, 0b110) == [0, 0, 0b11]
    assert _words(3, 21, 0b001) == [0, 1 << 31, 0]
    assert _words(3, 22, 0b111) == [0, 0, 0b111 << 2]
    # 5-bit: v6 = w0[30:31] + w1[0:2]; v12 = w1[28:31] + w2[0]; v19 = w2[31] + w3[0:3]; v25 = w3[29:31] + w4[0:1]
    assert _words(5, 6, 0b11101) == [0b01 << 30, 0b111, 0, 0, 0]
    assert _words(5, 12, 0b10110) == [0, 0b0110 << 28, 1, 0, 0]
    assert _words(5, 19, 0b11111) == [0, 0, 1 << 31, 0b1111, 0]
    assert _words(5, 25, 0b11001) == [0, 0, 0, 0b001 << 29, 0b11]
    # 6-bit: v5 = w0[30:31] + w1[0:3]; v10 = w1[28:31] + w2[0:1]; v11 at w2[2:7]
    assert _words(6, 5, 0b101110) == [0b10 << 30, 0b1011, 0, 0, 0, 0]  # 32 values = 6 words
    assert _words(6, 10, 0b110101) == [0, 0b0101 << 28, 0b11, 0, 0, 0]
    assert _words(6, 11, 0b111111) == [0, 0, 0b111111 << 2, 0, 0, 0]
    assert _words(6, 26, 0b110101) == [0, 0, 0, 0, 0b0101 << 28, 0b11]  # second 16-value half repeats
    # 2/4/8-bit: whole values per word, value k at w[b*k : b*k+b-1] of word k // (32/b)
    assert _words(2, 17, 0b11) == [0, 0b11 << 2]
    assert _words(4, 9, 0xA) == [0, 0xA << 4, 0, 0]
    assert _words(8, 7, 0xC3) == [0, 0xC3 << 24] + [0] * 6


def test_scale_nibble_layout():
    codes = (torch.arange(32) % 16).view(1, 32)  # [G=1, Np=32]
    packed = pack_scales(codes)
    assert tuple(packed.shape) == (1, 4)
    assert _u32(packed) == [0x76543210, 0xFEDCBA98, 0x76543210, 0xFEDCBA98]
    assert torch.equal(unpack_scales(packed), codes.to(torch.int32))
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g)
    assert torch.equal(unpack_scales(pack_scales(codes)), codes.to(torch.int32))


def test_pack_rejects_bad_input():
    with pytest.raises(UnsupportedBitWidthError):
        pack_columns(torch.zeros(32, 8, dtype=torch.int64), 7)
    with pytest.raises(UnsupportedBitWidthError):
        pack_columns(torch.zeros(48, 8, dtype=torch.int64), 4)
    with pytest.raises(ValueError):
        pack_columns(torch.full((32, 8), 16), 4)
    with pytest.raises(ValueError):
        pack_scales(torch.full((1, 8), 16))


def _random_build(option: str, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layout = QuantOption.parse(option).group_layout(k)
    np_ = pad32(n)
    qvalues = torch.cat([torch.randint(0, 1 << b, (r, np_), generator=g) for b, r in layout])  # [K, Np]
    codes = torch.randint(0, 16, (len(layout), np_), generator=g)  # [G, Np]
    smax = torch.rand(len(layout), generator=g).half()
    invperm = torch.randperm(k, generator=g)
    qt = build_qtensor("layer", qvalues, codes, smax, layout, invperm, n)
    return qt, layout, qvalues, codes


@pytest.mark.parametrize(
    "option,k,n",
    [("8:0.05@32 4:0.95@128", 14336, 32), ("6:0.05@32 3:0.2@64 2:0.75@64", 96, 40),
     ("6:0.05@32 3:0.2@64 2:0.75@64", 160, 40), ("8:0.05@32 5:0.1@32 4:0.85@32", 576, 70),
     ("5:0.05@32 3:0.95@32", 256, 33), ("2:1@64", 64, 8)],
)
def test_build_qtensor_unpacks_to_the_inputs(option, k, n):
    qt, layout, qvalues, codes = _random_build(option, k, n)
    assert [(g.bits, g.rows) for g in qt.groups] == layout
    for g in qt.groups:
        rows = g.rows * g.bits // 32
        got = unpack_columns(qt.q_weight[g.qrow_start : g.qrow_start + rows], g.bits)
        assert torch.equal(got, qvalues[g.row_start : g.row_start + g.rows].to(torch.int32))
    assert torch.equal(unpack_scales(qt.q_scale), codes.to(torch.int32))
    qrow, expected = 0, []
    for b, r in layout:
        expected += [b, qrow]
        qrow += r * b // 32
    assert qt.q_groups.dtype == torch.int16 and qt.q_groups.tolist() == expected
    assert qt.q_weight.shape[0] == qrow


def test_llama8b_down_proj_example_b1():
    layout = QuantOption.parse("8:0.05@32 4:0.95@128").group_layout(14336)
    assert len(layout) == 130
    assert layout[:23] == [(8, 32)] * 23 and layout[23:129] == [(4, 128)] * 106 and layout[129] == (4, 32)
    assert sum(r * b // 32 for b, r in layout) == 1884  # q_weight [1884, 4096]
    qt, *_ = _random_build("8:0.05@32 4:0.95@128", 14336, 64)
    offsets = qt.q_groups[1::2].tolist()
    assert offsets[:24] == [8 * g for g in range(24)]  # 8-bit groups: 8 packed rows each; 4-bit run starts at 184
    assert offsets[23:] == [184 + 16 * i for i in range(107)]
    assert tuple(qt.q_weight.shape) == (1884, 64) and tuple(qt.q_scale.shape) == (130, 8)


def test_bits_per_weight_matches_option_accounting():
    option = QuantOption.parse("6:0.05@32 3:0.2@64 2:0.75@64")
    qt, *_ = _random_build(str(option), 160, 64)
    assert qt.bits_per_weight() == pytest.approx(option.total_bits(160, 64) / (160 * 64))
