"""`LoadSettings`: everything a user sets when loading a model, validated at the edge (decision 10)."""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from exl2_backend.cache.kv_types import CACHE_TYPE_NAMES
from exl2_backend.errors import ConfigError
from exl2_backend.spec.config import DEFAULT_NUM_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS, NgramConfig

CACHE_TYPES = CACHE_TYPE_NAMES  # fp16, fp8, q8, q6, q4 (exl2_backend/cache/kv_types.py)
DEFAULT_MAX_SEQ_LEN = 4096
CPU_CACHE_BUDGET_BYTES = 2 << 30  # default KV cache size limit on CPU
CUDA_CACHE_FRACTION = 0.5  # of the free GPU memory after the weights, for the default KV cache


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda if available else cpu; anything else as given (plans may name devices of another
    machine; require_device checks that one exists here)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def require_device(device: str) -> torch.device:
    """resolve_device, for a load on this machine: a CUDA device that is not here is a ConfigError naming
    `device`, not torch's AssertionError from deep inside the load."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {device!r}: no CUDA device is available here (torch {torch.__version__}, "
                              f"built {'with' if torch.version.cuda else 'without'} CUDA); use 'cpu' or 'auto'",
                              field="device")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: only {count} CUDA device(s) are visible (cuda:0 .. "
                              f"cuda:{count - 1})", field="device")
    return dev


class LoadSettings(BaseModel):
    """How to load a model. `None` fields are filled from the model's config by `resolve(...)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path | None = None
    device: str = "auto"
    max_seq_len: int | None = Field(default=None, ge=2)
    cache_tokens: int | None = Field(default=None, ge=16)
    page_size: int = 256
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    max_chunk_size: int = Field(default=2048, ge=1)  # prompt tokens of one sequence per prefill step
    max_input_len: int | None = Field(default=None, ge=1)  # tokens of one forward in all; None: max_chunk_size
    prefix_caching: bool = True  # reuse the KV pages of cached prompt prefixes (cache/prefix.py)
    cache_type: str = "fp16"
    use_cuda_graphs: bool = True
    # Multi-GPU (exl2_backend/plan/, model/split.py, model/tensor_parallel.py): a layer split with a budget in GB
    # (1e9 bytes) per device, an automatic split over every visible GPU, or tensor parallelism over N GPUs.
    gpu_split: tuple[float, ...] | None = None
    autosplit: bool = False
    tensor_parallel: int = Field(default=1, ge=1, le=64)
    # Speculative decoding (exl2_backend/spec/): a draft model directory and/or n-gram (prompt-lookup) drafts.
    draft_model: Path | None = None
    num_speculative_tokens: int = Field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, ge=1, le=MAX_SPECULATIVE_TOKENS)
    ngram: bool | NgramConfig = False
    adaptive_speculation: bool = False  # move k within [0, 2 * num_speculative_tokens] from the acceptance rate

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        v = v.strip().lower()
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {v!r}")

    @field_validator("page_size")
    @classmethod
    def _check_page_size(cls, v: int) -> int:
        if v < 16 or v > 1024 or v & (v - 1):
            raise ValueError(f"page_size must be a power of two between 16 and 1024 (256 is the default), got {v}")
        return v

    @field_validator("cache_type")
    @classmethod
    def _check_cache_type(cls, v: str) -> str:
        v = v.strip().lower()
        if v not in CACHE_TYPES:
            raise ValueError(f"cache_type must be one of {CACHE_TYPES}, got {v!r}")
        return v

    @field_validator("gpu_split")
    @classmethod
    def _check_gpu_split(cls, v):
        if v is not None and (not v or any(not (x > 0) for x in v)):
            raise ValueError(f"gpu_split must list a positive budget in GB per device, e.g. [20, 23], got {list(v)}")
        return v

    @model_validator(mode="after")
    def _check_multi_gpu(self) -> LoadSettings:
        modes = [n for n, on in (("gpu_split", self.gpu_split), ("autosplit", self.autosplit),
                                 ("tensor_parallel", self.tensor_parallel > 1)) if on]
        if len(modes) > 1:
            raise ValueError(f"choose one of gpu_split, autosplit and tensor_parallel > 1 (got {', '.join(modes)})")
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> LoadSettings:
        if self.max_seq_len is not None and self.cache_tokens is not None and self.cache_tokens < self.max_seq_len:
            raise ValueError(f"cache_tokens ({self.cache_tokens}) must be >= max_seq_len ({self.max_seq_len}) so "
                             "one full-length sequence fits; raise cache_tokens or lower max_seq_len")
        return self

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def speculative(self) -> bool:
        """Whether decode steps speculate (a draft model or n-gram drafting is configured)."""
        return self.draft_model is not None or bool(self.ngram)

    def resolve(self, config, bytes_per_token: int, free_bytes: int | None = None) -> LoadSettings:
        """Concrete settings for a model: device, max_seq_len, cache_tokens filled in.

        max_seq_len defaults to min(max_position_embeddings, 4096); cache_tokens to max_seq_len *
        max_batch_size, capped by a memory budget (2 GiB on CPU, half the free GPU memory on CUDA) but
        never below max_seq_len."""
        device = resolve_device(self.device)
        max_seq_len = self.max_seq_len or min(int(config.max_position_embeddings), DEFAULT_MAX_SEQ_LEN)
        if self.max_seq_len is not None and self.max_seq_len > config.max_position_embeddings:
            raise ConfigError(f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings="
                              f"{config.max_position_embeddings}; lower max_seq_len", field="max_seq_len")
        if self.max_seq_len is None and self.cache_tokens is not None:
            max_seq_len = min(max_seq_len, self.cache_tokens)  # a defaulted context never exceeds the cache
        cache_tokens = self.cache_tokens
        if cache_tokens is None:
            budget = CPU_CACHE_BUDGET_BYTES if device.type == "cpu" else int((free_bytes or 0) * CUDA_CACHE_FRACTION)
            cache_tokens = min(max_seq_len * self.max_batch_size, budget // max(bytes_per_token, 1))
            cache_tokens = max(cache_tokens, max_seq_len)
        # max_input_len bounds one forward's tokens (and so prefill scratch memory); a chunk never exceeds it
        max_input_len = self.max_input_len or self.max_chunk_size
        return self.model_copy(update={"device": str(device), "max_seq_len": max_seq_len, "cache_tokens": cache_tokens,
                                       "max_input_len": max_input_len,
                                       "max_chunk_size": min(self.max_chunk_size, max_input_len)})
