"""Single source of the package version and the hook-API version."""

__version__ = "0.1.0"
HOOK_API_VERSION = "1.8"
