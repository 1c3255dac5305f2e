"""The VRAM plan (exl2_backend/plan/): sizes match what loading really allocates, and a plan that does not fit
raises VramPlanError naming the device and the shortfall in GB -- before anything is loaded. CUDA plans are
computed here on the CPU from header-only descriptions, with the free memory given."""

from __future__ import annotations

import itertools

import pytest

from exl2_backend.errors import VramPlanError
from exl2_backend.ops.cuda_quant import pack_qtensor
from exl2_backend.plan import describe_dir, describe_random, plan_load
from exl2_backend.plan.sizes import LinearDesc
from exl2_backend.plan.vram import CUDA_RESERVE, GB
from exl2_backend.runtime import LoadSettings
from tests.helpers.synth import random_qtensor, tiny_config_dict, write_tiny_exl2_model

SEVENTY = describe_random("llama3-70b", 4.0)
TWO_H200 = {"cuda:0": int(140e9), "cuda:1": int(140e9)}


def _cuda_settings(**kw) -> LoadSettings:
    base = {"device": "cuda", "max_seq_len": 8192, "max_batch_size": 1}
    base.update(kw)
    return LoadSettings(**base)


@pytest.mark.parametrize("k,n,option,bias", [(320, 100, "6:0.25@32 5:0.25@32 3:0.5@64", True),
                                             (256, 64, "8:0.1@32 4:0.9@64", False), (1024, 96, "2:1@128", False)])
def test_packed_bytes_match_pack_qtensor(k, n, option, bias):
    qt = random_qtensor("t", k, n, option, seed=k, bias=bias)
    p = pack_qtensor(qt, "cpu")  # the CUDA layout, built with plain torch ops
    tensors = [p.packed, p.scales, p.maxf, p.info, p.xmap, p.q_invperm, p.scl16] + ([p.bias] if bias else [])
    actual = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)
    desc = LinearDesc("t", k, n, tuple((g.bits, g.rows) for g in qt.groups), bias)
    assert desc.packed_bytes() == actual
    assert desc.disk_bytes() == qt.storage_bytes()


