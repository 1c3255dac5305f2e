"""The converter's device paths: triton kernels against their references, GPU GPTQ and a GPU conversion whose
files decode exactly to what the converter intended, in the same format as a CPU conversion."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exl2_backend.errors import ConfigError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import ATTENTION_OPTIONS, HEAD_OPTIONS, MLP_OPTIONS
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, load_weights
from exl2_backend.format.safetensors_io import ShardIndex
from exl2_backend.ops.reference import exl2_dequant
from exl2_backend.quant.convert import ConvertSettings, convert, resolve_device
from exl2_backend.quant.gptq import HessianAccumulator, gptq_quantize
from tests.helpers.synth import tiny_config_dict, write_tiny_fp16_model

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The river runs past the old mill, where the miller once ground wheat for the whole valley. " * 3,
         "A compiler translates source code into machine instructions; it parses, checks and emits code. " * 3]
FAST = {"rows": 4, "length": 48, "measure_rows": 2, "attn_options": [0, 6, 14, 18], "mlp_options": [0, 7, 13, 16],
        "progress": False, "checkpoint_s": 0.0}


def test_triton_kernels_interpreted_on_cpu():
    """The kernels' logic, run by triton's interpreter on CPU tensors (skipped where triton is not installed)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.helpers.quant_kernels", "cpu", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.cuda
def test_triton_kernels_match_reference_on_gpu():
    pytest.importorskip("triton")
    from tests.helpers.quant_kernels import check_kernels

    check_kernels("cuda")


@pytest.mark.cuda
def test_gptq_on_gpu_decodes_exactly_and_matches_cpu_quality():
    g = torch.Generator().manual_seed(0)
    k, n = 256, 200
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = (torch.randn(2048, k, generator=g) @ mix) * (0.2 + 3 * torch.rand(k, generator=g))  # [T, K] correlated
    w = torch.randn(n, k, generator=g) / k**0.5
    acc = HessianAccumulator(k)
    acc.add(x)
    seen = set()
    for opt in [o for row in ATTENTION_OPTIONS + MLP_OPTIONS for o in row] + list(HEAD_OPTIONS.values()):
        if str(opt) in seen:
            continue
        seen.add(str(opt))
        gpu = gptq_quantize("t", w.cuda(), acc.result().cuda(), opt)
        assert gpu.dequant.is_cuda and gpu.qtensor.q_weight.device.type == "cpu"
        assert torch.equal(exl2_dequant(gpu.qtensor), gpu.dequant.cpu()), str(opt)
        cpu = gptq_quantize("t", w, acc.result(), opt)
        err = [float((x @ r.weight().cpu().t() - x @ w.t()).norm() / (x @ w.t()).norm()) for r in (gpu, cpu)]
        assert err[0] < 1.05 * err[1] + 1e-4, (str(opt), err)  # same algorithm, different rounding order only


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    idx = ShardIndex(d)
    try:
        return {k: idx.get(k).clone() for k in idx.keys()}  # noqa: SIM118 (ShardIndex is not a dict)
    finally:
        idx.close()


def _convert_recording(src: Path, out: Path, work: Path, device: str, **kw) -> tuple[dict, dict[str, torch.Tensor]]:
    intended: dict[str, torch.Tensor] = {}
    summary = convert(src, out, ConvertSettings(**{**FAST, "work_dir": str(work), "device": device, **kw}),
                      texts=TEXTS, on_linear=lambda key, dq: intended.__setitem__(key, dq.cpu()))
    return summary, intended


def _assert_decodes_to(out: Path, intended: dict[str, torch.Tensor]) -> None:
    cfg = ModelConfig.from_dir(out)
    weights = load_weights(out, cfg)
    linears = [getattr(lw, p) for lw in weights.layers for p in ATTN_PROJS + MLP_PROJS] + [weights.lm_head]
    assert all(isinstance(q, QTensor) for q in linears)
    assert sorted(q.key for q in linears) == sorted(intended)
    for qt in linears:
        assert torch.equal(exl2_dequant(qt), intended[qt.key]), qt.key


