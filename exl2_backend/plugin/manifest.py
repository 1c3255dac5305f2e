"""Read plugin_manifest.toml (tomllib only: no torch, no import of the backend's code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from exl2_backend.errors import ConfigError

MANIFEST_NAME = "plugin_manifest.toml"
REQUIRED = ("name", "version", "hook_api_version", "formats", "architectures", "devices", "cache_types",
            "attention_backends", "hooks", "entry_points")


def manifest_path() -> Path:
    """Where the manifest is: $EXL2_BACKEND_MANIFEST, a copy shipped inside the package, or the repo root."""
    env = os.environ.get("EXL2_BACKEND_MANIFEST")
    if env:
        return Path(env)
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / MANIFEST_NAME, here.parents[1] / MANIFEST_NAME):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{MANIFEST_NAME} not found next to the package ({here.parent}) or at the repository root "
                      f"({here.parents[1]}); set EXL2_BACKEND_MANIFEST", field="manifest")


def read_manifest(path: str | Path | None = None) -> dict:
    """The manifest as a dict; ConfigError names a missing key or a malformed file."""
    path = Path(path) if path is not None else manifest_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read the plugin manifest: {exc}", field="manifest", path=str(path)) from exc
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"plugin manifest lacks {', '.join(missing)}", field=missing[0], path=str(path))
    for ep in data["entry_points"]:
        for k in ("group", "name", "module"):
            if k not in ep:
                raise ConfigError(f"plugin manifest entry_points item lacks {k!r}", field=f"entry_points.{k}",
                                  path=str(path))
    return data
