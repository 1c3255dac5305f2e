"""pytest-benchmark suite for end-to-end decode and prefill on random EXL2 directories at real shapes (GPU only;
tests/conftest.py marks tests/bench as `cuda` + `benchmark`).

Per shape (llama3-1b, llama3-8b at 4.0 bpw, fp16 cache): the batch-1 decode step as one CUDA-graph replay and as
the engine's step API (what a host gets: greedy steps keep the next one in flight, runtime/lookahead.py), both at
a 1k context, and a 2,048-token prefill of fresh ids. A round's time is what a caller waits (the graph replay and
the prefill synchronize; decode returns host tokens); extra_info carries the event-timed graph step, tokens/s and
the % of the roofline against a read bandwidth measured in the same module.
`exl2-backend bench` prints the full table over contexts and cache types.
"""

from __future__ import annotations

import itertools
import statistics
import time

import pytest
import torch

CONTEXT = 1024
PREFILL_TOKENS = 2048
DECODE_ROUNDS = 50


@pytest.fixture(scope="module", params=["llama3-1b", "llama3-8b"])
def bench_engine(request, tmp_path_factory):
    """-> (engine, shape, weight bytes per token, read bandwidth GB/s); the engine holds no sequence between tests."""
    from exl2_backend.bench.decode import load_engine
    from exl2_backend.bench.roofline import measure_read_bandwidth
    from exl2_backend.format.random_model import write_random_exl2_model

    shape = request.param
    model_dir = write_random_exl2_model(tmp_path_factory.mktemp(shape) / "model", shape, 4.0)
    max_seq_len = 4096  # the 2k prefill and the 1k context with its decode rounds
    engine, wbytes, _ = load_engine(model_dir, "cuda", max_seq_len, use_graphs=True)
    bandwidth = measure_read_bandwidth(engine.device)
    _run_sequence(engine, "warmup", 64, 8)  # kernel selection and graph capture outside the timed rounds
    yield engine, shape, wbytes, bandwidth
    engine.assert_no_leaks()
    del engine
    torch.cuda.empty_cache()


_SEEDS = itertools.count()


def _prompt(engine, n: int) -> list[int]:
    """Fresh random ids for every sequence: a repeated prompt would hit the prefix cache (AI2's first baseline timed
    the 8B's 2k prefill at 2.6 ms that way)."""
    gen = torch.Generator().manual_seed(next(_SEEDS))
    return torch.randint(0, engine.config.vocab_size, (n,), generator=gen).tolist()


def _add(engine, seq_id: str, prompt_len: int, new_tokens: int) -> None:
    from exl2_backend.runtime import GenerationParams
    from exl2_backend.sampling import SamplingParams

    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=new_tokens, ignore_eos=True)
    engine.add_sequence(seq_id, _prompt(engine, prompt_len), params)


def _prefill(engine, seq_id: str) -> None:
    while not engine.prefill([seq_id])[0].token_ids:  # chunked: one call per chunk until the first token
        pass
    torch.cuda.synchronize(engine.device)


def _run_sequence(engine, seq_id: str, prompt_len: int, steps: int) -> None:
    _add(engine, seq_id, prompt_len, steps + 4)
    _prefill(engine, seq_id)
    for _ in range(steps):
        engine.decode([seq_id])
    engine.release(seq_id)


def _roofline_info(engine, wbytes: int, bandwidth: float, step_s: float) -> dict:
    from exl2_backend.bench.roofline import decode_bytes

    nbytes = decode_bytes(engine.config, wbytes, CONTEXT, "fp16")
    roof = bandwidth * 1e9 / nbytes
    return {"tokens_per_s": 1 / step_s, "bytes_per_token": nbytes, "read_bandwidth_gbs": bandwidth,
            "pct_roofline": 100 / step_s / roof}


def test_bench_decode_graph_step(benchmark, bench_engine):
    from exl2_backend.bench.decode import decode_graph, graph_step_seconds

    engine, shape, wbytes, bandwidth = bench_engine
    _add(engine, "seq", CONTEXT, 4)
    try:
        _prefill(engine, "seq")
        engine.decode(["seq"])
        # the graph that ran this sequence's step (with graph I/O a greedy graph: the plain one would replay a step
        # over an empty context); replays repeat it
        g = decode_graph(engine)
        assert g is not None, "no batch-1 decode graph was captured"

        def step():
            g.replay()
            torch.cuda.synchronize(engine.device)

        benchmark.pedantic(step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=3)
        step_s = graph_step_seconds(engine, DECODE_ROUNDS)
    finally:
        engine.release("seq")
    benchmark.extra_info.update({"shape": shape, "context": CONTEXT, "graph_step_ms": step_s * 1e3,
                                 **_roofline_info(engine, wbytes, bandwidth, step_s)})


def test_bench_decode_engine_step(benchmark, bench_engine):
    engine, shape, wbytes, bandwidth = bench_engine
    _add(engine, "seq", CONTEXT, DECODE_ROUNDS + 8)
    times: list[float] = []
    try:
        _prefill(engine, "seq")

        def step():  # decode returns host tokens (its own sync); greedy keeps the next step in flight meanwhile
            t0 = time.perf_counter()
            out = engine.decode(["seq"])
            times.append(time.perf_counter() - t0)
            return out

        benchmark.pedantic(step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=2)
    finally:
        engine.release("seq")
    benchmark.extra_info.update({"shape": shape, "context": CONTEXT, "engine_step_ms": statistics.median(times) * 1e3,
                                 **_roofline_info(engine, wbytes, bandwidth, statistics.median(times))})


def test_bench_prefill_2k(benchmark, bench_engine):
    engine, shape, _, _ = bench_engine
    ids = itertools.count()
    times: list[float] = []

    def setup():  # a fresh sequence per round (not timed)
        seq_id = f"prefill{next(ids)}"
        _add(engine, seq_id, PREFILL_TOKENS, 1)
        return (seq_id,), {}

    def prefill(seq_id: str) -> None:
        t0 = time.perf_counter()
        _prefill(engine, seq_id)
        times.append(time.perf_counter() - t0)

    benchmark.pedantic(prefill, setup=setup, teardown=lambda seq_id: engine.release(seq_id), rounds=8,
                       warmup_rounds=2)
    benchmark.extra_info.update({"shape": shape, "tokens": PREFILL_TOKENS,
                                 "tokens_per_s": PREFILL_TOKENS / statistics.median(times)})
