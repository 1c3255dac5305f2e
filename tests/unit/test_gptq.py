"""GPTQ with mixed bits (format doc d.5) and the option optimizer."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.format.layout import ATTENTION_OPTIONS, MLP_OPTIONS, QuantOption
from exl2_backend.ops.reference import exl2_dequant
from exl2_backend.quant.gptq import HessianAccumulator, PreparedHessian, act_order, gptq_quantize
from exl2_backend.quant.optimize import BudgetError, achieved_bpw, optimize, total_error
from exl2_backend.quant.rtn import quantize_rtn


def _problem(k=256, n=72, tokens=1024, seed=0):
    """Correlated inputs with uneven feature scales (what makes act-order and error feedback pay off)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(tokens, k, generator=g) @ mix) * (0.2 + 3 * torch.rand(k, generator=g))  # [T, K]
    w = torch.randn(n, k, generator=g) / k**0.5  # [N, K]
    acc = HessianAccumulator(k)
    acc.add(x)
    return x, w, acc.result()


def _out_err(x, w, w_hat):
    return float((x @ w_hat.t() - x @ w.t()).norm() / (x @ w.t()).norm())


@pytest.mark.parametrize("opt", ["4:1@128", "3:0.1@64 2:0.9@64", "8:0.05@32 4:0.1@128 3:0.85@128", "6:0.1@32 5:0.9@32"])
def test_gptq_beats_rtn_and_dequant_is_exact(opt):
    x, w, h = _problem()
    option = QuantOption.parse(opt)
    res = gptq_quantize("t", w, h, option)
    assert torch.equal(exl2_dequant(res.qtensor), res.dequant)  # bit-exact with the runtime's decoder
    rtn = quantize_rtn("t", w, option)
    e_gptq = _out_err(x, w, res.weight())
    e_rtn = _out_err(x, w, exl2_dequant(rtn)[:, : w.shape[0]].float().t())
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)


def test_invperm_is_act_order_and_every_width_round_trips():
    _, w, h = _problem(k=192, n=40, tokens=512, seed=1)  # N not a multiple of 32: padded columns
    for bits in (2, 3, 4, 5, 6, 8):
        res = gptq_quantize("t", w, h, QuantOption.parse(f"{bits}:1@64"))
        inv = res.qtensor.q_invperm.long()
        assert torch.equal(torch.sort(inv).values, torch.arange(192))
        perm = torch.argsort(inv)
        assert torch.equal(perm, act_order(h))
        d = torch.diag(h)[perm]
        assert bool((d[:-1] >= d[1:]).all())  # stored rows by descending Hessian diagonal
        assert [g.bits for g in res.qtensor.groups] == [bits] * 3
        assert torch.equal(exl2_dequant(res.qtensor), res.dequant)
        assert not res.dequant[:, 40:].any()  # padding columns decode to zero


def test_all_table_options_on_odd_shapes_and_degenerate_inputs():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(33, 160, generator=g) * 0.05
    w[:, 5] = 0  # an all-zero input column
    x = torch.randn(300, 160, generator=g)
    x[:, 7] = 0  # a dead input feature (zero Hessian diagonal)
    acc = HessianAccumulator(160)
    acc.add(x)
    prep = PreparedHessian.from_hessian(acc.result(), 160)  # one factorization shared by every option
    seen = set()
    for row in ATTENTION_OPTIONS + MLP_OPTIONS:
        for opt in row:
            if str(opt) in seen:
                continue
            seen.add(str(opt))
            res = gptq_quantize("t", w, prep, opt)
            assert torch.equal(exl2_dequant(res.qtensor), res.dequant), str(opt)
    assert torch.equal(exl2_dequant(gptq_quantize("t", w, None, QuantOption.parse("4:1@32")).qtensor),
                       gptq_quantize("t", w, None, QuantOption.parse("4:1@32")).dequant)


def _slots(n_slots=12, seed=0):
    """Synthetic measurements: error falls roughly geometrically with bits, with noise."""
    g = torch.Generator().manual_seed(seed)
    slots = []
    for _ in range(n_slots):
        bits = sorted((torch.rand(8, generator=g) * 6 + 2).tolist())
        scale = float(torch.rand(1, generator=g)) + 0.5
        slots.append([{"total_bits": int(b * 10000), "accuracy": 1 - scale * 2 ** (-b) * (1 + 0.3 * float(z))}
                      for b, z in zip(bits, torch.rand(8, generator=g))])
    return slots


def test_optimizer_meets_budget_is_monotone_and_deterministic():
    slots = _slots()
    numel = 12 * 10000
    prev = None
    for target in [2.5 + 0.25 * i for i in range(21)]:
        lo = sum(min(r["total_bits"] for r in s) for s in slots) / numel
        hi = sum(max(r["total_bits"] for r in s) for s in slots) / numel
        if not lo <= target <= hi:
            with pytest.raises(BudgetError):
                optimize(slots, numel, target)
            continue
        choice = optimize(slots, numel, target)
        assert choice == optimize(slots, numel, target)
        bpw = achieved_bpw(slots, choice, numel)
        assert bpw <= target + 1e-12
        assert bpw >= target - 0.3  # the option grid here is coarse (8 options per slot)
        err = total_error(slots, choice)
        if prev is not None:
            assert err <= prev + 1e-12
        prev = err


def test_optimizer_reaches_target_closely_on_real_tables():
    # real option costs for a 576/1536 model (SmolLM2-135M shapes), fake accuracies falling with bits
    k, i = 576, 1536
    shapes_a = [(k, k), (k, 192), (k, 192), (k, k)]
    shapes_m = [(k, i), (k, i), (i, k)]
    slots = []
    for layer in range(30):
        for table, shapes in ((ATTENTION_OPTIONS, shapes_a), (MLP_OPTIONS, shapes_m)):
            numel = sum(a * b for a, b in shapes)
            recs = []
            for row in table:
                tb = sum(o.total_bits(a, b) for o, (a, b) in zip(row, shapes))
                recs.append({"total_bits": tb, "accuracy": 1 - 2 ** (-tb / numel) * (1 + 0.01 * layer)})
            slots.append(recs)
    numel = 30 * (sum(a * b for a, b in shapes_a) + sum(a * b for a, b in shapes_m))
    for target in (3.0, 4.0, 4.65, 5.5):
        bpw = achieved_bpw(slots, optimize(slots, numel, target), numel)
        assert target - 0.02 <= bpw <= target, (target, bpw)


def test_measurement_error_is_relative_per_token():
    """A token with massive activations must not hide the other tokens' error (measure.py's docstring)."""
    from exl2_backend.quant.measure import TokenErrors

    ref = torch.ones(2, 4, 8)  # [rows, T, H]
    ref[0, 0] *= 1000.0  # one massive token
    acc = TokenErrors()
    for r in range(2):  # added chunk by chunk, as the measurement does
        acc.add(ref[r : r + 1] + 0.1, ref[r : r + 1])
    assert acc.mean() == pytest.approx((7 * 0.1 + 1e-4) / 8, rel=1e-4)
    row_wise = float(((0.1 * torch.ones(8, 4 * 8)).norm(dim=1)[:1] / ref[0].flatten().norm()).item())
    assert row_wise < 0.001  # what a per-row ratio would have reported for row 0
