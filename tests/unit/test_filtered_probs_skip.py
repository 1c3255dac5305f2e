"""ops.cuda_layers.filtered_probs skips the filters no sampled row of the batch uses (active_filters): the same
bits as running them all, for batches mixing top-k, top-p, min-p, plain temperature and greedy rows. Pure torch
ops, so this runs on the CPU; the GPU sampler tests compare the kernel path with the reference."""

from __future__ import annotations

import pytest
import torch

from exl2_backend.ops.cuda_layers import filtered_probs, sampling_param_tensors
from exl2_backend.ops.reference_sampling import active_filters
from exl2_backend.sampling import SamplingParams

V = 300
ROWS = {
    "temp": SamplingParams(temperature=0.8),
    "greedy_top_p": SamplingParams(temperature=0.0, top_p=0.5),  # a greedy row's filter is never active
    "top_k": SamplingParams(temperature=1.0, top_k=20),
    "top_p": SamplingParams(temperature=0.7, top_p=0.9),
    "min_p": SamplingParams(temperature=1.2, min_p=0.05),
    "all": SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02),
}


@pytest.mark.parametrize("names", [("temp", "top_p"), ("top_k", "greedy_top_p"), ("min_p", "temp", "top_k"),
                                   ("all",), ("top_p", "min_p", "greedy_top_p", "temp")])
def test_skipped_filters_leave_the_bits(names):
    params = [ROWS[n] for n in names]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(len(names))) * 3
    pt = sampling_param_tensors(params, V, "cpu")
    args = (logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"])
    active = active_filters(params, V)
    assert active < frozenset(("top_k", "top_p", "min_p")) or names == ("all",)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]  # greedy rows' probs: the kernel ignores them
    assert torch.equal(filtered_probs(*args, active)[sampled], filtered_probs(*args)[sampled])


def test_active_filters_reads_sampled_rows_only():
    assert active_filters([ROWS["greedy_top_p"], ROWS["temp"]], V) == frozenset()
    assert active_filters([ROWS["top_k"], ROWS["min_p"]], V) == {"top_k", "min_p"}
    assert active_filters([SamplingParams(temperature=1.0, top_k=V)], V) == frozenset()  # k >= V keeps all


@pytest.mark.parametrize("names", [("temp",), ("temp", "greedy_top_p"), ("top_p", "temp"), ("all", "min_p")])
def test_the_reference_skips_them_too(names):
    """reference_sampling.sampling_probs skips the same filters (and the sort when none is on): its sampled rows
    equal the all-filters computation bit for bit."""
    from exl2_backend.ops.reference_sampling import sampling_probs

    params = [ROWS[n] for n in names]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(7)) * 2
    pt = sampling_param_tensors(params, V, "cpu")
    full = filtered_probs(logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"])
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    assert torch.equal(sampling_probs(logits, params)[sampled], full[sampled])
