"""exl2_backend: run EXL2-quantized LLMs at full memory bandwidth, as a plugin backend for serving hosts."""

from exl2_backend import errors
from exl2_backend._version import HOOK_API_VERSION, __version__

__all__ = ["HOOK_API_VERSION", "__version__", "errors"]
