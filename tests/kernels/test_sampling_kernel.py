"""GPU sampler (csrc/layers/sampling.cu, ops/cuda_layers.sample_tokens) against reference.sample_tokens.

Tolerance: exact token ids given the same uniforms. Greedy is exact by construction (ties -> lowest id, as
torch.argmax; a row holding a NaN gives -1 in every mode, as the reference's NAN_ROW). Sampled rows can only
differ where two race scores p_i / E_i agree to within a few ulps, because the kernel sums the softmax in a
different order and evaluates exp/log correctly rounded (torch's fp32 exp/log may be 1 ulp off); for random
inputs that happens about once per 10^6 draws, so these tests expect exact equality.
"""

from __future__ import annotations

import pytest
import torch

from exl2_backend.ops import reference
from exl2_backend.sampling import SamplingParams
from tests.helpers.tolerances import assert_exact

pytestmark = pytest.mark.cuda

DEV = "cuda"
VOCABS = [1000, 2048, 2049, 32000, 128256]


def cl():
    from exl2_backend.ops import cuda_layers

    return cuda_layers


def uniforms(b, v, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return 1.0 - torch.rand(b, v, generator=g, device=DEV)


@pytest.fixture(params=["kernel", "torch"])
def filter_path(request, monkeypatch):
    """Filtered rows through the top-k / nucleus kernel (the default) or the torch sort path
    (EXL2_BACKEND_FUSED_TOP_K=0): both must give the reference's tokens."""
    from exl2_backend.ops import cuda_sampling_top_k

    monkeypatch.setattr(cuda_sampling_top_k, "FUSED_TOP_K", request.param == "kernel")
    return request.param


def same_as_reference(logits, params, u, msg=""):
    got = cl().sample_tokens(logits, params, u)
    want = reference.sample_tokens(logits, params, u)
    assert got.device == logits.device and got.dtype == torch.int64
    assert_exact(got, want, msg)
    return got


@pytest.mark.parametrize("v", VOCABS)
def test_greedy(v):
    b = 16
    logits = torch.randn(b, v, device=DEV) * 4
    logits[0, 5] = logits[0, v - 1] = 100.0  # tie across chunks -> lowest id
    logits[1, v - 1] = 100.0  # max in the last, partial chunk
    logits[2, :] = -float("inf")  # all -inf -> id 0, as torch.argmax
    got = same_as_reference(logits, [SamplingParams.greedy()] * b, uniforms(b, v, 1), f"greedy V={v}")
    assert_exact(got, torch.argmax(logits, -1))
    assert got[0].item() == 5 and got[1].item() == v - 1 and got[2].item() == 0


def test_greedy_nan_rows_give_minus_one():
    """A NaN anywhere in a greedy row (first or last chunk, several) gives -1; clean rows beside it their argmax."""
    v = 5000
    logits = torch.randn(4, v, device=DEV)
    logits[0, 3000] = float("nan")
    logits[1, 10] = logits[1, 4000] = float("nan")
    logits[3, v - 1] = float("nan")  # the last, partial chunk
    got = cl().sample_tokens_tensor(logits, uniforms(4, v, 0), torch.zeros(4, device=DEV))
    assert got.tolist() == [-1, -1, torch.argmax(logits[2]).item(), -1]
    assert got.tolist() == reference.greedy_tokens(logits).tolist()


@pytest.mark.parametrize("fault", [float("nan"), float("inf")], ids=["nan", "posinf"])
@pytest.mark.parametrize("v", [1000, 2049, 128256])
def test_faulty_rows_give_minus_one_in_every_mode(v, fault, filter_path):
    """Greedy, temperature-only and filtered (probs) rows in one batch, each mode once with a NaN (or +inf, an
    fp16 overflow) logit and once without, plus a row with -inf logits (masked tokens, legitimate): the faulty rows
    give -1 (the reference's NAN_ROW), the others the reference's tokens."""
    modes = [SamplingParams.greedy(), SamplingParams(temperature=0.9), SamplingParams(temperature=1.1, top_k=40,
                                                                                       top_p=0.8, min_p=0.03)]
    params = modes + modes + [SamplingParams(temperature=0.9)]
    logits = torch.randn(len(params), v, device=DEV) * 2
    for row in range(len(modes)):
        logits[row, (row * 977) % v] = fault
    logits[-1, ::3] = -float("inf")
    got = same_as_reference(logits, params, uniforms(len(params), v, 9), f"faulty rows V={v}")
    assert got.tolist()[: len(modes)] == [-1] * len(modes) and min(got.tolist()[len(modes):]) >= 0
    assert got[-1].item() % 3 != 0


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature(v, temperature):
    b = 32
    logits = torch.randn(b, v, device=DEV) * 3
    same_as_reference(logits, [SamplingParams(temperature=temperature)] * b, uniforms(b, v, 2), f"T={temperature}")


@pytest.mark.parametrize("v", [2049, 32000, 128256])
def test_mixed_batch_with_filters(v, filter_path):
    params = [
        SamplingParams.greedy(),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=40),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=v + 5),  # >= V: off
    ] * 4
    logits = torch.randn(len(params), v, device=DEV) * 3
    for seed in range(3):
        same_as_reference(logits, params, uniforms(len(params), v, 10 + seed), f"mixed seed={seed}")


