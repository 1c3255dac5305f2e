"""Engine layer: load settings, sequences over a paged KV cache, the step API, generation helpers."""

from exl2_backend.runtime.engine import Engine  # noqa: F401
from exl2_backend.runtime.params import GenerationParams, StepEvent  # noqa: F401
from exl2_backend.runtime.settings import LoadSettings  # noqa: F401
