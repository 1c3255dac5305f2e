"""Plugin contract of exl2_backend: pluggy hookspecs, request/event types, the entry-point backend, discovery.

Import-light on purpose (no torch): hosts import this package to discover and drive backends.
"""

from exl2_backend._version import HOOK_API_VERSION
from exl2_backend.plugin.hookspecs import ENTRY_POINT_GROUP, HOOK_NAMES, PROJECT, hookimpl, hookspec
from exl2_backend.plugin.manager import get_plugin_manager, new_plugin_manager
from exl2_backend.plugin.manifest import read_manifest
from exl2_backend.plugin.types import (
    AdmissionRejected,
    BackendError,
    BackendHandle,
    EngineLimits,
    EngineUnhealthy,
    Event,
    SequenceFailed,
    SequenceRequest,
    StepBatch,
    Timings,
    Usage,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOK_API_VERSION",
    "HOOK_NAMES",
    "PROJECT",
    "AdmissionRejected",
    "BackendError",
    "BackendHandle",
    "EngineLimits",
    "EngineUnhealthy",
    "Event",
    "SequenceFailed",
    "SequenceRequest",
    "StepBatch",
    "Timings",
    "Usage",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "new_plugin_manager",
    "read_manifest",
]