@pytest.mark.parametrize("v", [2049, 128256])
def test_every_row_with_a_top_k_sorts_only_its_ranks(v, filter_path):
    """Every sampled row has a top-k (top_k_bound is set; descending_sort takes the bound on the CPU only, where
    it is cheaper): the same tokens as the reference on the GPU, with 60 equal logits straddling the bound."""
    params = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
              SamplingParams.greedy(), SamplingParams(temperature=0.7, top_k=1000, min_p=0.01)] * 3
    logits = torch.randn(len(params), v, device=DEV) * 3
    logits[:, 100:160] = 9.0
    for seed in range(3):
        same_as_reference(logits, params, uniforms(len(params), v, 20 + seed), f"top-k bound seed={seed}")


@pytest.fixture
def top_k_kernel(monkeypatch):
    """The top-k / nucleus kernel switched on whatever the environment says (EXL2_BACKEND_FUSED_TOP_K)."""
    from exl2_backend.ops import cuda_sampling_top_k as tk

    monkeypatch.setattr(tk, "FUSED_TOP_K", True)
    return tk


TOP_K_ROWS = [
    SamplingParams(temperature=0.8, top_k=40),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    SamplingParams(temperature=0.7, top_k=64, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=1),
    SamplingParams(temperature=0.9, top_k=2, top_p=0.5),
    SamplingParams.greedy(),
    SamplingParams(temperature=1.0, top_k=64, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=2.5, top_k=64, top_p=0.99),
]


@pytest.mark.parametrize("v", [1000, 2049, 32000, 128256, 131072])
def test_small_top_k_rows_take_one_kernel(v, top_k_kernel):
    """Rows with a top-k of at most 64 (and greedy rows beside them): the top-k kernel, the reference's tokens,
    with 80 equal logits straddling the k boundaries (ranked by id, as the stable sort)."""
    params = TOP_K_ROWS * 4
    assert all(f or p.temperature == 0 for f, p in zip(top_k_kernel.top_k_kernel_rows(params, v), params))
    logits = torch.randn(len(params), v, device=DEV) * 3
    logits[:, 200:280] = 6.0  # ~2 sigma: the tie group spans ranks ~20-100 at V = 1000, the top ranks above
    for seed in range(4):
        same_as_reference(logits, params, uniforms(len(params), v, 30 + seed), f"top-k kernel seed={seed}")


WIDE_ROWS = [
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=2.0, top_p=0.5),
    SamplingParams(temperature=0.6, top_p=0.99, min_p=0.001),
    SamplingParams.greedy(),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9),
]


