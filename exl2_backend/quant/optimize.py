"""Choose one measured option per (layer, block) under a bit budget (format doc c, d.4).

Instead of ExLlamaV2's simulated annealing we solve the multiple-choice knapsack exactly on a fixed grid of
bit units (costs rounded *up*, so the result always meets the real budget), then greedily spend what the
rounding left over on the upgrades with the best error reduction per bit. Deterministic; the grid does not
depend on the budget, so a larger budget never yields a higher DP error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from exl2_backend.errors import Exl2Error

GRID = 20000  # bit units over the largest possible total


class BudgetError(Exl2Error, ValueError):
    """The target bpw cannot be met by (or exceeds) what the option grid allows."""


def bpw_range(slots: Sequence[Sequence[dict]], numel: int) -> tuple[float, float]:
    lo = sum(min(r["total_bits"] for r in s) for s in slots)
    hi = sum(max(r["total_bits"] for r in s) for s in slots)
    return lo / numel, hi / numel


def optimize(slots: Sequence[Sequence[dict]], numel: int, target_bpw: float, norm: float = 1.0) -> list[int]:
    """slots: per (layer, block) a list of records with "accuracy" and "total_bits". Returns one index per
    slot into its list, minimizing sum(error^norm) with sum(total_bits) <= int(target_bpw * numel)."""
    budget = int(target_bpw * numel)
    lo, hi = bpw_range(slots, numel)
    if target_bpw < lo - 1e-9:
        raise BudgetError(f"target {target_bpw} bpw is below the cheapest measured options ({lo:.3f} bpw)")
    if target_bpw > hi + 1e-9:
        raise BudgetError(f"target {target_bpw} bpw exceeds the most expensive options ({hi:.3f} bpw)")
    bits = [np.array([r["total_bits"] for r in s], dtype=np.int64) for s in slots]
    err = [np.array([max(1.0 - r["accuracy"], 0.0) ** norm for r in s]) for s in slots]
    choice = _knapsack(bits, err, budget, unit=max(1, -(-sum(int(b.max()) for b in bits) // GRID)))
    return _spend_leftover(choice, bits, err, budget)


def _knapsack(bits: list[np.ndarray], err: list[np.ndarray], budget: int, unit: int) -> list[int]:
    """Exact DP over ceil(bits / unit): best[c] = min error using at most c units."""
    cap = budget // unit
    inf = np.inf
    best = np.zeros(cap + 1)  # zero slots chosen: no error, any capacity
    picks = []
    for b, e in zip(bits, err):
        cost = -(-b // unit)  # ceil: never under-count real bits
        new = np.full(cap + 1, inf)
        arg = np.full(cap + 1, -1, dtype=np.int32)
        for j in np.argsort(e, kind="stable"):  # deterministic tie order
            c = int(cost[j])
            if c > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[c:] = best[: cap + 1 - c] + e[j]
            better = cand < new
            new[better], arg[better] = cand[better], j
        best = new
        picks.append(arg)
    if not np.isfinite(best[cap]):
        # only possible when the rounding up ate the slack; fall back to the cheapest option everywhere
        return [int(np.argmin(b)) for b in bits]
    choice, c = [], cap
    for i in range(len(bits) - 1, -1, -1):
        j = int(picks[i][c])
        choice.append(j)
        c -= int(-(-bits[i][j] // unit))
    return choice[::-1]


def _spend_leftover(choice: list[int], bits: list[np.ndarray], err: list[np.ndarray], budget: int) -> list[int]:
    """Greedy upgrades (lower error, fits the exact budget), best error drop per extra bit first."""
    choice = list(choice)
    used = sum(int(b[c]) for b, c in zip(bits, choice))
    while True:
        best, move = 0.0, None
        for i, (b, e) in enumerate(zip(bits, err)):
            c = choice[i]
            for j in range(len(b)):
                extra = int(b[j] - b[c])
                gain = float(e[c] - e[j])
                if gain <= 0 or used + extra > budget:
                    continue
                score = gain / max(extra, 1)
                if score > best:
                    best, move = score, (i, j, extra)
        if move is None:
            return choice
        i, j, extra = move
        choice[i] = j
        used += extra


def achieved_bpw(slots: Sequence[Sequence[dict]], choice: Sequence[int], numel: int) -> float:
    return sum(s[c]["total_bits"] for s, c in zip(slots, choice)) / numel


def total_error(slots: Sequence[Sequence[dict]], choice: Sequence[int]) -> float:
    return sum(1.0 - s[c]["accuracy"] for s, c in zip(slots, choice))
