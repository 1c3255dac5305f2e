"""FP16 HF directory -> EXL2 directory: calibrate, measure, optimize, quantize, write (format doc d).

Resumable: progress lives in a work directory (default `<OUT_DIR>.work`, see job.py); a rerun with the same
inputs skips measured and quantized layers. The quant pass feeds each layer the *quantized* previous layers'
outputs (as ExLlamaV2 does); the measurement pass feeds the FP16 reference outputs.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from exl2_backend import ops
from exl2_backend.errors import ConfigError, ModelDirectoryError, ModelFormatError, UnsupportedModelError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import HEAD_OPTIONS
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, DenseLinear, linear_shape, load_weights
from exl2_backend.format.writer import make_quantization_config, write_model_dir
from exl2_backend.quant.job import JobState, fingerprint, tensor_hash
from exl2_backend.quant.layer_quant import calibration_rows, quantize_head, quantize_layer
from exl2_backend.quant.measure import DEFAULT_OPTIONS, OPTION_TABLES, block_key, measure_block
from exl2_backend.quant.optimize import BudgetError, achieved_bpw, bpw_range, optimize

log = logging.getLogger(__name__)


@dataclass
class ConvertSettings:
    bpw: float = 4.0
    head_bits: int = 6
    cal_files: Sequence[str] | None = None  # None: the built-in offline calibration texts
    measurement: str | None = None  # reuse this measurement.json instead of measuring
    rows: int = 32  # quant-pass rows
    length: int = 512  # tokens per row
    measure_rows: int = 8
    attn_options: Sequence[int] | None = DEFAULT_OPTIONS["attn"]  # measured subset (None: all 19)
    mlp_options: Sequence[int] | None = DEFAULT_OPTIONS["mlp"]  # measured subset (None: all 17)
    work_dir: str | None = None
    shard_mb: float = 8192
    progress: bool = True


def _check_input(in_dir: Path, out_dir: Path, s: ConvertSettings) -> tuple[ModelConfig, object]:
    cfg = ModelConfig.from_dir(in_dir)  # raises for a missing dir/config and unsupported architectures
    if in_dir.resolve() == out_dir.resolve():
        raise ModelDirectoryError("output directory must differ from the input directory", path=str(out_dir))
    if s.head_bits not in HEAD_OPTIONS:
        raise ConfigError(f"head bits must be one of {sorted(HEAD_OPTIONS)}, got {s.head_bits}", field="head_bits")
    if s.rows < 1 or s.length < 1 or s.measure_rows < 1:
        raise ConfigError("calibration rows and length must be positive", field="rows")
    for proj in ("q_proj", "o_proj", "down_proj"):
        k, _ = linear_shape(cfg, proj)
        if k % 32:
            raise UnsupportedModelError(f"{proj} has {k} input features; EXL2 needs a multiple of 32")
    weights = load_weights(in_dir, cfg)
    if any(isinstance(getattr(lw, p), QTensor) for lw in weights.layers for p in ATTN_PROJS + MLP_PROJS) \
            or isinstance(weights.lm_head, QTensor):
        raise ModelFormatError("input is already quantized; convert needs an FP16/BF16/FP32 model", path=str(in_dir))
    if not (in_dir / "tokenizer.json").is_file():
        raise ModelDirectoryError("no tokenizer.json: needed to tokenize the calibration text", path=str(in_dir))
    return cfg, weights


def _decoder_numel(cfg: ModelConfig) -> int:
    """Sum of K*N over all decoder linears: the bpw denominator (format doc c, norms left out)."""
    return cfg.num_hidden_layers * sum(k * n for k, n in (linear_shape(cfg, p) for p in ATTN_PROJS + MLP_PROJS))


def _check_budget(cfg: ModelConfig, s: ConvertSettings, numel: int) -> None:
    """Fail before the slow measurement if the target bpw is outside what the measured options can reach."""
    slots = []
    for kind, sub in (("attn", s.attn_options), ("mlp", s.mlp_options)):
        table = OPTION_TABLES[kind]
        rows = [table[i] for i in (sub if sub is not None else range(len(table)))]
        slots.append([{"total_bits": sum(o.total_bits(*linear_shape(cfg, p), bias=cfg.has_bias(p))
                                         for o, p in zip(row, ATTN_PROJS if kind == "attn" else MLP_PROJS))}
                      for row in rows])
    lo, hi = bpw_range(slots * cfg.num_hidden_layers, numel)
    if not lo - 1e-9 <= s.bpw <= hi + 1e-9:
        raise BudgetError(f"target {s.bpw} bpw is outside what the measured options allow ({lo:.3f} .. {hi:.3f})")


def _load_measurement(path: str, keys: list[str]) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ModelDirectoryError("measurement file not found", path=str(p))
    try:
        meas = json.loads(p.read_text())
        recs = [meas["measurement"][k] for k in keys]
        ok = all(r and all(isinstance(x["accuracy"], float | int) and int(x["total_bits"]) > 0 for x in r)
                 for r in recs)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"not a measurement.json for this model ({type(e).__name__}: {e})", path=str(p)) from None
    if not ok:
        raise ModelFormatError("measurement has empty or malformed records", path=str(p))
    return meas


def _measure(job: JobState, cfg, weights, ids, s: ConvertSettings, inv_freq, in_dir: Path) -> dict:
    mfp = fingerprint({"ids": tensor_hash(ids), "attn": s.attn_options, "mlp": s.mlp_options, "cfg": cfg.raw,
                       "in": str(in_dir.resolve())})
    job.reset_if_changed("measure", mfp, ("measurement.json", "measure_hidden.safetensors"))
    meas = job.read_json("measurement.json") or {"measurement": {}, "last_module_idx": -1}
    done = job.data.get("measure_layers", 0)
    x = (job.read_tensors("measure_hidden.safetensors")["x"] if done else
         ops.embedding(ids.flatten(), weights.embed_tokens).float().reshape(*ids.shape, -1))
    n_opt = len(s.attn_options or OPTION_TABLES["attn"]) + len(s.mlp_options or OPTION_TABLES["mlp"])
    bar = tqdm(total=cfg.num_hidden_layers * n_opt, initial=done * n_opt, desc="measuring", unit="opt",
               disable=not s.progress, file=sys.stderr)
    for i in range(done, cfg.num_hidden_layers):
        lw = weights.layers[i]
        for kind, sub in (("attn", s.attn_options), ("mlp", s.mlp_options)):
            recs, x = measure_block(kind, x, lw, cfg, inv_freq, sub, step=bar.update)
            if max(r["accuracy"] for r in recs) < 0.1:
                raise ModelFormatError(f"layer {i} {kind}: best accuracy {max(r['accuracy'] for r in recs):.3f} "
                                       "< 0.1; the model or calibration data looks broken")
            meas["measurement"][block_key(i, kind)] = recs
        meas["last_module_idx"] = i
        job.write_tensors("measure_hidden.safetensors", {"x": x})
        job.write_json("measurement.json", meas)
        job.data["measure_layers"] = i + 1
        job.save()
    bar.close()
    return meas


def convert(in_dir: str | Path, out_dir: str | Path, settings: ConvertSettings | None = None, *,
            texts: list[str] | None = None, on_layer_done: Callable[[int], None] | None = None) -> dict:
    """Run the whole conversion; returns a summary (achieved bpw, timings, resumed layers, calibration ppl)."""
    s = settings or ConvertSettings()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    t0 = time.perf_counter()
    cfg, weights = _check_input(in_dir, out_dir, s)
    job = JobState(s.work_dir or f"{out_dir}.work")
    ids, dataset = calibration_rows(in_dir, cfg, s, texts)  # int64 [rows, length]
    inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    numel = _decoder_numel(cfg)
    timings = {}

    # measurement (or a given measurement.json)
    keys = [block_key(i, k) for i in range(cfg.num_hidden_layers) for k in ("attn", "mlp")]
    if s.measurement:
        meas = _load_measurement(s.measurement, keys)
    else:
        _check_budget(cfg, s, numel)
        meas = _measure(job, cfg, weights, ids[: s.measure_rows], s, inv_freq, in_dir)
    timings["measure_s"] = time.perf_counter() - t0

    # optimize
    slots = [meas["measurement"][k] for k in keys]
    choice = optimize(slots, numel, s.bpw)
    strategy = {k: slots[j][c] for j, (k, c) in enumerate(zip(keys, choice))}
    bpw = achieved_bpw(slots, choice, numel)
    log.info("strategy: %.4f bpw (target %.3f)", bpw, s.bpw)

    # quant pass, layer by layer, resumable
    qfp = fingerprint({"in": str(in_dir.resolve()), "ids": tensor_hash(ids), "strategy": strategy,
                       "head_bits": s.head_bits, "cfg": cfg.raw})
    job.reset_if_changed("quant", qfp, ("layers", "quant_hidden.safetensors", "head.safetensors"))
    job.write_json("strategy.json", strategy)
    done = job.data.get("quant_layers", 0)
    resumed = done
    t1 = time.perf_counter()
    x = (job.read_tensors("quant_hidden.safetensors")["x"] if done else
         ops.embedding(ids.flatten(), weights.embed_tokens).float().reshape(*ids.shape, -1))
    for i in tqdm(range(done, cfg.num_hidden_layers), initial=done, total=cfg.num_hidden_layers,
                  desc="quantizing", unit="layer", disable=not s.progress, file=sys.stderr):
        tensors, x = quantize_layer(i, x, weights.layers[i], cfg, inv_freq, strategy)
        job.write_tensors(f"layers/{i}.safetensors", tensors)
        job.write_tensors("quant_hidden.safetensors", {"x": x})
        job.data["quant_layers"] = i + 1
        job.save()
        if on_layer_done is not None:
            on_layer_done(i)
    if not job.data.get("quant_head"):
        head_w = weights.lm_head.weight if isinstance(weights.lm_head, DenseLinear) else weights.embed_tokens
        head_tensors, ppl = quantize_head(head_w, x, weights.norm, cfg, ids, s.head_bits)
        job.write_tensors("head.safetensors", head_tensors)
        job.data.update(quant_head=True, calibration_ppl=ppl)
        job.save()
    timings["quant_s"] = time.perf_counter() - t1

    # write the model directory
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": weights.embed_tokens}
    for i, lw in enumerate(weights.layers):
        layer = job.read_tensors(f"layers/{i}.safetensors")
        out[f"model.layers.{i}.input_layernorm.weight"] = lw.input_layernorm
        out.update({k: v for k, v in layer.items() if ".self_attn." in k})
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = lw.post_attention_layernorm
        out.update({k: v for k, v in layer.items() if ".mlp." in k})
    out["model.norm.weight"] = weights.norm
    out.update(job.read_tensors("head.safetensors"))
    config_dict = {k: v for k, v in cfg.raw.items() if k != "quantization_config"}
    config_dict["torch_dtype"] = "float16"
    qcfg = make_quantization_config(s.bpw, s.head_bits, {"rows": int(ids.shape[0]), "length": int(ids.shape[1]),
                                                         "dataset": dataset})
    write_model_dir(out_dir, config_dict, out, shard_mb=s.shard_mb, quantization_config=qcfg, copy_from=in_dir)
    if not s.measurement:
        shutil.copyfile(job.dir / "measurement.json", out_dir / "measurement.json")
    timings["total_s"] = time.perf_counter() - t0
    summary = {"achieved_bpw": bpw, "target_bpw": s.bpw, "resumed_layers": resumed,
               "calibration_ppl": job.data.get("calibration_ppl"), "timings": timings,
               "settings": {k: v for k, v in asdict(s).items() if k != "progress"}, "work_dir": str(job.dir)}
    job.write_json("summary.json", summary)
    return summary