@pytest.mark.parametrize("v", [1000, 2049, 32000, 128256, 131072])
@pytest.mark.parametrize("shape", ["spread", "peaked"])
def test_rows_without_top_k_take_one_kernel(v, shape, top_k_kernel):
    """Top-p / min-p rows without a top-k: the kernel, the reference's tokens. "spread" rows (logits of std 3) keep
    thousands of tokens at 128k (the histogram path: the boundary bin sorted), "peaked" rows a few dozen (the kept
    tokens among the best 64); 40 equal logits straddle the boundary region of the spread rows."""
    params = WIDE_ROWS * 4
    assert all(f or p.temperature == 0 for f, p in zip(top_k_kernel.top_k_kernel_rows(params, v), params))
    g = torch.Generator(device=DEV).manual_seed(v)
    logits = torch.randn(len(params), v, device=DEV, generator=g) * 3
    if shape == "peaked":  # an LLM-like row: a few dozen plausible tokens far above the rest
        top = torch.randperm(v, device=DEV, generator=g)[:24]
        logits[:, top] += 25.0 + torch.randn(len(params), 24, device=DEV, generator=g)
    else:
        logits[:, 500:540] = 5.5
    for seed in range(4):
        same_as_reference(logits, params, uniforms(len(params), v, 40 + seed), f"{shape} V={v} seed={seed}")


@pytest.mark.parametrize("v", [32000, 128256])
def test_flat_rows_narrow_a_crowded_boundary_bin(v, top_k_kernel):
    """Rows so flat that the top-p boundary's bin of 1/32 nat holds more tokens than the kernel sorts at once
    (logits of std 0.02; all equal, where only ids rank; all equal at a high temperature): the key digits narrow
    it. The reference's tokens."""
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_p=0.3, min_p=0.5),
              SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=3.0, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.99)]
    logits = torch.randn(len(params), v, device=DEV) * 0.02
    logits[1:3] = 0.0
    logits[3] = 1.0
    logits[4] = torch.randn(v, device=DEV) * 0.001
    for seed in range(3):
        same_as_reference(logits, params, uniforms(len(params), v, 50 + seed), f"flat V={v} seed={seed}")


def test_rows_without_top_k_masked_tiny_and_huge_temperatures(top_k_kernel):
    """A row mostly -inf (a grammar's mask), a tiny temperature (x in the thousands), a huge one (a flat row), a
    row -inf but in its last two chunks, and a vocabulary under 64 tokens: the reference's tokens."""
    v = 128256
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1e-3, top_p=0.9),
              SamplingParams(temperature=50.0, top_p=0.6, min_p=0.01), SamplingParams(temperature=0.9, top_p=0.95)]
    logits = torch.randn(len(params), v, device=DEV) * 3
    logits[0, torch.rand(v, device=DEV) < 0.96] = -float("inf")
    logits[3, : v - 3000] = -float("inf")
    for seed in range(3):
        same_as_reference(logits, params, uniforms(len(params), v, 60 + seed), f"masked seed={seed}")
    small = torch.randn(3, 40, device=DEV)
    small_params = [SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.2),
                    SamplingParams(temperature=0.5, top_p=0.95)]
    same_as_reference(small, small_params, uniforms(3, 40, 64), "V=40")


def test_more_rows_than_one_launch_takes(top_k_kernel):
    """72 rows: nine launches of at most 8 rows each (the workspace's bound), the reference's tokens."""
    v, params = 32000, WIDE_ROWS * 9
    logits = torch.randn(len(params), v, device=DEV) * 3
    same_as_reference(logits, params, uniforms(len(params), v, 66), "72 rows")


