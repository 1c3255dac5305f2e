"""Layer split and tensor parallelism on GPUs (cuda marker). One GPU: the split code path with every segment on
cuda:0 (per-segment decode graphs, device-to-device hand-over) gives the unsplit model's tokens and logits bit
for bit, and the plan's weight and cache bytes match the allocator. Two GPUs (skipped otherwise): the split over
cuda:0/cuda:1 is bit-identical too; tensor parallelism (NCCL) agrees within fp16 reduction-order tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from exl2_backend.bench.random_weights import RandomSource
from exl2_backend.model import LlamaModel
from exl2_backend.model.split import Segment, SplitLlamaModel
from exl2_backend.plan import describe_random, plan_load
from exl2_backend.runtime import Engine, GenerationParams, LoadSettings
from exl2_backend.sampling import SamplingParams

pytestmark = pytest.mark.cuda
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")

# Llama-3 proportions, small: 8 layers, hidden 2048, GQA 32/8, untied head
SHAPE = {"hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 8192, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 32768, "tie_word_embeddings": False,
         "max_position_embeddings": 4096}
SOURCE = RandomSource(SHAPE, 4.0)
SETTINGS = LoadSettings(device="cuda:0", max_seq_len=512, cache_tokens=1024, max_batch_size=4, page_size=64,
                        prefix_caching=False)
PROMPTS = [list(range(100, 140)), [7, 8, 9, 10, 11], list(range(2000, 2090))]
STEPS = 16


def _run(engine) -> tuple[dict, torch.Tensor]:
    """Prompt logits of PROMPTS[0] on fresh pages, then greedy batched generation of every prompt."""
    pages = math.ceil(len(PROMPTS[0]) / engine.page_size)
    logits = engine.runner.run([PROMPTS[0]], [0], [list(range(pages))], "last")[0].float().cpu()
    params = GenerationParams(sampling=SamplingParams.greedy(), max_new_tokens=STEPS, ignore_eos=True)
    ids = [f"s{i}" for i in range(len(PROMPTS))]
    for sid, p in zip(ids, PROMPTS):
        engine.add_sequence(sid, p, params)
    toks = {sid: [] for sid in ids}
    for ev in engine.prefill(ids):
        toks[ev.seq_id] += ev.token_ids
    for _ in range(STEPS - 1):
        for ev in engine.decode(ids):
            toks[ev.seq_id] += ev.token_ids
    for sid in ids:
        engine.release(sid)
    engine.assert_no_leaks()
    return toks, logits


def _weights(device="cuda:0"):
    config = SOURCE.config()
    return config, SOURCE.weights(config, torch.device(device))


@pytest.fixture(scope="module")
def single():
    config, w = _weights()
    engine = Engine(LlamaModel(config, w, "cuda:0"), None, SETTINGS)
    out = _run(engine)
    assert type(engine.runner).__name__ == "CudaGraphRunner"
    del engine
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_split_on_one_gpu_is_bit_identical(single, graphs):
    config, w = _weights()
    segs = [Segment(torch.device("cuda:0"), 0, 3), Segment(torch.device("cuda:0"), 3, 8)]
    engine = Engine(SplitLlamaModel(config, w, segs), None, SETTINGS.model_copy(update={"use_cuda_graphs": graphs}))
    toks, logits = _run(engine)
    if graphs:
        assert type(engine.runner).__name__ == "SegmentGraphRunner" and engine.runner.replays > 0
    assert toks == single[0]
    assert torch.equal(logits, single[1])


def _workspace_bytes() -> int:
    from exl2_backend.ops import cuda_quant

    ws = cuda_quant._WORKSPACES.get(torch.device("cuda:0"))
    if ws is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (ws.ws, ws.counters, *ws._old))


def _cuda_bytes_by_attribute(root) -> dict[str, int]:
    """Bytes of the distinct CUDA tensors reachable from `root`'s attributes, summed by attribute name."""
    seen, out, stack, visited = set(), {}, [("root", root)], set()
    while stack:
        name, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda and obj.untyped_storage().data_ptr() not in seen:
                seen.add(obj.untyped_storage().data_ptr())
                out[name] = out.get(name, 0) + obj.untyped_storage().nbytes()
            continue
        if id(obj) in visited or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        visited.add(id(obj))
        if isinstance(obj, dict):
            stack += [(str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            stack += [(name, v) for v in obj]
        elif hasattr(obj, "__dict__"):
            stack += list(vars(obj).items())
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def test_plan_weights_and_cache_match_the_allocator():
    """The plan's weight bytes are the storages the built model holds (within 1%: the plan rounds each tensor up);
    the allocator's extra on top (block rounding and the slack of reused cached blocks, 1.7% here: packing frees
    temporaries the weights then land in) stays within the plan's CUDA_RESERVE; the kernel workspace within
    KERNEL_WORKSPACE; the cache is exact."""
    from exl2_backend.plan.vram import CUDA_RESERVE, KERNEL_WORKSPACE

    desc = describe_random(SHAPE, 4.0)
    plan = plan_load(SETTINGS, desc=desc, free_memory={"cuda:0": int(torch.cuda.mem_get_info(0)[0])})
    dev = plan.devices[0]
    torch.cuda.synchronize()
    before, ws_before = torch.cuda.memory_allocated(0), _workspace_bytes()
    config, w = _weights()
    model = LlamaModel(config, w, "cuda:0")
    del w
    torch.cuda.synchronize()
    held = _cuda_bytes_by_attribute(model)  # storage bytes by attribute name
    workspace_names = ("ws", "counters", "_old")  # ops/cuda_quant._Workspace, reachable through every linear
    weights = sum(v for k, v in held.items() if k not in workspace_names)
    assert abs(weights - dev.weights) <= 0.01 * dev.weights, (weights, dev.weights, held)
    ws_growth = _workspace_bytes() - ws_before
    slack = torch.cuda.memory_allocated(0) - before - ws_growth - weights
    print(f"plan {dev.weights:,} B, storages {weights:,} B, allocator slack {slack:,} B, workspace "
          f"{held.get('ws', 0):,} B")
    assert 0 <= slack <= CUDA_RESERVE, (slack, held)
    assert held.get("ws", 0) + held.get("counters", 0) <= KERNEL_WORKSPACE
    mid = torch.cuda.memory_allocated(0)
    cache = model.make_cache(plan.cache_tokens // SETTINGS.page_size, SETTINGS.page_size)
    assert torch.cuda.memory_allocated(0) - mid == dev.kv_cache
    del cache, model


@two_gpus
def test_split_over_two_gpus_is_bit_identical(single):
    config, w = _weights()
    segs = [Segment(torch.device("cuda:0"), 0, 4), Segment(torch.device("cuda:1"), 4, 8)]
    model = SplitLlamaModel(config, w, segs)
    assert model.layers[5].qkv.launch.parts[0].packed.device == torch.device("cuda:1")
    engine = Engine(model, None, SETTINGS)
    toks, logits = _run(engine)
    assert type(engine.runner).__name__ == "SegmentGraphRunner"
    assert toks == single[0]
    assert torch.equal(logits, single[1])
    caches = engine.cache.segments
    assert caches[0].k[0].device == torch.device("cuda:0") and caches[1].k[0].device == torch.device("cuda:1")


@two_gpus
def test_engine_load_gpu_split_from_a_directory(tmp_path, single):
    from exl2_backend.format.random_model import write_random_exl2_model
    from exl2_backend.plan import describe_dir

    d = write_random_exl2_model(tmp_path / "m", {**SHAPE, "num_hidden_layers": 4}, bpw=4.0)
    desc = describe_dir(d)
    base = SETTINGS.model_copy(update={"model_dir": d, "device": "cuda"})
    free = {f"cuda:{i}": int(torch.cuda.mem_get_info(i)[0]) for i in range(2)}
    budget = next(q / 8 for q in range(1, 800)
                  if plan_load(base.model_copy(update={"gpu_split": (q / 8, 60.0)}), desc=desc,
                               free_memory=free).devices[0].layers[1] >= 2)
    engine = Engine.load(base.model_copy(update={"gpu_split": (budget, 60.0)}))
    assert isinstance(engine.model, SplitLlamaModel) and len(engine.model.segments) == 2
    plain = Engine.load(base.model_copy(update={"device": "cuda:0"}))
    assert _run(engine)[0] == _run(plain)[0]


@two_gpus
def test_tensor_parallel_two_gpus_within_tolerance(single):
    from exl2_backend.runtime.tp_group import launch_tensor_parallel

    model = launch_tensor_parallel(SOURCE, 2, "cuda")
    engine = Engine(model, None, SETTINGS.model_copy(update={"device": "cuda"}))
    try:
        assert type(engine.runner.inner).__name__ == "CudaGraphRunner"
        mem = model.coordinator.rank_memory()
        toks, logits = _run(engine)
    finally:
        engine.close()
    assert all(m["allocated"] > 0 for m in mem)
    # fp16 partial sums reduced in another order: logits agree to fp16 accumulation noise, scaled by their size
    ref = single[1]
    diff = (logits - ref).abs().max().item()
    assert diff <= 2e-2 * ref.abs().max().item(), diff
    # greedy tokens agree wherever the single-GPU top-2 margin exceeds that noise; on random weights near-ties
    # are rare, so the first tokens of every sequence must match
    for sid, t in toks.items():
        assert t[:4] == single[0][sid][:4], sid
