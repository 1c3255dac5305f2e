"""What the sampling filters cost on the GPU, piece by piece (CUDA-event timing, one row of a 128k vocabulary or
argv[1]): the softmax, the full stable sort, the bounded sort's top-k over 64-bit keys (which the CPU takes,
reference_sampling.descending_sort) and torch's fp32 top-k, and filtered_probs for top-k, top-p and both. Prints
one line per piece, in microseconds (median of 50 after 5 warm-up calls; host launch time included, as eager
sampling pays it). H100, 2026-12-05: softmax 41.5, sort 91.2, key top-k 297.8, fp32 top-k 112.6. --profile adds
each filtered_probs' kernels by GPU time (torch.profiler). Last, a whole token's sampling through the top-k /
nucleus kernel against the torch filter path."""

from __future__ import annotations

import statistics
import sys

import torch


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000)
    return statistics.median(out)


def main() -> int:
    from exl2_backend.ops.cuda_layers import filtered_probs, sampling_param_tensors
    from exl2_backend.ops.reference_sampling import active_filters
    from exl2_backend.sampling import SamplingParams

    v = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    logits = torch.randn(1, v, device="cuda") * 3
    probs = torch.softmax(logits, -1)
    rows = {"top_k 50": SamplingParams(temperature=0.8, top_k=50), "top_p 0.9": SamplingParams(temperature=0.8,
            top_p=0.9), "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9)}
    print(f"softmax            {timed(lambda: torch.softmax(logits, -1)):8.1f} us")
    print(f"sort (stable)      {timed(lambda: torch.sort(probs, dim=-1, descending=True, stable=True)):8.1f} us")
    reversed_ids = torch.arange(v - 1, -1, -1, device="cuda")

    def key_topk():
        keys = (probs.view(torch.int32).to(torch.int64) << 32) | reversed_ids
        return torch.topk(keys, 50, dim=-1)

    print(f"key top-k 50       {timed(key_topk):8.1f} us")
    print(f"topk fp32 50       {timed(lambda: torch.topk(probs, 50, dim=-1)):8.1f} us")
    for name, p in rows.items():
        params = [p]
        pt = sampling_param_tensors(params, v, "cuda")
        args = (logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"], active_filters(params, v))
        print(f"filtered_probs {name:22s} {timed(lambda a=args: filtered_probs(*a)):8.1f} us")
        if "--profile" in sys.argv:
            kernel_table(lambda a=args: filtered_probs(*a))
    sampler_costs(logits, v)
    return 0


def sampler_costs(logits: torch.Tensor, v: int) -> None:
    """A whole sampled token's sampling (cuda_layers.sample_tokens) for top-k rows and rows without a top-k (the
    nucleus paths: kept tokens among the best 64, a histogram bin sorted, a crowded bin narrowed): the kernel
    against the torch filter path (EXL2_BACKEND_FUSED_TOP_K=0), wall and GPU time."""
    from exl2_backend.ops import cuda_layers, cuda_sampling_top_k
    from exl2_backend.sampling import SamplingParams

    u = 1.0 - torch.rand_like(logits)
    peaked = logits.clone()  # an LLM-like row: 24 plausible tokens far above the rest (top-p keeps them alone)
    peaked[0, torch.randperm(v, device=logits.device)[:24]] += 25.0
    for name, p, row in (
            ("top_k 50", SamplingParams(temperature=0.8, top_k=50), logits),
            ("top_k 40 + top_p 0.95 + min_p 0.05", SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
             logits),
            ("top_p 0.9, peaked row", SamplingParams(temperature=0.8, top_p=0.9), peaked),
            ("top_p 0.9, spread row (std 3)", SamplingParams(temperature=0.8, top_p=0.9), logits),
            ("min_p 0.05, spread row", SamplingParams(temperature=0.8, min_p=0.05), logits),
            ("top_p 0.5, flat row (std 0.02)", SamplingParams(temperature=1.0, top_p=0.5), logits * 0.0067)):
        for fused in (True, False):
            cuda_sampling_top_k.FUSED_TOP_K = fused
            fn = lambda p=p, row=row: cuda_layers.sample_tokens(row, [p], u)
            print(f"sample_tokens {name:36s} {'top-k kernel' if fused else 'torch filters':13s} "
                  f"{timed(fn):8.1f} us")
            if "--profile" in sys.argv:
                kernel_table(fn)
    cuda_sampling_top_k.FUSED_TOP_K = True


def kernel_table(fn, reps: int = 20) -> None:
    """The GPU kernels of `fn` by device time per call (torch.profiler), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    print(f"    GPU time per call {total:.1f} us")
    for key, us, n in rows[:12]:
        print(f"    {us:8.1f} us  x{n}  {key[:110]}")


if __name__ == "__main__":
    sys.exit(main())
