"""Chi-square tests (torch only: no scipy in the test dependencies), for the speculative sampling tests."""

from __future__ import annotations

import torch


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def goodness_of_fit(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value of observed counts [V] against a distribution probs [V]; cells with expected count below
    min_expected are pooled into one (so the chi-square approximation holds)."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    assert float(obs[~keep].sum()) == 0, "a token with probability 0 was drawn"
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, max(int(keep.sum()) - 1, 1))


def two_sample(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> float:
    """p-value that two count vectors [V] come from one distribution (2 x V contingency table; sparse
    columns pooled)."""
    a, b = a.double(), b.double()
    total = a + b
    pooled = total / total.sum()
    big = pooled * min(a.sum(), b.sum()) >= min_expected
    ta = torch.cat([a[big], a[~big].sum()[None]])
    tb = torch.cat([b[big], b[~big].sum()[None]])
    cols = (ta + tb) > 0
    ta, tb = ta[cols], tb[cols]
    table = torch.stack([ta, tb])  # [2, C]
    exp = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - exp) ** 2 / exp).sum())
    return chi2_sf(stat, max(int(cols.sum()) - 1, 1))
