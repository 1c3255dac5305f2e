"""SamplingParams validation and the reference sampler (penalties, filters, exponential race)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from exl2_backend.errors import SamplingParamsError
from exl2_backend.ops import reference
from exl2_backend.sampling import SamplingParams
from tests.helpers.tolerances import assert_close, assert_exact

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


# --- params ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
        ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01), ("presence_penalty", 3.0), ("seed", -1), ("seed", 1.5), ("seed", "7"),
        ("temperature", "hot"), ("top_k", True),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_params_defaults_and_helpers():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.0, None)
    assert not p.is_greedy
    assert SamplingParams.greedy().is_greedy and SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=1, seed=2**64 - 1).temperature == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5
    assert SamplingParams(top_p=0.5) == SamplingParams(top_p=0.5)


# --- penalties -------------------------------------------------------------------------------------------


def test_penalties_formulas():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    prompt = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    output = torch.tensor([[0, 0, 3, 1, 0], [0, 2, 0, 0, 0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(frequency_penalty=-1.0),
    ]
    got = reference.apply_penalties(logits, prompt, output, params)
    want = torch.tensor([
        [2.0 / 2, -1.0 * 2, 3.0 / 2 - 0.5 * 3 - 0.25, 0.5 / 2 - 0.5 - 0.25, -2.0],
        [1.0, 1.0 + 2.0, 1.0, 1.0, 1.0],
    ])
    assert_close(got, want)
    assert_exact(logits, torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0], [1.0] * 5]))  # input untouched
    neutral = reference.apply_penalties(logits, prompt, output, [SamplingParams()] * 2)
    assert_exact(neutral, logits)


# --- deterministic paths ---------------------------------------------------------------------------------


def test_greedy_is_argmax_with_lowest_id_ties():
    logits = torch.randn(6, 100)
    logits[0, 7] = logits[0, 42] = 50.0  # tie -> 7
    params = [SamplingParams.greedy()] * 6
    u = torch.rand(6, 100, generator=torch.Generator().manual_seed(1)) + 1e-7
    tokens = reference.sample_tokens(logits, params, u)
    assert tokens.dtype == torch.int64
    assert_exact(tokens, torch.argmax(logits, -1))
    assert tokens[0].item() == 7
    probs = reference.sampling_probs(logits, params)
    assert_exact(probs.sum(-1), torch.ones(6))
    assert (probs.max(-1).values == 1).all()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(8, 64)
    gens = [reference.make_generator(i) for i in range(8)]
    u = reference.make_uniforms(gens, 64)
    want = torch.argmax(logits, -1)
    assert_exact(reference.sample_tokens(logits, [SamplingParams(top_k=1)] * 8, u), want)
    assert_exact(reference.sample_tokens(logits, [SamplingParams(top_p=1e-6)] * 8, u), want)
    assert_exact(reference.sample_tokens(logits, [SamplingParams(min_p=1.0)] * 8, u), want)  # unique max


def test_temperature_to_zero_limit():
    logits = torch.randn(4, 50)
    gens = [reference.make_generator(10 + i) for i in range(4)]
    for _ in range(20):
        u = reference.make_uniforms(gens, 50)
        got = reference.sample_tokens(logits, [SamplingParams(temperature=1e-3)] * 4, u)
        assert_exact(got, torch.argmax(logits, -1))


@pytest.mark.parametrize("fields", [
    {"temperature": 1e-38}, {"temperature": 1e-40}, {"top_p": 1e-50}, {"top_p": 1e-50, "temperature": 0.5},
    {"repetition_penalty": 1e-50, "temperature": 0.7}, {"repetition_penalty": 1e300, "temperature": 0.7},
])
def test_extreme_valid_values_sample_like_their_limit(fields):
    """Valid values at the edge of fp32 (a temperature of 1e-40 is inf logits in fp32, a top_p of 1e-50 is 0):
    they once gave NaN rows, from which the sampler drew token 0 every step, silently. They now act as the nearest
    values fp32 carries: finite distributions, and the argmax where the limit is greedy."""
    logits = torch.randn(6, 80) * 8
    counts = torch.zeros(6, 80, dtype=torch.long)
    counts[:, ::3] = 1  # tokens seen in the prompt: the repetition penalty applies to them
    params = [SamplingParams(**fields)] * 6
    pen = reference.apply_penalties(logits, counts, torch.zeros_like(counts), params)
    probs = reference.sampling_probs(pen, params)
    assert torch.isfinite(pen).all() and torch.isfinite(probs).all()
    assert_close(probs.sum(-1), torch.ones(6))  # fp32 tolerance
    u = reference.make_uniforms([reference.make_generator(i) for i in range(6)], 80)
    got = reference.sample_tokens(pen, params, u)
    if "repetition_penalty" not in fields:  # temperature to 0 or top_p under the top token's mass: greedy
        assert_exact(got, torch.argmax(logits, -1))
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams(temperature=1e-5).is_greedy


def test_filters_on_probabilities():
    probs8 = torch.softmax(LOGITS8, -1)
    # top-k: the 3 best, renormalized
    p = reference.sampling_probs(LOGITS8[None], [SamplingParams(top_k=3)])[0]
    assert_close(p[:3], probs8[:3] / probs8[:3].sum())
    assert (p[3:] == 0).all()
    # top-p: smallest prefix reaching the mass
    cum = torch.cumsum(probs8, 0)
    p = reference.sampling_probs(LOGITS8[None], [SamplingParams(top_p=float(cum[2]) - 1e-4)])[0]
    assert (p[:3] > 0).all() and (p[3:] == 0).all()
    # min-p: drop p < min_p * p_max
    p = reference.sampling_probs(LOGITS8[None], [SamplingParams(min_p=0.2)])[0]
    keep = probs8 >= 0.2 * probs8[0]
    assert_close(p[keep], probs8[keep] / probs8[keep].sum())
    assert (p[~keep] == 0).all()
    # temperature sharpens
    p = reference.sampling_probs(LOGITS8[None], [SamplingParams(temperature=0.5)])[0]
    assert_close(p, torch.softmax(LOGITS8 / 0.5, -1))


def test_seeded_generators_reproduce():
    logits = torch.randn(3, 1000)
    params = [SamplingParams(seed=s) for s in (1, 2, 3)]

    def run(seeds, steps=10):
        gens = [reference.make_generator(s) for s in seeds]
        return torch.stack([reference.sample_tokens(logits, params, reference.make_uniforms(gens, 1000))
                            for _ in range(steps)])

    a, b, c = run((1, 2, 3)), run((1, 2, 3)), run((4, 5, 6))
    assert_exact(a, b)
    assert not torch.equal(a, c)
    u = reference.make_uniforms([reference.make_generator(0)], 1000)
    assert u.min() > 0 and u.max() <= 1


# --- statistics ------------------------------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert (counts[~support] == 0).all(), "sampled a token with probability 0"
    n = counts.sum().item()
    expected = probs[support].double() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=1.7),
        SamplingParams(top_k=4),
        SamplingParams(top_p=0.8),
        SamplingParams(min_p=0.1, temperature=0.8),
        SamplingParams(top_k=6, top_p=0.9, min_p=0.05),
    ],
    ids=["plain", "temp", "top_k", "top_p", "min_p", "all"],
)
def test_sampling_frequencies_match_distribution(params):
    n = 20000
    logits = LOGITS8.expand(n, 8).contiguous()
    u = 1.0 - torch.rand(n, 8, generator=torch.Generator().manual_seed(1234))  # (0, 1]
    tokens = reference.sample_tokens(logits, [params] * n, u)
    counts = torch.bincount(tokens, minlength=8)
    probs = reference.sampling_probs(LOGITS8[None], [params])[0]
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)
    stat, df = chi_square(counts, probs)
    assert df >= 1
    assert stat < CHI2_CRIT_001[df], f"chi2 {stat:.1f} (df {df}) counts {counts.tolist()} probs {probs.tolist()}"


def test_batch_rows_use_their_own_params():
    logits = torch.stack([LOGITS8, LOGITS8.flip(0)])
    params = [SamplingParams(top_k=2), SamplingParams.greedy()]
    probs = reference.sampling_probs(logits, params)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    assert probs[1, 7] == 1.0
    assert reference.sample_tokens(logits, params).tolist()[1] == 7  # uniforms=None draws from torch's RNG


def test_race_with_u_equal_one():
    # u = 1 gives -log(u) = -0.0; the race floors it at 2^-25 instead of dividing by zero
    logits = torch.tensor([[5.0, 0.0, -30.0, 1.0]])
    probs = reference.sampling_probs(logits, [SamplingParams()])[0]
    u = torch.full((1, 4), 0.5)
    u[0, 3] = 1.0  # a plausible token with u = 1 wins
    assert reference.sample_tokens(logits, [SamplingParams()], u).item() == 3
    u = torch.full((1, 4), 0.5)
    u[0, 2] = 1.0  # p ~ 1e-15: negligible even against the floor
    assert probs[2] < 1e-12
    assert reference.sample_tokens(logits, [SamplingParams()], u).item() == 0
    assert -torch.log(torch.tensor(1.0 - 2.0**-24)).item() > 2.0**-25  # the floor only touches u = 1


def test_greedy_tokens_dispatch_on_cpu():
    """ops.greedy_tokens (the engine's greedy sampling) on CPU tensors is the reference: torch.argmax, ties to the
    lowest id, -1 (NAN_ROW) for a row holding a NaN, fp16 logits compared in fp32."""
    from exl2_backend import ops
    from exl2_backend.ops.reference_sampling import NAN_ROW

    logits = torch.randn(4, 1000)
    logits[0, 7] = logits[0, 900] = 50.0
    logits[1, 3] = float("nan")
    logits[2, :] = -float("inf")
    got = ops.greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert got.tolist()[:3] == [7, NAN_ROW, 0]
    want = torch.argmax(logits, -1)
    want[1] = NAN_ROW
    assert_exact(got, want)
    half = logits.half()
    assert_exact(ops.greedy_tokens(half), torch.where(torch.isnan(half).any(-1), NAN_ROW,
                                                      torch.argmax(half.float(), -1)))
    logits[3, 5] = float("inf")  # an fp16 overflow faults the row too; -inf (row 2) is a legitimate masked token
    assert ops.greedy_tokens(logits).tolist()[2:] == [0, NAN_ROW]


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.2, top_k=20, top_p=0.9, min_p=0.05)],
                         ids=["greedy", "temperature", "filtered"])
@pytest.mark.parametrize("fault", [float("nan"), float("inf")], ids=["nan", "posinf"])
def test_a_faulty_row_samples_nan_row(params, fault):
    """Whatever the sampling settings, a row with one NaN or +inf logit gives NAN_ROW (the engine fails that
    sequence; a +inf made the softmax NaN and the race quietly gave token 0); the other rows sample as they would
    alone."""
    from exl2_backend.ops.reference_sampling import NAN_ROW

    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(4))
    u = 1.0 - torch.rand(3, 700, generator=torch.Generator().manual_seed(5))
    clean = reference.sample_tokens(logits, [params] * 3, u)
    logits[1, 123] = fault
    got = reference.sample_tokens(logits, [params] * 3, u)
    assert got.tolist() == [clean[0].item(), NAN_ROW, clean[2].item()]