@pytest.mark.cuda
def test_gpu_conversion_decodes_to_intended_weights_in_cpu_format(tmp_path):
    src = write_tiny_fp16_model(tmp_path / "fp16", tiny_config_dict(), seed=5)
    summary, intended = _convert_recording(src, tmp_path / "gpu", tmp_path / "gpu.work", "cuda", bpw=4.0)
    assert summary["device"].startswith("cuda") and summary["achieved_bpw"] <= 4.0
    _assert_decodes_to(tmp_path / "gpu", intended)
    _, cpu_intended = _convert_recording(src, tmp_path / "cpu", tmp_path / "cpu.work", "cpu", bpw=4.0)
    gpu_t, cpu_t = _tensors(tmp_path / "gpu"), _tensors(tmp_path / "cpu")
    assert {k: (v.dtype, tuple(v.shape)) for k, v in gpu_t.items()} == \
        {k: (v.dtype, tuple(v.shape)) for k, v in cpu_t.items()}  # identical file format
    # Same algorithm on both devices: close, not bit-identical. Given the CPU's measurement, so that the optimizer
    # makes the same choices (on the H200 the GPU's own measurement flipped a near-equal option of layer 1's MLP,
    # and a 2-bit against a 4-bit gate_proj differ by 40%).
    _, same_choice = _convert_recording(src, tmp_path / "gpu2", tmp_path / "gpu2.work", "cuda", bpw=4.0,
                                        measurement=str(tmp_path / "cpu" / "measurement.json"))
    # Not against each other: two roundings of one weight each err by ~10-30% (the option's own error), so they
    # differ by up to ~1.4x that. Each against the FP16 weight: the GPU's error within 10% of the CPU's.
    fp16 = _tensors(src)
    for key, dq in same_choice.items():
        w = fp16[key + ".weight"].float().t()  # [K, N]; the head's dequant may carry padded columns
        n = w.shape[1]
        err_gpu = float((dq[:, :n].float() - w).norm() / w.norm())
        err_cpu = float((cpu_intended[key][:, :n].float() - w).norm() / w.norm())
        assert err_gpu <= 1.1 * err_cpu + 0.01, (key, err_gpu, err_cpu)

    from exl2_backend.model import LlamaModel
    from exl2_backend.runtime.model_runner import ModelRunner

    ids = [[5, 80, 33, 120, 7, 64, 99, 1, 250, 17, 42, 3]]
    logits = {}
    runs = (("fp16", src, "cpu"), ("gpu_cpu", tmp_path / "gpu", "cpu"), ("gpu_gpu", tmp_path / "gpu", "cuda"))
    for name, d, dev in runs:
        model = LlamaModel.from_dir(d, dev)
        out = ModelRunner(model, model.make_cache(3, 8), 2).run(ids, [0], [[1, 2]], logits="all")
        logits[name] = out.float().cpu()
    ref = logits["fp16"]
    assert float((logits["gpu_cpu"] - ref).norm() / ref.norm()) < 0.4  # random weights: errors are not small
    assert float((logits["gpu_gpu"] - logits["gpu_cpu"]).norm() / logits["gpu_cpu"].norm()) < 0.02


def test_cpu_conversion_decodes_to_intended_weights_and_baselines(tmp_path):
    """The same exactness on the CPU, for the optimized model and the two uniform baselines."""
    src = write_tiny_fp16_model(tmp_path / "fp16", tiny_config_dict(), seed=5)
    _, intended = _convert_recording(src, tmp_path / "opt", tmp_path / "opt.work", "cpu", bpw=4.0)
    _assert_decodes_to(tmp_path / "opt", intended)
    for method in ("gptq", "rtn"):
        out = tmp_path / method
        summary, intended = _convert_recording(src, out, tmp_path / f"{method}.work", "cpu", uniform="4:1@128",
                                               method=method)
        _assert_decodes_to(out, intended)
        assert summary["timings"]["measure_s"] < 5 and not (out / "measurement.json").exists()
        q = ModelConfig.from_dir(out).quantization
        assert q["recipe"] == {"method": method, "uniform": "4:1@128"}
        assert q["bits"] == round(summary["achieved_bpw"], 3)
        weights = load_weights(out, ModelConfig.from_dir(out))
        layouts = {(g.bits, g.rows) for lw in weights.layers for p in ATTN_PROJS + MLP_PROJS
                   for g in getattr(lw, p).groups}
        assert layouts == {(4, 128)}  # hidden 128 / inter 256: every group is 4-bit x 128 rows
        invperm = weights.layers[0].q_proj.q_invperm
        if method == "rtn":  # no act-order
            assert torch.equal(invperm, torch.arange(128, dtype=torch.int32))


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


def test_random_fp16_model_at_a_shape_converts(tmp_path):
    """The timing script's input: a random FP16 dir of a given shape, cut to fewer layers, converts and loads."""
    from exl2_backend.format.random_fp16_model import fp16_config, write_random_fp16_model

    shape = {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 400}
    src = write_random_fp16_model(tmp_path / "fp16", shape, num_layers=2)
    assert fp16_config(shape, 2)["num_hidden_layers"] == 2
    fp16 = load_weights(src, ModelConfig.from_dir(src))
    assert len(fp16.layers) == 2 and fp16.layers[1].down_proj.weight.dtype == torch.float16
    assert abs(float(fp16.layers[1].down_proj.weight.float().std()) - 256**-0.5) < 0.005
    summary = convert(src, tmp_path / "q", ConvertSettings(**{**FAST, "work_dir": str(tmp_path / "q.work"),
                                                             "device": "cpu", "uniform": "4:1@32"}))
    assert summary["layers"] == 2 and set(summary["timings"]) >= {"load_s", "measure_s", "quant_layers_s", "head_s",
                                                                  "write_s", "total_s"}
    assert isinstance(load_weights(tmp_path / "q", ModelConfig.from_dir(tmp_path / "q")).lm_head, QTensor)
    with pytest.raises(ValueError):
        fp16_config(shape, 5)
