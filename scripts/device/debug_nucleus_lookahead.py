"""Debug for AW2's one failure (tests/engine/test_sampled_lookahead_tiny.py logprobs test): record every
sample_tokens call of eager and lookahead decoding of the same sampled (top_p 0.95) + greedy batch, and for each
call compare the kernel's token with the reference's and with the kernel run again on the same inputs."""

from __future__ import annotations

import sys
import tempfile

import torch

sys.path.insert(0, ".")


def logprobs_case():
    """(engine, prompts, params) of the test's batch: a tiny random GPU engine, a sampled (top_p 0.95) sequence
    with 3 logprobs and a greedy one with its token's logprob."""
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams
    from tests.helpers.gpu_engine import small_gpu_engine

    vocab = 40_000
    eng = small_gpu_engine(tempfile.mkdtemp() + "/m", vocab, 11, max_seq_len=512, max_batch_size=4)
    g = torch.Generator().manual_seed(7)
    prompts = {sid: torch.randint(3, vocab - 1000, (n,), generator=g).tolist() for sid, n in {"k": 9, "l": 13}.items()}
    params = {"k": GenerationParams(sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=21), max_new_tokens=20,
                                    ignore_eos=True, logprobs=3),
              "l": GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=16, ignore_eos=True,
                                    logprobs=0)}
    return eng, prompts, params


def main() -> int:
    from exl2_backend.ops import reference
    from exl2_backend.runtime import sampler
    from tests.helpers.greedy_runs import run_batch

    eng, prompts, params = logprobs_case()
    calls: list = []
    inner = sampler.sample_tokens

    def recording(logits, ps, uniforms):
        out = inner(logits, ps, uniforms)
        calls.append((logits.clone(), list(ps), uniforms.clone(), out.clone()))
        return out

    sampler.sample_tokens = recording
    runs = {}
    for mode in (False, True):
        calls.clear()
        lp: dict = {}
        runs[mode] = (run_batch(eng, prompts, params, lookahead=mode, logprobs=lp), list(calls), lp)
        torch.cuda.synchronize()
    for mode, (tokens, cs, lp) in runs.items():
        print(f"lookahead={mode}: k {tokens['k']}")
        bad = 0
        for i, (lg, ps, u, out) in enumerate(cs):
            ref = reference.sample_tokens(lg, ps, u)
            again = inner(lg, ps, u)
            x = lg.float() / ps[0].temperature
            p = torch.softmax(x, -1)
            sp = torch.sort(p, descending=True).values
            kept = int((torch.cumsum(sp, -1) - sp < ps[0].top_p).sum())
            if not (torch.equal(out, ref) and torch.equal(out, again)):
                bad += 1
                print(f"  call {i}: kernel {out.tolist()} reference {ref.tolist()} again {again.tolist()} "
                      f"shape {tuple(lg.shape)} stride {lg.stride()} kept~{kept} logit std {lg.std().item():.3f} "
                      f"max {lg.max().item():.2f}")
        print(f"  {len(cs)} calls, {bad} differ")
    (t0, _, l0), (t1, _, l1) = runs[False], runs[True]
    print("tokens equal:", t0 == t1, "logprobs equal:", l0 == l1)
    if l0 != l1:
        for sid in l0:
            for j, (a, b) in enumerate(zip(l0[sid], l1[sid])):
                if a != b:
                    print(f"  first logprob difference {sid}[{j}]: {a} vs {b}")
                    break
    return 0


if __name__ == "__main__":
    sys.exit(main())
