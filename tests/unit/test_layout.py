"""Quantization options: parsing, ExLlamaV2's group sizing rule, bit accounting, and the d.2 option tables."""

from __future__ import annotations

import pytest

from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS, QuantOption

# bpw per option for Llama-3.1-8B shapes, from the table of format doc d.2 (attention: q,k,v,o; MLP: gate,up,down)
ATTN_BPW = [2.14, 2.20, 2.28, 2.68, 3.17, 3.17, 4.04, 4.05, 4.08, 4.14, 4.17, 4.19, 4.27, 4.33, 5.26, 5.33, 6.04,
            6.34, 8.04]
MLP_BPW = [2.24, 2.32, 2.60, 2.91, 3.28, 3.37, 3.62, 4.14, 4.20, 4.27, 4.35, 5.25, 5.33, 6.07, 6.30, 6.87, 8.04]
HEAD_BPW = {2: 2.73, 3: 3.28, 4: 4.44, 5: 5.19, 6: 6.34, 8: 8.03}  # format doc c, 4096 x 128256
H, I, KV = 4096, 14336, 1024


def test_table_sizes_and_shapes():
    assert len(ATTENTION_OPTIONS) == 19 and all(len(o) == 4 for o in ATTENTION_OPTIONS)
    assert len(MLP_OPTIONS) == 17 and all(len(o) == 3 for o in MLP_OPTIONS)
    assert sorted(HEAD_OPTIONS) == [2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("option", [o for row in ATTENTION_OPTIONS + MLP_OPTIONS for o in row]
                         + list(HEAD_OPTIONS.values()))
def test_every_option_is_well_formed(option: QuantOption):
    assert sum(option.bits_prop) == pytest.approx(1.0, abs=1e-9)
    assert list(option.bits) == sorted(option.bits, reverse=True)
    assert set(option.group_size) <= {32, 64, 128}
    for k in (32, 96, 160, 576, 1536, 4096, 14336):
        layout = option.group_layout(k)
        assert sum(rows for _, rows in layout) == k
        assert all(rows % 32 == 0 and rows > 0 for _, rows in layout)
        widths = [b for b, _ in layout]
        assert widths == sorted(widths, reverse=True)


def _bpw(options, shapes) -> float:
    bits = sum(o.total_bits(k, n) for o, (k, n) in zip(options, shapes))
    return bits / sum(k * n for k, n in shapes)


def test_option_tables_reproduce_the_documented_bpw():
    attn = [(H, H), (H, KV), (H, KV), (H, H)]
    mlp = [(H, I), (H, I), (I, H)]
    assert [round(_bpw(o, attn), 2) for o in ATTENTION_OPTIONS] == ATTN_BPW
    assert [round(_bpw(o, mlp), 2) for o in MLP_OPTIONS] == MLP_BPW
    assert {b: round(o.bits_per_weight(H, 128256), 2) for b, o in HEAD_OPTIONS.items()} == HEAD_BPW


def test_sizing_rule_example_b1():
    option = QuantOption.parse("8:0.05@32 4:0.95@128")
    assert option.group_counts(14336) == [23, 107]
    layout = option.group_layout(14336)
    assert len(layout) == 130 and layout[0] == (8, 32) and layout[-1] == (4, 32)
    assert sum(rows * bits // 32 for bits, rows in layout) == 1884


def test_sizing_rule_small_k():
    option = QuantOption.parse("6:0.05@32 3:0.2@64 2:0.75@64")
    assert option.group_layout(96) == [(6, 32), (3, 64)]  # 2-bit gets no rows: earlier groups cover K
    assert option.group_layout(160) == [(6, 32), (3, 64), (2, 64)]
    assert QuantOption.parse("4:1@128").group_layout(320) == [(4, 128), (4, 128), (4, 64)]


def test_total_bits_formula():
    option = QuantOption.parse("4:1@128")
    k, n = 256, 64
    g = 2
    expected = k * n * 4 + g * 16 + g * 32 + g * n * 4 + k * 32
    assert option.total_bits(k, n) == expected
    assert option.total_bits(k, n, bias=True) == expected + 16 * n


def test_parse_print_and_json_roundtrip():
    text = "8:0.05@32 4:0.1@128 3:0.85@128"
    option = QuantOption.parse(text)
    assert option.bits == (8, 4, 3) and option.group_size == (32, 128, 128)
    assert str(option) == text and QuantOption.parse(str(option)) == option
    js = option.to_json()
    assert js == {"group_size": {"8": 32, "4": 128, "3": 128}, "bits": [8, 4, 3], "bits_prop": [0.05, 0.1, 0.85],
                  "scale_bits": 4}
    assert QuantOption.from_json(js) == option


@pytest.mark.parametrize("bad", ["7:1@32", "3:0.5@64 4:0.5@64", "4:0.5@64 3:0.4@64", "4:1@48", "4:1", "x", "",
                                 "4:0@32 3:1@32"])
def test_parse_rejects_invalid_options(bad):
    with pytest.raises(ValueError):
        QuantOption.parse(bad)


def test_group_layout_rejects_k_not_multiple_of_32():
    with pytest.raises(ValueError):
        QuantOption.parse("4:1@128").group_layout(100)
