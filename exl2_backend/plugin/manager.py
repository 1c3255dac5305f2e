"""The host side of plugin discovery: one pluggy PluginManager for the "exl2_backend" project.

`get_plugin_manager()` adds the hookspecs and loads every backend advertised under the entry-point group
`exl2_backend.backends`, once per process. A backend that fails to import or to register is skipped with
one log line; the others still load.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading

import pluggy

from exl2_backend.plugin import hookspecs

log = logging.getLogger("exl2_backend.plugin")

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_failures: dict[str, str] = {}

BUILTIN_MODULE = "exl2_backend.plugin.impl"
BUILTIN_NAME = "exl2"


def _entry_points():
    return list(importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))


def _load_one(pm: pluggy.PluginManager, name: str, value: str) -> None:
    """Load and register one entry point; on any failure leave the manager as it was and log why."""
    before = set(pm.get_plugins())
    try:
        pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP, name=name)
        pm.check_pending()  # an impl of a hook we do not specify is a broken plugin, not a silent no-op
    except Exception as exc:  # noqa: BLE001 - isolate one broken plugin from the rest
        for plugin in set(pm.get_plugins()) - before:
            pm.unregister(plugin)
        _failures[name] = f"{type(exc).__name__}: {exc}"
        log.warning("exl2_backend: skipping backend plugin %r (%s): %s: %s", name, value, type(exc).__name__, exc)


def new_plugin_manager(*, load_entrypoints: bool = True, builtin_fallback: bool = False) -> pluggy.PluginManager:
    """A fresh manager (tests, or hosts wanting their own). builtin_fallback registers this package's own
    backend when no entry point provided one (a source checkout that was never pip-installed)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if load_entrypoints:
        for ep in _entry_points():
            if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
                continue
            _load_one(pm, ep.name, ep.value)
    if builtin_fallback and not pm.has_plugin(BUILTIN_NAME):
        import importlib

        pm.register(importlib.import_module(BUILTIN_MODULE), name=BUILTIN_NAME)
        log.info("exl2_backend: no %r entry point found; registered the built-in backend %s",
                 BUILTIN_NAME, BUILTIN_MODULE)
    return pm


def get_plugin_manager(*, builtin_fallback: bool = False) -> pluggy.PluginManager:
    """The process-wide manager, loading entry points the first time (load-once; thread-safe)."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = new_plugin_manager(builtin_fallback=builtin_fallback)
        elif builtin_fallback and not _manager.has_plugin(BUILTIN_NAME):
            import importlib

            _manager.register(importlib.import_module(BUILTIN_MODULE), name=BUILTIN_NAME)
        return _manager


def plugin_failures() -> dict[str, str]:
    """Entry points that failed to load in this process: name -> error."""
    return dict(_failures)


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests)."""
    global _manager
    with _lock:
        _manager = None
        _failures.clear()
