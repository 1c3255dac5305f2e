"""The LitServe host: an OpenAI-compatible server driving the backend through its hooks.

`run_server` / `build_server` (server.py), `Exl2LitAPI` (litapi.py), `Exl2OpenAISpec` (openai_spec.py),
`EngineLoop` (engine_loop.py). Submodules are imported on use so `import exl2_backend.serve` stays light.
"""

__all__ = ["ServeSettings", "ServerProcess", "build_server", "run_server"]


def __getattr__(name):
    if name in ("build_server", "run_server", "ServerProcess"):
        from exl2_backend.serve import server

        return getattr(server, name)
    if name == "ServeSettings":
        from exl2_backend.serve.schemas import ServeSettings

        return ServeSettings
    raise AttributeError(name)