def test_rows_without_top_k_in_a_cuda_graph(top_k_kernel):
    """The kernel captured (its workspace and tickets from the graph's pool) and replayed on new logits."""
    v, params = 128256, [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, min_p=0.1)]
    logits = torch.randn(2, v, device=DEV) * 3
    u = uniforms(2, v, 70)
    pt = cl().sampling_param_tensors(params, v, DEV)
    args = (pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"])
    top_k_kernel.sample_top_k(logits, u, *args)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = top_k_kernel.sample_top_k(logits, u, *args)
    for seed in range(3):
        logits.copy_(torch.randn_like(logits) * 3)
        u.copy_(uniforms(2, v, 71 + seed))
        g.replay()
        assert_exact(out, reference.sample_tokens(logits, params, u), f"replay {seed}")


def test_top_k_kernel_rows_beside_others(top_k_kernel):
    """A batch mixing the kernel's rows (top-k up to 64, top-p without top-k, greedy) with temperature-only and
    large top-k rows: each way samples its rows, the reference's tokens; the kernel's rows get the tokens they get
    alone (the choice is per row)."""
    v = 32000
    params = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, top_k=100, top_p=0.8),
              SamplingParams.greedy(), SamplingParams(temperature=1.1, top_k=64, min_p=0.05)] * 2
    logits = torch.randn(len(params), v, device=DEV) * 3
    u = uniforms(len(params), v, 41)
    got = same_as_reference(logits, params, u, "split batch")
    mine = [i for i, f in enumerate(top_k_kernel.top_k_kernel_rows(params, v)) if f or params[i].temperature == 0]
    assert len(mine) == 8  # top-k 40, top-p 0.9, greedy, top-k 64 + min-p; twice
    alone = [int(cl().sample_tokens(logits[i:i + 1], [params[i]], u[i:i + 1])[0]) for i in mine]
    assert [got.tolist()[i] for i in mine] == alone


