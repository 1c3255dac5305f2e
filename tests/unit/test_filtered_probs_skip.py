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


def _full_sort_probs(logits, params):
    """filtered_probs with the sort over the whole vocabulary (no bound): the computation before the bound."""
    pt = sampling_param_tensors(params, logits.shape[1], "cpu")
    return filtered_probs(logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"])


@pytest.mark.parametrize("names", [("top_k",), ("top_k", "all"), ("all", "greedy_top_p"), ("top_k", "greedy_top_p")])
def test_the_sort_stops_at_the_largest_top_k(names):
    """When every sampled row has a top-k below V, the reference sorts only its first ranks on the CPU
    (descending_sort's bound): the same bits as the full sort, with ties at and across the bound going to the lower
    id."""
    from exl2_backend.ops.reference_sampling import sampling_probs, top_k_bound

    params = [ROWS[n] for n in names]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(11)) * 2
    logits[:, 40:80] = logits[:, 40:41]  # 40 equal logits that straddle rank 20 and rank 50
    logits[:, 90:95] = 8.0  # equal top tokens
    bound = top_k_bound(params, V)
    assert bound == max(p.top_k for p in params if p.temperature != 0)
    full = _full_sort_probs(logits, params)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    assert torch.equal(sampling_probs(logits, params)[sampled], full[sampled])


def test_no_bound_unless_every_sampled_row_has_a_top_k():
    from exl2_backend.ops.reference_sampling import top_k_bound

    assert top_k_bound([ROWS["top_k"], ROWS["temp"]], V) is None  # the temperature row keeps every token
    assert top_k_bound([ROWS["top_k"], ROWS["greedy_top_p"]], V) == 20  # greedy rows do not count
    assert top_k_bound([SamplingParams(temperature=1.0, top_k=V)], V) is None
    assert top_k_bound([ROWS["greedy_top_p"]], V) is None


@pytest.mark.parametrize("bound", [1, 7, 64, V - 1])
def test_descending_sort_prefix_is_the_stable_sort(bound):
    from exl2_backend.ops.reference_sampling import descending_sort

    probs = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(bound)), -1)
    probs[:, 10:30] = probs[:, 10:11]  # ties
    probs[1, :] = 1.0 / V  # a row of one value: ids in order
    probs[2, 200:] = 0.0  # zeros
    sp, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    bsp, bidx = descending_sort(probs, bound)
    assert torch.equal(bidx, idx[:, :bound])
    assert torch.equal(bsp[:, :bound], sp[:, :bound]) and not bsp[:, bound:].any()


def test_which_rows_the_top_k_kernel_takes(monkeypatch):
    """ops/cuda_sampling_top_k.py takes, per row, sampled rows with an active top-k of at most 64, and sampled rows
    without a top-k that use top-p or min-p, on vocabularies up to 131,072 tokens; everything else (and every row
    with EXL2_BACKEND_FUSED_TOP_K=0) goes the torch way, temperature-only rows the plain sampler kernel."""
    from exl2_backend.ops import cuda_sampling_top_k
    from exl2_backend.ops.cuda_sampling_top_k import TOP_K_KERNEL_MAX_VOCAB, top_k_kernel_rows

    monkeypatch.setattr(cuda_sampling_top_k, "FUSED_TOP_K", True)
    rows = [ROWS["top_k"], ROWS["all"], ROWS["top_p"], ROWS["temp"], ROWS["greedy_top_p"],
            SamplingParams(temperature=1.0, top_k=65), SamplingParams(temperature=1.0, top_k=V),
            SamplingParams(temperature=1.0, top_k=V, top_p=0.9), SamplingParams(temperature=0.7, min_p=0.1)]
    assert top_k_kernel_rows(rows, V) == [True, True, True, False, False, False, False, True, True]
    assert not any(top_k_kernel_rows(rows, TOP_K_KERNEL_MAX_VOCAB + 1))
    monkeypatch.setattr(cuda_sampling_top_k, "FUSED_TOP_K", False)
    assert not any(top_k_kernel_rows(rows, V))
