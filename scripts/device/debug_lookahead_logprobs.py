"""Debug for the flaky lookahead logprobs GPU test (tests/engine/test_sampled_lookahead_tiny.py,
test_logprobs_of_sampled_and_greedy_rows_in_the_lookahead): the same sampled + greedy batch decoded three times
eagerly and three times through the lookahead, alternating. Prints whether each mode repeats itself bit for bit
(determinism) and how far the modes' logprobs are apart (largest |difference| per sequence)."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")


def _flat(lp: dict) -> dict[str, list[float]]:
    return {sid: [x.logprob for x in entries] for sid, entries in lp.items()}


def _max_diff(a: dict, b: dict) -> dict[str, float]:
    return {sid: max((abs(x - y) for x, y in zip(a[sid], b[sid])), default=0.0) for sid in a}


def main() -> int:
    from scripts.device.debug_nucleus_lookahead import logprobs_case
    from tests.helpers.greedy_runs import run_batch

    eng, prompts, params = logprobs_case()
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(3):
        for mode in (False, True):
            lp: dict = {}
            tokens = run_batch(eng, prompts, params, lookahead=mode, logprobs=lp)
            torch.cuda.synchronize()
            runs[mode].append((tokens, _flat(lp)))
    for mode, rs in runs.items():
        same_tokens = all(r[0] == rs[0][0] for r in rs)
        same_lp = all(r[1] == rs[0][1] for r in rs)
        print(f"lookahead={mode}: repeats identical tokens {same_tokens}, logprobs {same_lp}; "
              f"max |diff| to run 0: {[_max_diff(rs[0][1], r[1]) for r in rs[1:]]}")
    for i in range(3):
        (t0, l0), (t1, l1) = runs[False][i], runs[True][i]
        print(f"pair {i}: tokens equal {t0 == t1}, logprobs equal {l0 == l1}, max |diff| {_max_diff(l0, l1)}")
        for sid in l0:
            j = next((j for j, (a, b) in enumerate(zip(l0[sid], l1[sid])) if a != b), None)
            if j is not None:
                print(f"  first difference {sid}[{j}]: {l0[sid][j]!r} vs {l1[sid][j]!r}")
    eng.assert_no_leaks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