def test_top_k_kernel_faults_switch_and_no_sync(top_k_kernel, monkeypatch):
    tk = top_k_kernel
    v = 5000
    params = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.0, top_k=8, top_p=0.7)] * 3
    logits = torch.randn(len(params), v, device=DEV) * 2
    logits[1, 17] = float("nan")
    logits[4, 4000] = float("inf")
    u = uniforms(len(params), v, 5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = cl().sample_tokens(logits, params, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got[1].item() == -1 and got[4].item() == -1
    assert_exact(got, reference.sample_tokens(logits, params, u), "faults")
    monkeypatch.setattr(tk, "FUSED_TOP_K", False)  # the torch filter path
    assert not any(tk.top_k_kernel_rows(params, v))
    assert_exact(cl().sample_tokens(logits, params, u), got, "switch off")
    assert not any(tk.top_k_kernel_rows(params, tk.TOP_K_KERNEL_MAX_VOCAB + 1))


def test_ties_and_u_equal_one():
    v = 6000
    logits = torch.zeros(3, v, device=DEV)  # equal p everywhere
    u = uniforms(3, v, 4) * 0.99
    u[0, 10] = u[0, 5000] = 0.9999999  # equal best race in two chunks -> lowest id
    u[1, 7] = u[1, 8] = 0.9999999
    u[2, 123] = 1.0  # -log(1) = -0.0, clamped to 2^-25 (below -log(0.9999999)): this token wins
    u[2, 124] = 0.9999999
    got = same_as_reference(logits, [SamplingParams(temperature=1.0)] * 3, u, "ties")
    assert got.tolist() == [10, 7, 123]


def test_uniforms_none_uses_global_rng():
    logits = torch.randn(4, 3000, device=DEV)
    torch.manual_seed(5)
    got = cl().sample_tokens(logits, [SamplingParams()] * 4)
    torch.manual_seed(5)
    assert_exact(got, reference.sample_tokens(logits, [SamplingParams()] * 4))


def test_no_host_sync(filter_path):
    logits = torch.randn(8, 32000, device=DEV)
    u = uniforms(8, 32000, 6)
    params = [SamplingParams(temperature=0.9)] * 4 + [SamplingParams(top_p=0.9)] * 4
    cl().sample_tokens(logits, params, u)  # warm-up: pinned-memory pool, library load
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        cl().sample_tokens_tensor(logits, u, torch.full((8,), 0.9, device=DEV))
        cl().sample_tokens(logits, params, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_replay():
    b, v = 4, 128256
    logits = torch.randn(b, v, device=DEV)
    u = uniforms(b, v, 7)
    temp = torch.tensor([0.0, 0.5, 1.0, 1.5], device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cl().sample_tokens_tensor(logits, u, temp)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cl().sample_tokens_tensor(logits, u, temp)
    for seed in range(3):
        logits.copy_(torch.randn_like(logits) * 3)
        u.copy_(uniforms(b, v, 20 + seed))
        g.replay()
        torch.cuda.synchronize()
        assert_exact(out, cl().sample_tokens_tensor(logits, u, temp), f"replay {seed}")
        params = [SamplingParams(temperature=float(t)) for t in temp.tolist()]
        assert_exact(out, reference.sample_tokens(logits, params, u), f"replay vs reference {seed}")


def test_apply_penalties_matches_reference():
    b, v = 3, 1000
    logits = torch.randn(b, v, device=DEV)
    pc = torch.randint(0, 3, (b, v), device=DEV)
    oc = torch.randint(0, 3, (b, v), device=DEV)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2), SamplingParams(),
              SamplingParams(repetition_penalty=0.8)]
    assert_exact(cl().apply_penalties(logits, pc, oc, params), reference.apply_penalties(logits, pc, oc, params))


def test_opcheck():
    logits = torch.randn(3, 3000, device=DEV)
    u = uniforms(3, 3000, 8)
    temp = torch.tensor([0.0, 1.0, 0.7], device=DEV)
    op = torch.ops.exl2_backend.sample_tokens.default
    torch.library.opcheck(op, (logits, u, temp))
    torch.library.opcheck(op, (logits, u, temp, torch.softmax(logits, -1)))


@pytest.mark.parametrize("v", VOCABS)
@pytest.mark.parametrize("b", [1, 5, 70])
def test_greedy_tokens_is_argmax(v, b):
    """greedy_tokens (the sampler kernel, every temperature 0, the logits as the unread uniforms) equals
    torch.argmax: ties across chunks to the lowest id, all -inf rows to 0, -1 for a row holding a NaN; rows with a
    stride past V (the model's logits[:, :vocab_size] slice), batches past the cached zero temperatures
    (70 > 64)."""
    wide = torch.randn(b, v + 40, device=DEV) * 4
    logits = wide[:, :v]
    logits[0, 5] = logits[0, v - 1] = 100.0
    if b > 1:
        logits[1, :] = -float("inf")
    if b > 2:
        logits[2, v // 2] = float("nan")
    if b > 3:
        logits[3, v - 1] = float("inf")
    got = cl().greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert_exact(got, torch.where(reference.faulty_rows(logits), -1, torch.argmax(logits, -1)))
    assert got[0].item() == 5


def test_greedy_tokens_in_cuda_graph():
    logits = torch.randn(3, 32000, device=DEV)
    cl().greedy_tokens(logits)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cl().greedy_tokens(logits)
    for seed in range(3):
        logits.copy_(torch.randn(3, 32000, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)))
        g.replay()
        assert_exact(out, torch.argmax(logits, -1))


def test_greedy_tokens_rejects_bad_logits():
    """A typed error naming the input, before any launch: one-dimensional, fp16 or empty-vocabulary logits."""
    from exl2_backend.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="greedy_tokens: logits must have 2 dims"):
        cl().greedy_tokens(torch.randn(100, device=DEV))
    with pytest.raises(InvalidRequestError, match="greedy_tokens: logits dtype"):
        cl().greedy_tokens(torch.randn(2, 100, device=DEV).half())
    with pytest.raises(InvalidRequestError, match="empty vocabulary"):
        cl().greedy_tokens(torch.empty(2, 0, device=DEV))
