"""Resumable converter state in a work directory.

Layout: `job.json` (fingerprints and progress counters), `measurement.json` (partial while measuring),
`measure_hidden.safetensors` / `quant_hidden.safetensors` (the residual stream after the last finished layer),
`layers/<i>.safetensors` (quantized tensors of finished layers), `head.safetensors`. Every file is written to a
temporary name and renamed, and job.json is updated only after the files it points at exist, so an
interruption at any moment leaves a state that a rerun continues from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exl2_backend.errors import ModelDirectoryError


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


class JobState:
    def __init__(self, work_dir: str | Path):
        self.dir = Path(work_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "layers").mkdir(exist_ok=True)
        except OSError as exc:  # a path through a file, a read-only or virtual file system
            raise ModelDirectoryError(f"cannot create the work directory: {exc.strerror or exc}",
                                      path=str(self.dir)) from None
        p = self.dir / "job.json"
        self.data: dict = json.loads(p.read_text()) if p.is_file() else {}

    def save(self) -> None:
        tmp = self.dir / "job.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.dir / "job.json")

    def reset_if_changed(self, stage: str, fp: str, drop: tuple[str, ...]) -> None:
        """Forget `stage`'s progress (and files `drop`) when its inputs' fingerprint changed."""
        if self.data.get(f"{stage}_fp") == fp:
            return
        for k in [k for k in self.data if k.startswith(f"{stage}_")]:
            del self.data[k]
        for name in drop:
            p = self.dir / name
            if p.is_dir():
                shutil.rmtree(p)
                p.mkdir()
            elif p.exists():
                p.unlink()
        self.data[f"{stage}_fp"] = fp
        self.save()

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.dir / name
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.dir / name))

    def write_json(self, name: str, obj) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, self.dir / name)

    def read_json(self, name: str):
        p = self.dir / name
        return json.loads(p.read_text()) if p.is_file() else None
