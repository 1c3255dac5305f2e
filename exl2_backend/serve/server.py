"""Build and run the LitServe server: one inference worker (= one engine) behind our OpenAI spec.

`build_server(settings)` returns a `litserve.LitServer`; `run_server(...)` builds and runs it (blocking).
`ServerProcess` starts a server in a child process on a free loopback port and waits for /health (tests,
examples, benchmarks). No torch is imported here: the worker process loads the engine.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from exl2_backend.errors import ConfigError, EngineUnhealthyError, Exl2Error, ServerStoppedError, error_line
from exl2_backend.serve.schemas import ServeSettings

logger = logging.getLogger(__name__)

_LITSERVE_HOSTS = ("0.0.0.0", "127.0.0.1", "::")


def validate_settings(data: dict) -> ServeSettings:
    """dict -> ServeSettings; a bad value raises ConfigError naming the setting."""
    from pydantic import ValidationError

    from exl2_backend.errors import ConfigError
    from exl2_backend.serve.schemas import first_error

    try:
        return ServeSettings.model_validate(data)
    except ValidationError as exc:
        param, message = first_error(exc)
        if message.startswith("Unrecognized request argument"):
            message = f"unknown server setting {param!r}"
        raise ConfigError(f"server setting {message}", field=param) from None


def _accelerator(device: str) -> tuple[str, Any]:
    """LitServe's (accelerator, devices) for our device setting, without initialising CUDA in this process
    (API servers are forked from it): pitfall 1/2 of host-integration.md."""
    if device == "cpu":
        return "cpu", 1
    if device.startswith("cuda"):
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return "cuda", [index]
    from litserve.connector import check_cuda_with_nvidia_smi

    return ("cuda", 1) if check_cuda_with_nvidia_smi() > 0 else ("cpu", 1)


def build_server(settings: ServeSettings | dict | None = None, **overrides):
    """A LitServer serving one model with continuous batching. `overrides` are ServeSettings fields."""
    import litserve as ls

    from exl2_backend.serve.litapi import Exl2LitAPI, served_model_id

    data = settings.model_dump() if isinstance(settings, ServeSettings) else dict(settings or {})
    settings = validate_settings({**data, **overrides})
    accelerator, devices = _accelerator(settings.device)
    api = Exl2LitAPI(settings)
    server = ls.LitServer(
        api,
        accelerator=accelerator,
        devices=devices,
        workers_per_device=1,  # one engine per device; the engine batches (pitfall 3)
        timeout=settings.queue_timeout_s + 30,  # LitServe's own queue: requests leave it at once (async loop)
        model_metadata={"model": served_model_id(settings), "backend": "exl2_backend"},
        fast_queue=settings.fast_queue,
        max_payload_size=int(settings.max_payload_mb * 2**20),
    )
    config = getattr(server, "transport_config", None)
    if settings.fast_queue and getattr(config, "transport_type", None) == "mp":
        # LitServe 0.2.19 builds TransportConfig(transport_config=...) (a misspelt field pydantic ignores), so
        # fast_queue silently keeps the multiprocessing-Manager transport; the field it meant to set:
        config.transport_type = "zmq"
    _monitor_stops_before_the_manager(server)
    _api_server_death_stops_the_server(server)
    _openai_shaped_http_errors(server.app)
    if settings.api_key is not None:
        _require_api_key(server.app, settings.api_key)
    return server


# Seconds between LitServe's checks that its inference worker lives (its default: 2): a dead worker stops the server
# that much sooner, and a stop waits at most that long for the check to end.
WORKER_MONITOR_INTERVAL_S = 0.25


def _monitor_stops_before_the_manager(server) -> None:
    """LitServe's worker monitor is a thread that asks the multiprocessing manager's shutdown event, every
    `monitor_internal` seconds, whether to stop. LitServe's stop on Ctrl-C / SIGTERM shuts the manager down without
    setting that event, so a check landing after the manager is gone logs "Monitoring worker crashed" with a
    ConnectionResetError traceback (session 39's serve check, litserve 0.2.19). Here a stop sets the event and waits
    for the monitor to end first. The monitor's own stop (a dead worker) runs as before: the main thread, waiting on
    that event, must see the manager go to raise the typed error run_litserver turns it into."""
    import threading

    shutdown = getattr(server, "_perform_graceful_shutdown", None)
    if shutdown is None or not hasattr(server, "_shutdown_event"):
        return  # another LitServe: nothing to mend
    server.monitor_internal = WORKER_MONITOR_INTERVAL_S
    server._exl2_interrupted = False  # set by each stop below (the API-server watch needs the stops marked)

    def stop_monitor_then_shut_down(manager, uvicorn_workers, shutdown_reason="normal"):
        stopping = getattr(server, "_exl2_stopping", None)
        if stopping is not None:
            stopping.set()  # the API-server watch ends: the processes it watches are being stopped
        # a Ctrl-C to the process group reaches the API server too, which may end before this stop begins: that
        # stop is not a death (run_litserver)
        server._exl2_interrupted = shutdown_reason == "keyboard_interrupt"
        monitors = [t for t in threading.enumerate() if t.name == "litserve-monitoring"]
        if threading.current_thread() not in monitors:
            # From a thread of its own: the main thread's manager connection may still carry the wait() that the
            # KeyboardInterrupt cut short, and the manager answers one request per connection at a time (a set()
            # behind that wait hangs the stop: the lifecycle test caught it).
            setter = threading.Thread(target=_set_event, args=(server._shutdown_event,), daemon=True)
            setter.start()
            setter.join(timeout=5)
            for monitor in monitors:
                monitor.join(timeout=WORKER_MONITOR_INTERVAL_S + 5)
        shutdown(manager, uvicorn_workers, shutdown_reason)

    server._perform_graceful_shutdown = stop_monitor_then_shut_down


def _api_server_death_stops_the_server(server) -> None:
    """LitServe's monitor watches its inference workers only: an API server process that died (killed, out of
    memory) left the main process waiting on its shutdown event, the worker holding the model, and the listening
    socket (LitServe's manager, forked after it was bound, holds it too) accepting nothing. Here a thread watches
    the API server processes LitServe starts (`_start_server`) and, when one has ended while no stop is under way,
    records it and sets that event: LitServe's graceful path stops the rest and run_litserver raises
    ServerStoppedError. The watch polls the processes themselves (waitpid), not the manager, every
    WORKER_MONITOR_INTERVAL_S, and ends when a stop begins (`_exl2_stopping`)."""
    import multiprocessing
    import threading

    start = getattr(server, "_start_server", None)
    if start is None or not hasattr(server, "_exl2_interrupted"):
        return  # another LitServe, whose stops _monitor_stops_before_the_manager does not mark: no watch
    server._exl2_stopping = threading.Event()
    server._exl2_dead_api_server = None

    def watch(processes) -> None:
        stopping = server._exl2_stopping
        while not stopping.wait(WORKER_MONITOR_INTERVAL_S):
            dead = [p for p in processes if not p.is_alive()]
            if dead and not stopping.is_set():
                server._exl2_dead_api_server = f"{dead[0].name} (exit code {dead[0].exitcode})"
                logger.error("the API server %s died; stopping the server", server._exl2_dead_api_server)
                _set_event(server._shutdown_event)
                return

    def start_and_watch(*args, **kwargs):
        workers = start(*args, **kwargs)
        processes = [w for w in workers.values() if isinstance(w, multiprocessing.process.BaseProcess)]
        if processes:
            threading.Thread(target=watch, args=(processes,), daemon=True, name="exl2-api-server-watch").start()
        return workers

    server._start_server = start_and_watch


def _set_event(event) -> None:
    try:
        if event is not None:
            event.set()
    except (OSError, EOFError):  # the manager is already gone (the monitor stopped the server first)
        pass


API_KEY_ENV = "EXL2_BACKEND_API_KEY"  # the API key, where a command line would show it to other users


def _require_api_key(app, key: str) -> None:
    """/v1/*, /tokenize and /detokenize answer 401 (OpenAI's error shape, code invalid_api_key) unless the request
    carries "Authorization: Bearer <key>"; /health and /metrics stay open (probes, scrapers)."""
    import hmac

    from fastapi.responses import JSONResponse

    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check_api_key(request, call_next):
        if request.url.path.startswith(("/v1/", "/tokenize", "/detokenize")):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                error = {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                         "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
                return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def _openai_shaped_http_errors(app) -> None:
    """Routing errors (405 wrong method, 404 unknown path) in the OpenAI error shape every other refusal has,
    not FastAPI's {"detail": ...}."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def handler(request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    app.add_exception_handler(HTTPException, handler)


def run_litserver(server, host: str, port: int, log_level: str) -> None:
    """server.run (blocking) after checking the host (LitServe's three) and check_port_free, with SIGTERM taking
    LitServe's Ctrl-C path: its shutdown stops the API server and the inference worker. SIGTERM's default action
    (docker stop, systemctl stop, kill PID) would end this process alone and leave both running, holding the port
    and the model's memory. Only the main thread can install it."""
    import multiprocessing
    import threading

    owner = os.getpid()

    def interrupt(signum, frame):
        if os.getpid() == owner:
            if _starting_a_process(frame):
                # the child exists but has not read its start data yet: interrupted here, it would die on an
                # EOFError traceback; the signal comes again once the start is through (bounded: LitServe starts
                # a few processes)
                threading.Timer(0.05, os.kill, (owner, signal.SIGTERM)).start()
                return
            raise KeyboardInterrupt
        if os.getppid() == owner and multiprocessing.current_process().name.startswith("SyncManager"):
            # LitServe's multiprocessing manager, forked from here: a SIGTERM to the whole process group (systemd's
            # stop) reached it too, and had it ended now, the owner's stop below would lose the queues and event
            # it stops the others through ("Monitoring worker crashed", BrokenPipeError). The owner shuts it down
            # last (manager.shutdown); if the owner is gone, it ends as below.
            return
        # a forked child (the API server) inherited this handler: it ends as SIGTERM's default would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    if host not in _LITSERVE_HOSTS:
        raise ConfigError(f"host must be one of {', '.join(_LITSERVE_HOSTS)} (LitServe's rule), got {host!r}",
                          field="host")
    check_port_free(host, port)  # before server.run: its worker loads the model first
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if main else None
    # A script's background job starts with SIGINT ignored, and LitServe's children inherit the handler this process
    # has when it starts them: a Ctrl-C to the group then killed the API server alone (uvicorn's own handler) and the
    # server ran on half dead (session 39). SIGINT takes Python's KeyboardInterrupt path here whatever we inherited.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        server.run(host=host, port=port, num_api_servers=1, log_level=log_level, generate_client_file=False)
        dead = getattr(server, "_exl2_dead_api_server", None)
        if dead is not None and not server._exl2_interrupted:  # the watch stopped it
            raise ServerStoppedError(f"the API server {dead} died and the server stopped (the log above may say "
                                     "why)")
    except KeyboardInterrupt:
        # before LitServe's own shutdown is armed (its worker still loading the model): stop the worker here, or it
        # loads on and dies with a traceback when it finds the manager gone
        workers = list(getattr(server, "inference_workers", None) or []) + multiprocessing.active_children()
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        raise
    except RuntimeError as exc:
        if "failed to start" not in str(exc):  # LitServe's verify_worker_status: the worker's setup raised
            raise
        raise EngineUnhealthyError("the inference worker failed to start (its error is in the log above)") from None
    except (EOFError, ConnectionError) as exc:
        # LitServe stops everything when its inference worker dies (killed, out of memory) and shuts down the
        # manager that this process waits on: the connection drop is that stop, not a cause of its own
        raise EngineUnhealthyError("the inference worker died and the server stopped (the log above says why)") \
            from exc
    finally:
        if previous is not None:  # None: not installed here, or by code outside Python (nothing to restore)
            signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)


def _starting_a_process(frame) -> bool:
    """Whether `frame` (the main thread's, at a signal) is inside multiprocessing's start of a child process."""
    while frame is not None:
        if os.path.basename(frame.f_code.co_filename).startswith("popen_"):  # popen_spawn_posix.py, popen_fork.py
            return True
        frame = frame.f_back
    return False


def run_server(model_dir: str | None = None, host: str = "127.0.0.1", port: int = 8000,
               cache_tokens: int | None = None, max_concurrent: int | None = None,
               max_seq_len: int | None = None, device: str = "auto", **settings: Any) -> None:
    """Serve `model_dir` (None: the embedded default model) until interrupted.

    max_concurrent: sequences that decode together (the engine's max_batch_size); cache_tokens bounds
    them by KV memory as well. Other keyword arguments are ServeSettings fields."""
    if host == "localhost":
        host = "127.0.0.1"
    if max_concurrent is not None:
        settings["max_batch_size"] = max_concurrent
    cfg = validate_settings(dict(model_dir=str(model_dir) if model_dir is not None else None, host=host, port=port,
                                 cache_tokens=cache_tokens, max_seq_len=max_seq_len, device=device, **settings))
    if cfg.model_dir is not None:  # a missing or broken directory: one typed error here, not a worker's traceback
        from exl2_backend.format.config import ModelConfig

        ModelConfig.from_dir(cfg.model_dir)
    run_litserver(build_server(cfg), cfg.host, cfg.port, cfg.log_level)


def check_port_free(host: str, port: int) -> None:
    """ConfigError (field "port") where host:port cannot be bound, before the model loads: uvicorn would find it
    only after the load (an 8B on a GPU: up to a minute) and exit with its own message. Another process may still
    take the port in between; then uvicorn's error stands."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server there?)",
                              field="port") from None


# --- a server in a child process --------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess({"max_batch_size": 16}) as srv: srv.base_url` — a real server on 127.0.0.1.

    The child runs in its own session; leaving the block interrupts it (SIGINT, LitServe's graceful path)
    and kills what is left of that process group."""

    def __init__(self, settings: ServeSettings | dict | None = None, *, startup_timeout: float = 600.0,
                 env: dict | None = None):
        data = settings.model_dump() if isinstance(settings, ServeSettings) else dict(settings or {})
        data.setdefault("host", "127.0.0.1")
        if not data.get("port"):
            data["port"] = free_port(data["host"])
        self.settings = ServeSettings.model_validate(data)
        self.startup_timeout = startup_timeout
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def start(self) -> ServerProcess:
        fd, path = tempfile.mkstemp(prefix="exl2-serve-", suffix=".log")
        self.log_path = Path(path)
        env = {**os.environ, **(self.env or {})}
        # the child imports the same exl2_backend as this process (a checkout that was never pip-installed too)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        if self.settings.api_key is not None:  # through the environment: a command line is readable by anyone
            env[API_KEY_ENV] = self.settings.api_key
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "exl2_backend.serve.server", "--settings-json",
                 self.settings.model_dump_json(exclude={"api_key"})],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=10) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # the process group we created with start_new_session
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig != signal.SIGKILL:  # the leader is gone; make sure no worker of its group lingers
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="run the exl2_backend OpenAI server (see `exl2-backend serve`)")
    p.add_argument("--settings-json", required=True, help="ServeSettings as JSON")
    args = p.parse_args(argv)
    s = ServeSettings.model_validate({"api_key": os.environ.get(API_KEY_ENV) or None,
                                      **json.loads(args.settings_json)})
    try:
        run_litserver(build_server(s), s.host, s.port, s.log_level)
    except Exl2Error as exc:  # as the CLI reports it
        print(error_line(exc), file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # interrupted while starting (run_litserver stopped the worker)
        raise SystemExit(130) from None


if __name__ == "__main__":
    _main()
