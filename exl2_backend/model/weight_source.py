"""Where a model's weights come from, as a small picklable object: tensor-parallel ranks (separate processes)
each rebuild the weights from it instead of receiving tensors. `DirSource` reads a model directory; the
benchmarks' `bench.random_weights.RandomSource` generates random EXL2 weights directly on a device."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DirSource:
    """A model directory (EXL2 or FP16), read with format.reader.load_weights."""

    model_dir: str

    def config(self):
        from exl2_backend.format.config import ModelConfig

        return ModelConfig.from_dir(self.model_dir)

    def weights(self, config, device: torch.device):
        """ModelWeights on the CPU (memory-mapped reads); the model moves what it keeps to `device`."""
        from exl2_backend.format.reader import load_weights

        return load_weights(self.model_dir, config)
