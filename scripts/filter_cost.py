"""What the sampling filters cost on the GPU, piece by piece (CUDA-event timing, 128k vocabulary, one row): the
softmax, the full stable sort, the bounded sort (descending_sort with a bound), and filtered_probs for top-k,
top-p and both. Prints one line per piece, in microseconds (median of 50 after 5 warm-up calls)."""

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
    from exl2_backend.ops.reference_sampling import active_filters, descending_sort, top_k_bound
    from exl2_backend.sampling import SamplingParams

    v = int(sys.argv[1]) if len(sys.argv) > 1 else 128256
    logits = torch.randn(1, v, device="cuda") * 3
    probs = torch.softmax(logits, -1)
    rows = {"top_k 50": SamplingParams(temperature=0.8, top_k=50), "top_p 0.9": SamplingParams(temperature=0.8,
            top_p=0.9), "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9)}
    print(f"softmax            {timed(lambda: torch.softmax(logits, -1)):8.1f} us")
    print(f"sort (stable)      {timed(lambda: torch.sort(probs, dim=-1, descending=True, stable=True)):8.1f} us")
    print(f"bounded sort 50    {timed(lambda: descending_sort(probs, 50)):8.1f} us")
    print(f"topk fp32 50       {timed(lambda: torch.topk(probs, 50, dim=-1)):8.1f} us")
    for name, p in rows.items():
        params = [p]
        pt = sampling_param_tensors(params, v, "cuda")
        args = (logits, pt["temperature"], pt["top_k"], pt["top_p"], pt["min_p"], active_filters(params, v))
        bound = top_k_bound(params, v)
        print(f"filtered_probs {name:22s} full {timed(lambda: filtered_probs(*args)):8.1f} us, "
              f"bounded {timed(lambda: filtered_probs(*args, k_bound=bound)):8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
