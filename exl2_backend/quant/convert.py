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
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from exl2_backend.errors import ConfigError, ModelDirectoryError, ModelFormatError, UnsupportedModelError
from exl2_backend.format.config import ModelConfig
from exl2_backend.format.layout import HEAD_OPTIONS, QuantOption
from exl2_backend.format.qtensor import QTensor
from exl2_backend.format.reader import ATTN_PROJS, MLP_PROJS, DenseLinear, linear_shape, load_weights
from exl2_backend.format.writer import make_quantization_config, write_model_dir
from exl2_backend.ops import reference as ops
from exl2_backend.quant.job import JobState, fingerprint, tensor_hash
from exl2_backend.quant.layer_quant import METHODS, calibration_ids, quantize_head, quantize_layer, spread
from exl2_backend.quant.measure import DEFAULT_OPTIONS, OPTION_TABLES, block_key, measure_block, record_options
from exl2_backend.quant.optimize import BudgetError, achieved_bpw, bpw_range, optimize

log = logging.getLogger(__name__)


# Calibration sizes by device: (quant rows, tokens per row, measurement rows). The CPU defaults keep a
# SmolLM2-sized conversion to minutes on two cores; the GPU ones are near ExLlamaV2's (100/16 rows of 2048).
CPU_DEFAULTS = (32, 512, 8)
CUDA_DEFAULTS = (64, 2048, 16)


@dataclass
class ConvertSettings:
    bpw: float = 4.0
    head_bits: int = 6
    cal_files: Sequence[str] | None = None  # None: the built-in offline calibration texts
    measurement: str | None = None  # reuse this measurement.json instead of measuring
    rows: int | None = None  # quant-pass rows (None: CPU_DEFAULTS / CUDA_DEFAULTS by device)
    length: int | None = None  # tokens per row
    measure_rows: int | None = None
    attn_options: Sequence[int] | None = DEFAULT_OPTIONS["attn"]  # measured subset (None: all 19)
    mlp_options: Sequence[int] | None = DEFAULT_OPTIONS["mlp"]  # measured subset (None: all 17)
    work_dir: str | None = None
    shard_mb: float = 8192
    progress: bool = True
    device: str = "auto"  # "auto" (cuda when present), "cpu", "cuda", "cuda:N"
    method: str = "gptq"  # "gptq", or "rtn" (round-to-nearest, no act-order: a baseline)
    uniform: str | None = None  # one option ("4:1@128") for every decoder linear: no measurement, no optimizer
    tf32: bool = False  # GPU only: TF32 matmuls for block forwards and Hessians (GPTQ itself stays fp32)
    checkpoint_s: float = 30.0  # save the resumable hidden state at most this often (0: after every layer)

    def sizes(self, device: torch.device, max_positions: int | None = None) -> tuple[int, int, int]:
        """(rows, length, measure_rows) with the device defaults filled in (the default length no longer than
        the model's positions)."""
        d = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
        length = self.length or min(d[1], max_positions or d[1])
        return (self.rows or d[0], length, self.measure_rows or d[2])


def resolve_device(name: str) -> torch.device:
    """"auto" -> the GPU when torch sees one, else the CPU; a CUDA device that is not here is an error
    (runtime.settings.require_device, as for a load), and so is a device the converter does not run on."""
    from exl2_backend.runtime.settings import require_device

    try:
        dev = require_device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r} (auto, cpu, cuda, cuda:N)", field="device") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported by the converter (cpu or cuda)", field="device")
    return dev