def test_cpu_plan_matches_loaded_model(tmp_path):
    """Dense (reference) sizes: every tensor the CPU model keeps is counted exactly."""
    from exl2_backend.model import LlamaModel

    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(num_hidden_layers=3))
    plan = plan_load(LoadSettings(model_dir=d, device="cpu", max_seq_len=256, cache_tokens=512, page_size=16))
    model = LlamaModel.from_dir(d, "cpu")
    held = [model.embed, model.norm, model.lm_head.weight_t]
    for layer in model.layers:
        held += [layer.input_norm, layer.post_norm] + [op.weight_t for op in (layer.qkv, layer.o, layer.gate_up,
                                                                                layer.down)]
    actual = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in held)
    (dev,) = plan.devices
    # the plan counts q, k, v (and gate, up) apart, each rounded to 512 bytes: at most 3 roundings per layer
    assert 0 <= dev.weights - actual <= 512 * 3 * 3
    cache = model.make_cache(512 // 16, 16)
    assert dev.kv_cache == sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    assert dev.capacity is None and dev.shortfall == 0  # host memory is not planned
    plan.check()


def test_single_gpu_fits_and_does_not_fit():
    plan = plan_load(_cuda_settings(device="cuda:0"), desc=SEVENTY, free_memory={"cuda:0": int(140e9)})
    plan.check()
    (dev,) = plan.devices
    assert dev.layers == (0, 80) and dev.embed and dev.head
    assert 35 * GB < dev.weights < 42 * GB  # 70B at 4.0 bpw (head 6 bits, fp16 embedding)
    assert dev.kv_cache == 8192 * 80 * 2 * 8 * 128 * 2  # max_seq_len x layers x K,V x Hkv x D x fp16
    small = plan_load(_cuda_settings(device="cuda:0"), desc=SEVENTY, free_memory={"cuda:0": int(30e9)})
    with pytest.raises(VramPlanError) as err:
        small.check()
    e = err.value
    assert e.device == "cuda:0"
    assert e.shortfall_bytes == small.devices[0].peak - int(30e9)
    assert "cuda:0" in str(e) and f"{e.shortfall_gb:.2f} GB short" in str(e)


def test_gpu_split_places_embedding_first_head_last_and_reserves_cache():
    plan = plan_load(_cuda_settings(gpu_split=[40, 40], cache_tokens=16384), desc=SEVENTY, free_memory=TWO_H200)
    plan.check()
    a, b = plan.devices
    assert a.embed and not a.head and b.head and not b.embed
    assert a.layers[0] == 0 and a.layers[1] == b.layers[0] and b.layers[1] == 80
    kv_layer = plan.cache_tokens * 2 * 8 * 128 * 2
    assert a.kv_cache == kv_layer * (a.layers[1] - a.layers[0]) and b.kv_cache == kv_layer * (b.layers[1] - b.layers[0])
    for d in (a, b):  # each device holds its layers' cache, scratch and reserve within its budget
        assert d.peak <= 40 * GB and d.reserve == CUDA_RESERVE and d.scratch > 0
    # the budget is filled: one more layer would not have fitted on the first device
    assert a.peak + SEVENTY.layer_bytes(a.layers[1], "packed", 2) + kv_layer > 40 * GB


def test_gpu_split_too_small_names_the_last_device_and_shortfall():
    plan = plan_load(_cuda_settings(gpu_split=[20, 23]), desc=SEVENTY, free_memory=TWO_H200)
    with pytest.raises(VramPlanError) as err:
        plan.check()
    assert err.value.device == "cuda:1" and err.value.field == "gpu_split"
    assert err.value.shortfall_bytes == plan.devices[1].peak - int(23e9) > 0
    assert "cuda:1" in str(err.value) and "23.00 GB (gpu_split)" in str(err.value)


def test_gpu_split_budget_above_free_memory_is_refused():
    plan = plan_load(_cuda_settings(gpu_split=[40, 40]), desc=SEVENTY,
                     free_memory={"cuda:0": int(140e9), "cuda:1": int(10e9)})
    with pytest.raises(VramPlanError) as err:
        plan.check()
    assert err.value.device == "cuda:1" and "free memory" in str(err.value)


def test_autosplit_fills_devices_in_order():
    free = {"cuda:0": int(24e9), "cuda:1": int(24e9), "cuda:2": int(80e9)}
    plan = plan_load(_cuda_settings(autosplit=True, cache_tokens=8192), desc=SEVENTY, free_memory=free)
    plan.check()
    segs = plan.segments()
    assert [s[0] for s in segs] == ["cuda:0", "cuda:1", "cuda:2"]
    assert segs[0][1] == 0 and segs[-1][2] == 80
    assert all(x[2] == y[1] for x, y in itertools.pairwise(segs))
    assert plan.devices[0].layers[1] < plan.devices[1].layers[1] - plan.devices[1].layers[0] + 1  # embedding first
    assert plan.devices[2].head


def test_default_cache_is_sized_from_the_room_left():
    plan = plan_load(_cuda_settings(device="cuda:0", max_batch_size=64), desc=SEVENTY,
                     free_memory={"cuda:0": int(140e9)})
    plan.check()
    dev = plan.devices[0]
    assert plan.cache_tokens >= 8192 and plan.cache_tokens % plan.page_size == 0
    assert dev.peak <= 140e9


def test_tensor_parallel_plan_halves_layers_and_cache():
    single = plan_load(_cuda_settings(device="cuda:0", cache_tokens=8192), desc=SEVENTY,
                       free_memory={"cuda:0": int(140e9)}).devices[0]
    plan = plan_load(_cuda_settings(tensor_parallel=2, cache_tokens=8192), desc=SEVENTY, free_memory=TWO_H200)
    plan.check()
    for d in plan.devices:
        assert d.kv_cache == single.kv_cache // 2
        # half the layers' weights, plus the replicated o_proj (~8%) and embedding
        assert 0.5 * single.weights < d.weights < 0.62 * single.weights
    bad = LoadSettings(device="cuda", tensor_parallel=3, max_seq_len=4096)
    from exl2_backend.errors import ConfigError

    with pytest.raises(ConfigError, match="divide"):
        plan_load(bad, desc=SEVENTY, free_memory={f"cuda:{i}": int(140e9) for i in range(3)})


def test_draft_model_counted_on_first_device(tmp_path):
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(num_hidden_layers=2))
    draft = describe_dir(d)
    without = plan_load(_cuda_settings(gpu_split=[40, 40], cache_tokens=8192), desc=SEVENTY, free_memory=TWO_H200)
    with_draft = plan_load(_cuda_settings(gpu_split=[40, 40], cache_tokens=8192), desc=SEVENTY, draft=draft,
                           free_memory=TWO_H200)
    assert without.devices[0].draft == 0 and with_draft.devices[0].draft > 0
    assert with_draft.devices[1].draft == 0


def test_cpu_segments_from_gpu_split(tmp_path):
    d = write_tiny_exl2_model(tmp_path / "m", tiny_config_dict(num_hidden_layers=4))
    desc = describe_dir(d)
    common = {"model_dir": d, "device": "cpu", "max_seq_len": 256, "cache_tokens": 256, "page_size": 16}
    roomy = plan_load(LoadSettings(gpu_split=[1.0, 1.0], **common), desc=desc)
    assert [s[1:] for s in roomy.segments()] == [(0, 4)]  # everything fits on the first segment
    layer = desc.layer_bytes(0, "dense", 4) + 256 * desc.kv_bytes_per_token_layer(4)
    budget = (desc.embed_bytes(4) + roomy.devices[0].scratch + 2.5 * layer) / GB  # room for two layers
    plan = plan_load(LoadSettings(gpu_split=[budget, 1.0], **common), desc=desc)
    plan.check()
    assert plan.segments() == [("cpu", 0, 2), ("cpu", 2, 4)]
