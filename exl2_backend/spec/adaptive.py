"""How many tokens to draft (k): fixed, or chosen from the running acceptance rate and the step costs.

Model: each drafted token is accepted with probability alpha, independently, until the first rejection, so a
step that drafts k tokens yields E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (accepted drafts + the one
the target adds). Relative to a plain decode step it costs C(k) = 1 + k * (draft_cost + verify_cost):
draft_cost is one draft-model step (0 for n-gram drafting), verify_cost the extra price of one more query
row in the target's verify forward. The adaptive controller picks the k in [0, k_max] that maximizes
E(k) / C(k). alpha is an exponentially decayed estimate: a step that drafted k and had a accepted adds a
successes and (a < k) failures. At k = 0 nothing is learned, so every `probe_every` steps it drafts 1.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_VERIFY_COST = 0.04  # per extra verify row, relative to a decode step (issue target: k=4 costs <= 1.15x)


@dataclass
class StepCosts:
    """Costs relative to one plain decode step of the target, shared by every sequence's controller."""

    draft: float = 0.0
    verify: float = DEFAULT_VERIFY_COST


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step yields when each of k drafts is accepted with probability alpha (until the first miss)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class KController:
    """k for one sequence. adaptive=False keeps k fixed; otherwise k follows the acceptance estimate."""

    def __init__(self, k: int, *, adaptive: bool = False, k_max: int | None = None, costs: StepCosts | None = None,
                 prior_alpha: float = 0.6, prior_weight: float = 2.0, decay: float = 0.9, probe_every: int = 8):
        self.adaptive = adaptive
        self.k_max = max(k_max if k_max is not None else k, 1)
        self.k = min(k, self.k_max)
        self.costs = costs or StepCosts()
        self.decay = decay
        self.probe_every = probe_every
        self._succ = prior_alpha * prior_weight  # decayed counts of accepted drafts
        self._trials = prior_weight  # ... and of accepted drafts + rejections
        self._idle = 0  # steps without drafting while k == 0

    @property
    def alpha(self) -> float:
        return self._succ / self._trials if self._trials > 0 else 0.0

    def next_k(self) -> int:
        """How many tokens to draft this step."""
        if self.k == 0 and self.adaptive:
            return 1 if self._idle >= self.probe_every else 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        """Record a verify step: `proposed` real drafts, the first `accepted` of them accepted."""
        if not self.adaptive:
            return
        if proposed <= 0:
            self._idle += 1
            return
        self._idle = 0
        missed = 1 if accepted < proposed else 0
        self._succ = self.decay * self._succ + accepted
        self._trials = self.decay * self._trials + accepted + missed
        self.k = self.best_k(self.alpha, self.costs, self.k_max)

    @staticmethod
    def best_k(alpha: float, costs: StepCosts, k_max: int) -> int:
        """argmax over k in [0, k_max] of expected_tokens / relative cost (the smallest k on ties)."""
        per_token = max(costs.draft, 0.0) + max(costs.verify, 0.0)
        best, best_rate = 0, 1.0
        for k in range(1, k_max + 1):
            rate = expected_tokens(alpha, k) / (1.0 + k * per_token)
            if rate > best_rate + 1e-9:
                best, best_rate = k, rate
        return best