@contextmanager
def _matmul_tf32(enabled: bool):
    """TF32 matmuls inside the block (restored after), when asked for on a GPU."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _check_output(in_dir: Path, out_dir: Path) -> None:
    """Before any work: the output replaces a directory atomically (format/writer.py), so it must not hold the
    input (an output that was an ancestor of the input deleted the input), lie inside it, or be anything but an
    earlier EXL2 output, an empty directory or a new path (a file, or another model, would be lost or refused
    only after the whole conversion)."""
    src, out = in_dir.resolve(), out_dir.resolve()
    if out == src or out in src.parents or src in out.parents:
        raise ModelDirectoryError("the output directory must not be, contain or lie inside the input directory "
                                  f"({src})", path=str(out_dir))
    if out.exists() and not out.is_dir():
        raise ModelDirectoryError("the output path exists and is not a directory", path=str(out_dir))
    if out.is_dir() and any(out.iterdir()):
        try:
            earlier = json.loads((out / "config.json").read_text()).get("quantization_config", {})
        except (OSError, ValueError, AttributeError):
            earlier = {}
        if not isinstance(earlier, dict) or earlier.get("quant_method") != "exl2":
            raise ModelDirectoryError("refusing to replace a non-empty directory that is not an earlier EXL2 "
                                      "output (its config.json has no exl2 quantization_config)", path=str(out_dir))


def _check_input(in_dir: Path, out_dir: Path, s: ConvertSettings) -> tuple[ModelConfig, object]:
    cfg = ModelConfig.from_dir(in_dir)  # raises for a missing dir/config and unsupported architectures
    _check_output(in_dir, out_dir)
    if s.head_bits not in HEAD_OPTIONS:
        raise ConfigError(f"head bits must be one of {sorted(HEAD_OPTIONS)}, got {s.head_bits}", field="head_bits")
    if any(v is not None and v < 1 for v in (s.rows, s.measure_rows)):
        raise ConfigError("calibration rows must be positive", field="rows")
    if s.length is not None and not 2 <= s.length <= cfg.max_position_embeddings:
        # one token has no next token to score (the calibration perplexity was nan); past the model's positions
        # the calibration runs where the model was never trained
        raise ConfigError(f"calibration length must be within [2, {cfg.max_position_embeddings}] (the model's "
                          f"max_position_embeddings), got {s.length}", field="length")
    if not s.shard_mb > 0:
        raise ConfigError(f"shard size must be positive, got {s.shard_mb} MB", field="shard_mb")
    if s.method not in METHODS:
        raise ConfigError(f"method must be one of {METHODS}, got {s.method!r}", field="method")
    if s.uniform is not None:
        try:
            QuantOption.parse(s.uniform)
        except ValueError as e:
            raise ConfigError(f"bad uniform option: {e}", field="uniform") from None
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


def decoder_numel(cfg: ModelConfig) -> int:
    """Sum of K*N over all decoder linears: the bpw denominator (format doc c; ExLlamaV2's norms count 0)."""
    return cfg.num_hidden_layers * sum(k * n for k, n in (linear_shape(cfg, p) for p in ATTN_PROJS + MLP_PROJS))


def _block_bits(cfg: ModelConfig, kind: str, options) -> int:
    projs = ATTN_PROJS if kind == "attn" else MLP_PROJS
    return sum(o.total_bits(*linear_shape(cfg, p), bias=cfg.has_bias(p)) for o, p in zip(options, projs))


def _check_budget(cfg: ModelConfig, s: ConvertSettings, numel: int) -> None:
    """Fail before the slow measurement if the target bpw is outside what the measured options can reach."""
    slots = []
    for kind, sub in (("attn", s.attn_options), ("mlp", s.mlp_options)):
        table = OPTION_TABLES[kind]
        slots.append([{"total_bits": _block_bits(cfg, kind, table[i])}
                      for i in (sub if sub is not None else range(len(table)))])
    lo, hi = bpw_range(slots * cfg.num_hidden_layers, numel)
    if not lo - 1e-9 <= s.bpw <= hi + 1e-9:
        raise BudgetError(f"target {s.bpw} bpw is outside what the measured options allow ({lo:.3f} .. {hi:.3f})")


def uniform_strategy(cfg: ModelConfig, option: str) -> dict:
    """The same option for every decoder linear, as strategy records (no accuracy: nothing was measured)."""
    opt = QuantOption.parse(option)
    out = {}
    for i in range(cfg.num_hidden_layers):
        for kind, projs in (("attn", ATTN_PROJS), ("mlp", MLP_PROJS)):
            out[block_key(i, kind)] = {"accuracy": None, "total_bits": _block_bits(cfg, kind, [opt] * len(projs)),
                                       **{p: opt.to_json() for p in projs}}
    return out


def _load_measurement(path: str, cfg: ModelConfig, keys: list[str]) -> dict:
    """A measurement.json (ours or ExLlamaV2's) checked against this model before the optimizer trusts it: every
    block of the model and no other, accuracies finite in [0, 1], each record's options valid for the block's
    shapes and its total_bits what they cost here. A measurement of another model recorded other bit counts
    (a "2.0 bpw" conversion came out at 7.7), and NaN accuracies made the optimizer pick the cheapest options."""
    p = Path(path)
    if not p.is_file():
        raise ModelDirectoryError("measurement file not found", path=str(p))

    def bad(why: str) -> ModelFormatError:
        return ModelFormatError(f"not a measurement.json for this model: {why}", path=str(p))

    try:
        meas = json.loads(p.read_text())
        table = meas["measurement"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if not isinstance(table, dict):
        raise bad("'measurement' is not an object")
    extra = sorted(set(table) - set(keys))
    if extra:
        raise bad(f"it has blocks this model lacks ({extra[0]}; the model has {cfg.num_hidden_layers} layers)")
    kinds = {block_key(i, k): k for i in range(cfg.num_hidden_layers) for k in ("attn", "mlp")}
    for key in keys:
        recs = table.get(key)
        if not isinstance(recs, list) or not recs:
            raise bad(f"block {key} has no records")
        kind = kinds[key]
        for r in recs:
            acc = r.get("accuracy") if isinstance(r, dict) else None
            if isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0 <= acc <= 1:  # NaN fails too
                raise bad(f"block {key}: accuracy {acc!r} is not a number in [0, 1]")
            try:
                options = record_options(r, kind)
                bits = _block_bits(cfg, kind, [options[q] for q in (ATTN_PROJS if kind == "attn" else MLP_PROJS)])
            except (KeyError, TypeError, ValueError) as e:
                raise bad(f"block {key}: a record's options are invalid here ({type(e).__name__}: {e})") from None
            recorded = r.get("total_bits")
            # within 1%: another writer's rounding; another model's shapes are off by whole factors
            if isinstance(recorded, bool) or not isinstance(recorded, (int, float)) or \
                    not abs(recorded - bits) <= 0.01 * bits:
                raise bad(f"block {key}: a record says {recorded!r} bits where its options cost {bits} in this "
                          "model (a measurement of another model?)")
    return meas


def _weights_identity(in_dir: Path) -> list:
    """The source shards' names, sizes and modification times: a resumed job whose source weights changed
    starts again (it reused quantized layers of the old weights, silently)."""
    stats = [(f.name, f.stat()) for f in sorted(in_dir.glob("*.safetensors"))]
    return [(name, st.st_size, st.st_mtime_ns) for name, st in stats]


class _Checkpoint:
    """Decides when to save the resumable state: after the first layer, at most every `every_s` seconds after
    that, and after the last layer (saving a big hidden state every layer costs real time on a GPU)."""

    def __init__(self, every_s: float):
        self.every_s, self.last = every_s, None

    def due(self, layer: int, last_layer: int) -> bool:
        now = time.perf_counter()
        if self.last is None or layer == last_layer or now - self.last >= self.every_s:
            self.last = now
            return True
        return False


def _embed(ids: torch.Tensor, weights, dev: torch.device) -> torch.Tensor:
    """ids [R, T] -> fp32 embeddings [R, T, H] on dev."""
    return weights.embed_tokens.index_select(0, ids.flatten()).to(dev, torch.float32).reshape(*ids.shape, -1)


def _measure(job: JobState, cfg, weights, ids, s: ConvertSettings, inv_freq, in_dir: Path, dev) -> dict:
    mfp = fingerprint({"ids": tensor_hash(ids), "attn": s.attn_options, "mlp": s.mlp_options, "cfg": cfg.raw,
                       "in": str(in_dir.resolve()), "weights": _weights_identity(in_dir)})
    job.reset_if_changed("measure", mfp, ("measurement.json", "measure_hidden.safetensors"))
    meas = job.read_json("measurement.json") or {"measurement": {}, "last_module_idx": -1}
    done = job.data.get("measure_layers", 0)
    x = (job.read_tensors("measure_hidden.safetensors")["x"].to(dev) if done else _embed(ids, weights, dev))
    n_opt = len(s.attn_options or OPTION_TABLES["attn"]) + len(s.mlp_options or OPTION_TABLES["mlp"])
    bar = tqdm(total=cfg.num_hidden_layers * n_opt, initial=done * n_opt, desc="measuring", unit="opt",
               disable=not s.progress, file=sys.stderr)
    ckpt = _Checkpoint(s.checkpoint_s)
    for i in range(done, cfg.num_hidden_layers):
        lw = weights.layers[i]
        for kind, sub in (("attn", s.attn_options), ("mlp", s.mlp_options)):
            with _matmul_tf32(s.tf32 and dev.type == "cuda"):
                recs, x = measure_block(kind, x, lw, cfg, inv_freq, sub, step=bar.update)
            if max(r["accuracy"] for r in recs) < 0.1:
                raise ModelFormatError(f"layer {i} {kind}: best accuracy {max(r['accuracy'] for r in recs):.3f} "
                                       "< 0.1; the model or calibration data looks broken")
            meas["measurement"][block_key(i, kind)] = recs
        meas["last_module_idx"] = i
        if ckpt.due(i, cfg.num_hidden_layers - 1):
            job.write_tensors("measure_hidden.safetensors", {"x": x.cpu()})
            job.write_json("measurement.json", meas)
            job.data["measure_layers"] = i + 1
            job.save()
    bar.close()
    return meas


def _strategy(cfg, weights, ids, s: ConvertSettings, inv_freq, in_dir: Path, dev, job: JobState,
              numel: int) -> tuple[dict, float, bool]:
    """(strategy per block key, achieved decoder bpw, measured here?) from a uniform option, a given
    measurement.json, or a fresh measurement; the optimizer picks the options in the last two cases."""
    keys = [block_key(i, k) for i in range(cfg.num_hidden_layers) for k in ("attn", "mlp")]
    if s.uniform is not None:
        strategy = uniform_strategy(cfg, s.uniform)
        return strategy, sum(r["total_bits"] for r in strategy.values()) / numel, False
    if s.measurement:
        meas = _load_measurement(s.measurement, cfg, keys)
    else:
        _check_budget(cfg, s, numel)
        meas = _measure(job, cfg, weights, ids, s, inv_freq, in_dir, dev)
    slots = [meas["measurement"][k] for k in keys]
    choice = optimize(slots, numel, s.bpw)
    strategy = {k: slots[j][c] for j, (k, c) in enumerate(zip(keys, choice))}
    return strategy, achieved_bpw(slots, choice, numel), not s.measurement


def convert(in_dir: str | Path, out_dir: str | Path, settings: ConvertSettings | None = None, *,
            texts: list[str] | None = None, on_layer_done: Callable[[int], None] | None = None,
            on_linear: Callable[[str, torch.Tensor], None] | None = None) -> dict:
    """Run the whole conversion; returns a summary (achieved bpw, timings, resumed layers, calibration ppl).

    Hooks: `on_layer_done(i)` after layer i is saved; `on_linear(key, dequant fp16 [K, Np])` with the values each
    linear (head included) is meant to decode to, for linears quantized in this run."""
    s = settings or ConvertSettings()
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    t0 = time.perf_counter()
    dev = resolve_device(s.device)
    cfg, weights = _check_input(in_dir, out_dir, s)
    rows, length, measure_rows = s.sizes(dev, cfg.max_position_embeddings)
    job = JobState(s.work_dir or f"{out_dir}.work")
    n_rows = max(rows, measure_rows)
    all_ids, dataset = calibration_ids(in_dir, cfg, s.cal_files, n_rows, length, texts)  # int64 [n_rows, length]
    ids, measure_ids = all_ids[spread(n_rows, rows)], all_ids[spread(n_rows, measure_rows)]
    inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    numel = decoder_numel(cfg)
    timings = {"load_s": time.perf_counter() - t0}

    # measurement (or a given measurement.json, or a uniform option) and the optimizer
    t = time.perf_counter()
    strategy, bpw, measured = _strategy(cfg, weights, measure_ids, s, inv_freq, in_dir, dev, job, numel)
    timings["measure_s"] = time.perf_counter() - t
    log.info("strategy: %.4f bpw (target %.3f)", bpw, s.bpw)

    # quant pass, layer by layer, resumable
    qfp = fingerprint({"in": str(in_dir.resolve()), "ids": tensor_hash(ids), "strategy": strategy,
                       "head_bits": s.head_bits, "cfg": cfg.raw, "method": s.method,
                       "weights": _weights_identity(in_dir)})
    job.reset_if_changed("quant", qfp, ("layers", "quant_hidden.safetensors", "head.safetensors"))
    job.write_json("strategy.json", strategy)
    done = job.data.get("quant_layers", 0)
    resumed = done
    t = time.perf_counter()
    x = job.read_tensors("quant_hidden.safetensors")["x"].to(dev) if done else _embed(ids, weights, dev)
    ckpt = _Checkpoint(s.checkpoint_s)
    with _matmul_tf32(s.tf32 and dev.type == "cuda"):
        for i in tqdm(range(done, cfg.num_hidden_layers), initial=done, total=cfg.num_hidden_layers,
                      desc="quantizing", unit="layer", disable=not s.progress, file=sys.stderr):
            tensors, x = quantize_layer(i, x, weights.layers[i], cfg, inv_freq, strategy, s.method, on_linear)
            job.write_tensors(f"layers/{i}.safetensors", tensors)
            if ckpt.due(i, cfg.num_hidden_layers - 1):
                job.write_tensors("quant_hidden.safetensors", {"x": x.cpu()})
                job.data["quant_layers"] = i + 1
                job.save()
            if on_layer_done is not None:
                on_layer_done(i)
        timings["quant_layers_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if not job.data.get("quant_head"):
            head_w = weights.lm_head.weight if isinstance(weights.lm_head, DenseLinear) else weights.embed_tokens
            head_tensors, ppl = quantize_head(head_w, x, weights.norm, cfg, ids, s.head_bits, s.method, on_linear)
            job.write_tensors("head.safetensors", head_tensors)
            job.data.update(quant_head=True, calibration_ppl=ppl)
            job.save()
        timings["head_s"] = time.perf_counter() - t
    timings["quant_s"] = timings["quant_layers_s"] + timings["head_s"]
    del x

    # write the model directory
    t = time.perf_counter()
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
    calibration = {"rows": int(ids.shape[0]), "length": int(ids.shape[1]), "dataset": dataset}
    qcfg = make_quantization_config(round(bpw, 3) if s.uniform else s.bpw, s.head_bits, calibration)
    if s.uniform or s.method != "gptq":
        qcfg["recipe"] = {"method": s.method, "uniform": s.uniform}
    write_model_dir(out_dir, config_dict, out, shard_mb=s.shard_mb, quantization_config=qcfg, copy_from=in_dir)
    if measured:
        shutil.copyfile(job.dir / "measurement.json", out_dir / "measurement.json")
    timings["write_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    summary = {"achieved_bpw": bpw, "target_bpw": s.bpw, "resumed_layers": resumed,
               "calibration_ppl": job.data.get("calibration_ppl"), "timings": timings, "device": str(dev),
               "layers": cfg.num_hidden_layers, "sizes": {"rows": rows, "length": length, "measure_rows": measure_rows},
               "settings": {k: v for k, v in asdict(s).items() if k != "progress"}, "work_dir": str(job.dir)}
    job.write_json("summary.json", summary)
    return summary
