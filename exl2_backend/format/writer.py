"""Write an EXL2 (or FP16) model directory: sharded safetensors, config.json, copied tokenizer files.

Shards are streamed tensor by tensor (header first, then each tensor's bytes), so a writer can generate
tensors one at a time without holding a whole shard twice in memory. The directory is assembled in a
temporary sibling and renamed into place, so an interrupted write never leaves a half-valid model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from exl2_backend._version import __version__
from exl2_backend.errors import ModelDirectoryError, ModelFormatError
from exl2_backend.format.qtensor import QTensor

# ExLlamaV2's reader knows only these (format doc a.1); anything else makes the file unloadable there.
WRITABLE_DTYPES = {torch.int32: "I32", torch.int16: "I16", torch.float16: "F16", torch.bfloat16: "BF16",
                   torch.float32: "F32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # (name, dtype, shape)


def qtensor_tensors(qt: QTensor) -> dict[str, torch.Tensor]:
    """The `<key>.q_*` (and `<key>.bias`) entries of one quantized linear, in the converter's order."""
    out = {
        f"{qt.key}.q_weight": qt.q_weight,
        f"{qt.key}.q_scale": qt.q_scale,
        f"{qt.key}.q_scale_max": qt.q_scale_max,
        f"{qt.key}.q_groups": qt.q_groups,
        f"{qt.key}.q_invperm": qt.q_invperm.to(torch.int32),
    }
    if qt.bias is not None:
        out[f"{qt.key}.bias"] = qt.bias
    return out


def make_quantization_config(bits: float, head_bits: int, calibration: dict | None = None) -> dict:
    """The `quantization_config` block (format doc a.2); `bits` is the target decoder bpw."""
    return {"quant_method": "exl2", "version": __version__, "bits": float(bits), "head_bits": int(head_bits),
            "calibration": dict(calibration or {})}


def shard_file_names(n: int) -> list[str]:
    if n == 1:
        return ["output.safetensors"]
    return [f"output-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def plan_shards(specs: Sequence[TensorSpec], shard_mb: float) -> list[list[TensorSpec]]:
    """Greedy in order: start a new shard when adding a tensor would exceed shard_mb (never an empty shard)."""
    limit = shard_mb * 1024 * 1024
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec_nbytes(spec)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_safetensors(path: Path, specs: Sequence[TensorSpec], produce: Callable[[str], torch.Tensor]) -> None:
    """Write one file: header from `specs`, then `produce(name)` for each spec in order, streamed."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
        if dtype not in WRITABLE_DTYPES:
            raise ModelFormatError(f"dtype {dtype} cannot be written (allowed: I32, I16, F16, BF16, F32)", tensor=name)
        nbytes = spec_nbytes((name, dtype, shape))
        header[name] = {"dtype": WRITABLE_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # pad like the safetensors library does, keeping data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, dtype, shape in specs:
            t = produce(name).detach().to("cpu").contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ModelFormatError(f"produced {t.dtype} {tuple(t.shape)}, planned {dtype} {tuple(shape)}",
                                       path=str(path), tensor=name)
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are what matter
                t = t.view(torch.int16)
            if t.numel():
                f.write(memoryview(t.numpy()).cast("B"))


@contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `out_dir`; on success it replaces `out_dir`, on failure it is removed.

    An existing non-empty `out_dir` is replaced only if it looks like a model directory (has config.json).
    """
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").exists())):
        raise ModelDirectoryError("refusing to replace an existing non-empty directory that is not a model "
                                  "directory (no config.json)", path=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_config(out_dir: Path, config_dict: dict, quantization_config: dict | None = None) -> None:
    cfg = dict(config_dict)
    if quantization_config is not None:
        q = {"quant_method": "exl2", "version": __version__}
        q.update(quantization_config)
        cfg["quantization_config"] = q
    (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer/generation files present in `src` (never weights or a stale index JSON)."""
    copied = []
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copyfile(p, Path(dst) / name)
            copied.append(name)
    return copied


def write_model_dir(
    out_dir: str | Path,
    config_dict: dict,
    tensors: dict[str, torch.Tensor],
    *,
    shard_mb: float = 8192,
    quantization_config: dict | None = None,
    copy_from: str | Path | None = None,
) -> Path:
    """Write `tensors` (insertion order) to output[-0000i-of-0000N].safetensors plus config.json, atomically."""
    prepared: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".q_invperm", ".q_perm")) and t.dtype in (torch.int64, torch.int16):
            t = t.to(torch.int32)  # ExLlamaV2's reader has no I64; the converter writes I32
        prepared[name] = t
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in prepared.items()]
    shards = plan_shards(specs, shard_mb)
    with atomic_output_dir(out_dir) as tmp:
        for fname, shard in zip(shard_file_names(len(shards)), shards):
            write_safetensors(tmp / fname, shard, prepared.__getitem__)
        write_config(tmp, config_dict, quantization_config)
        if copy_from is not None:
            copy_tokenizer_files(copy_from, tmp)
    return Path(out_dir)


def spec_nbytes(spec: TensorSpec) -> int:
    _, dtype, shape = spec
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()
