"""Index of the tensors in every *.safetensors file of a model directory, with headers validated first.

EXL2 directories carry no trustworthy index JSON (the converter may copy a stale one from the source model),
so the shards are globbed and each header is parsed here before safetensors touches the file: a truncated
download or a garbage header then fails with the file and tensor named, not deep inside a library.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from exl2_backend.errors import CorruptFileError, MissingTensorError, ModelDirectoryError, ModelFormatError

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. begin/end are byte offsets into the data section (after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")


def _check_shard_numbering(files: list[Path], model_dir: Path) -> None:
    """Shards named `<stem>-00002-of-00003.safetensors` say how many there are: a missing one is named (it would
    otherwise surface as some tensor of it "not found")."""
    sets: dict[tuple[str, str], set[int]] = {}  # (stem, count as written) -> shard numbers present
    for f in files:
        m = _SHARD_NAME.match(f.name)
        if m:
            sets.setdefault((m["stem"], m["n"]), set()).add(int(m["i"]))
    for (stem, n_text), have in sets.items():
        n = int(n_text)
        missing = sorted(set(range(1, n + 1)) - have)
        if missing:
            name = f"{stem}-{missing[0]:0{len(n_text)}d}-of-{n_text}.safetensors"  # numbers as wide as the count
            raise ModelDirectoryError(f"shard {missing[0]} of {n} is missing ({name}; "
                                      f"{len(missing)} missing in all)", path=str(model_dir / name))


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header: lengths, JSON, dtypes, shapes and offsets against the file size."""
    p = str(path)
    try:
        if not path.is_file():  # a directory named *.safetensors, a broken link, a link loop
            raise CorruptFileError("is not a regular file (a directory, or a link to nothing)", path=p)
        size = path.stat().st_size
    except OSError as e:  # stat itself failing (permissions, I/O)
        raise CorruptFileError(f"cannot be read: {e.strerror or e}", path=p) from e
    if size < 8:
        raise CorruptFileError(f"file is {size} bytes, shorter than the 8-byte header length", path=p)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > _MAX_HEADER:
            raise CorruptFileError(f"header length {n} exceeds the file size {size} (truncated or not safetensors)",
                                   path=p)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"header is not valid JSON: {e}", path=p) from e
    if not isinstance(header, dict):
        raise CorruptFileError("header is not a JSON object", path=p)
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CorruptFileError("header entry is not an object", path=p, tensor=name)
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise CorruptFileError(f"unknown dtype {dtype!r}", path=p, tensor=name)
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise CorruptFileError(f"invalid shape {shape!r}", path=p, tensor=name)
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise CorruptFileError(f"invalid data_offsets {offs!r}", path=p, tensor=name)
        if offs[1] > data_size:
            raise CorruptFileError(
                f"data ends at byte {offs[1]} but the file holds only {data_size} data bytes (truncated file)",
                path=p, tensor=name)
        if offs[1] - offs[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CorruptFileError(f"data_offsets {offs} do not match shape {shape} of {dtype}", path=p, tensor=name)
        out[name] = TensorInfo(name, dtype, tuple(shape), path, offs[0], offs[1])
    pos = 0
    for info in sorted(out.values(), key=lambda i: (i.begin, i.end)):
        if info.begin != pos:  # the library rejects holes and overlaps; say which tensor first
            raise CorruptFileError(f"data_offsets start at {info.begin}, expected {pos} (gap or overlap)",
                                   path=p, tensor=info.name)
        pos = info.end
    return out


class ShardIndex:
    """All tensors of all *.safetensors files in `model_dir`, read lazily through memory-mapped handles."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise ModelDirectoryError("model directory does not exist", path=str(self.model_dir))
        self.files: list[Path] = sorted(self.model_dir.glob("*.safetensors"))
        if not self.files:
            raise ModelDirectoryError("no *.safetensors files in the model directory", path=str(self.model_dir))
        _check_shard_numbering(self.files, self.model_dir)
        self._infos: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_header(f).items():
                if name in self._infos:
                    raise ModelFormatError(f"tensor appears in two shards (also in {self._infos[name].file.name})",
                                           path=str(f), tensor=name)
                self._infos[name] = info
        self._handles: dict[Path, object] = {}

    def keys(self) -> list[str]:
        return list(self._infos)

    def infos(self) -> list[TensorInfo]:
        return list(self._infos.values())

    def has(self, key: str) -> bool:
        return key in self._infos

    def __contains__(self, key: str) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise MissingTensorError("tensor not found in any *.safetensors file",
                                     path=str(self.model_dir), tensor=key) from None

    def file_of(self, key: str) -> Path:
        return self.info(key).file

    def get(self, key: str) -> torch.Tensor:
        """Load one tensor (CPU). Errors from the safetensors library become CorruptFileError."""
        info = self.info(key)
        try:
            handle = self._handles.get(info.file)
            if handle is None:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            return handle.get_tensor(key)
        except Exception as e:
            raise CorruptFileError(f"cannot read tensor: {e}", path=str(info.file), tensor=key) from e

    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> ShardIndex:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()
