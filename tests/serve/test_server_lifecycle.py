"""A real server's starts and stops: SIGTERM to its main process alone (docker stop, systemctl stop, kill PID)
stops its API server and inference worker too, running or still loading; a killed worker, a worker that fails to
load and a port in use end the command with one typed line; nothing of its process group is left."""

from __future__ import annotations

import os
import signal
import socket
import time

from tests.helpers.shapes import SMALL
from tests.serve.conftest import SERVER_SETTINGS


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_gone(pgid: int, seconds: float) -> bool:
    """Whether process group `pgid` is empty within `seconds` (bounded wait: the workers' shutdown)."""
    deadline = time.monotonic() + seconds
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.25)
    return not _group_alive(pgid)


def _serve_then_stop(send_sigterm) -> None:
    """Starts a real server, stops it with send_sigterm(main pid) and checks the stop was whole and clean."""
    import httpx

    from exl2_backend.serve.server import ServerProcess

    srv = ServerProcess({**SERVER_SETTINGS, "max_batch_size": 2, "cache_tokens": 2048}, startup_timeout=900).start()
    proc = srv.proc
    try:
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
        send_sigterm(proc.pid)
        assert proc.wait(60) == 0  # LitServe's graceful path returned: a clean exit
        assert _group_gone(proc.pid, 60), "a worker of the stopped server is still running"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT; a listener still fails it
            s.bind((srv.settings.host, srv.settings.port))  # the API server released the port
        log = srv.log_tail(200)
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def test_sigterm_to_the_main_process_stops_every_worker(default_model_dir):
    _serve_then_stop(lambda pid: os.kill(pid, signal.SIGTERM))  # the leader only, not its group


def test_sigterm_to_the_whole_group_stops_cleanly(default_model_dir):
    """systemd's stop (KillMode=control-group) sends SIGTERM to every process at once: LitServe's multiprocessing
    manager died with the others and the main process's stop, which goes through it, logged "Monitoring worker
    crashed" with a BrokenPipeError traceback (session 46). The manager now waits for its owner's shutdown."""
    _serve_then_stop(lambda pid: os.killpg(pid, signal.SIGTERM))


def test_sigint_to_the_group_stops_a_server_started_with_sigint_ignored(default_model_dir, tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the process group) to `exl2-backend serve` started as a background
    job of a script, which starts with SIGINT ignored: the main process ignored it, LitServe's API server (uvicorn's
    own handler) died of it, and the server ran on half dead, the port held and /health silent (session 39)."""
    import subprocess
    import sys

    import httpx

    from exl2_backend.serve.server import free_port

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:  # `trap '' INT`: SIGINT ignored from the start, as a script's background job
        proc = subprocess.Popen(
            ["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "exl2_backend.cli.main", "serve",
             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-seq-len", "512",
             "--max-batch-size", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert proc.poll() is None, log_path.read_text(errors="replace")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
        assert _group_gone(proc.pid, 60), "a worker of the stopped server is still running"
        text = log_path.read_text(errors="replace")
        assert "Traceback" not in text, text
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            out.append((int(entry), cmd))
    return out


def test_a_killed_inference_worker_stops_the_server_with_a_typed_error(default_model_dir):
    """The worker killed (out of memory, kill -9): LitServe stops the server; the main process says why in one line
    (EngineUnhealthyError, exit code 2) instead of a connection traceback, and nothing of its group is left."""
    from exl2_backend.serve.server import ServerProcess

    srv = ServerProcess({**SERVER_SETTINGS, "max_batch_size": 2, "cache_tokens": 2048}, startup_timeout=900).start()
    proc = srv.proc
    try:
        workers = [pid for pid, cmd in _children(proc.pid) if "spawn_main" in cmd]
        assert len(workers) == 1, _children(proc.pid)
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(60) == 2
        assert _group_gone(proc.pid, 60)
        log = srv.log_tail(200)
        assert "error: EngineUnhealthyError: the inference worker died" in log, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def _listening_on(pids: list[int], port: int) -> list[int]:
    """Those of `pids` holding a socket that listens on TCP `port` (Linux /proc: the sockets' inodes)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # state 0A: LISTEN
                inodes.add(fields[9])
    out = []
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
            out.append(pid)
    return out


def _start_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat field 22)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_a_killed_api_server_stops_the_server_with_a_typed_error(default_model_dir):
    """LitServe watches its inference worker only: its API server process killed (out of memory, kill -9) left the
    main process waiting and the worker holding the model, nothing answering. Now the server stops, the main
    process says why in one line (ServerStoppedError, exit code 2), and nothing of its group is left."""
    from exl2_backend.serve.server import ServerProcess

    srv = ServerProcess({**SERVER_SETTINGS, "max_batch_size": 2, "cache_tokens": 2048}, startup_timeout=900).start()
    proc = srv.proc
    try:
        # LitServe's manager, forked before the API server, holds the listening socket too: the API server is the
        # listener started last
        listeners = _listening_on([pid for pid, _ in _children(proc.pid)], srv.settings.port)
        assert len(listeners) == 2, (listeners, _children(proc.pid))
        os.kill(max(listeners, key=_start_ticks), signal.SIGKILL)
        assert proc.wait(60) == 2
        assert _group_gone(proc.pid, 60), "a worker of the stopped server is still running"
        log = srv.log_tail(200)
        assert "error: ServerStoppedError: the API server LitServer-0 (exit code -9) died" in log, log
        assert "Traceback" not in log, log
    finally:
        srv.stop()


def test_sigterm_while_the_worker_loads_stops_it_too(default_model_dir, tmp_path):
    """SIGTERM to the main process before the server is ready (its worker still loading the model): the worker
    is stopped with it, quietly (exit 130, or 0 where the load won the race), and nothing of the group is left."""
    import subprocess
    import sys

    from exl2_backend.serve.server import ServerProcess

    settings = ServerProcess({**SERVER_SETTINGS, "max_batch_size": 2, "cache_tokens": 2048}).settings
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "exl2_backend.serve.server", "--settings-json",
                                 settings.model_dump_json(exclude={"api_key"})], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any("spawn_main" in cmd for _, cmd in _children(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded: until the inference worker process exists
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) in (0, 130)
        assert _group_gone(proc.pid, 60)
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_port_in_use_is_a_typed_error_before_the_model_loads(tmp_path):
    """Another listener on the port: ConfigError naming the port at once (uvicorn found it only after the model
    had loaded), from run_server and through the CLI as one line (exit code 2)."""
    import multiprocessing

    from exl2_backend.cli.main import main
    from exl2_backend.errors import ConfigError
    from exl2_backend.serve.server import free_port, run_server

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        before = {p.pid for p in multiprocessing.active_children()}
        try:
            run_server(None, host="127.0.0.1", port=port)
        except ConfigError as exc:
            assert exc.field == "port" and f"127.0.0.1:{port}" in str(exc)
        else:
            raise AssertionError("run_server started on a port in use")
        # no model was loaded: LitServe started no process (its inference worker loads the model)
        assert {p.pid for p in multiprocessing.active_children()} == before
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port)]) == 2


def test_a_sigterm_during_a_process_start_is_recognised():
    """The SIGTERM handler defers while multiprocessing starts a child (a frame of its popen_* modules on the
    stack): interrupted between the child's spawn and the write of its start data, the child died on an EOFError
    traceback (about one run in eight of the test above)."""
    import sys
    import types

    from exl2_backend.serve.server import _starting_a_process

    def here():
        return sys._getframe()

    assert not _starting_a_process(here())
    # the same function as if it were multiprocessing's: its code object carries popen_spawn_posix.py's file name
    code = here.__code__.replace(co_filename="/usr/lib/python3.11/multiprocessing/popen_spawn_posix.py")
    assert _starting_a_process(types.FunctionType(code, here.__globals__, closure=here.__closure__)())
    assert not _starting_a_process(None)


def test_a_stop_ends_the_worker_monitor_before_the_manager():
    """LitServe's worker monitor (a thread asking the manager's shutdown event whether to stop) outlived the manager
    on a Ctrl-C / SIGTERM stop and logged "Monitoring worker crashed" with a ConnectionResetError traceback
    (session 39's serve check; about every such stop with the monitor polling every 10 ms, as here). A real
    LitServer and manager, no model or worker: the stop LitServe runs on a KeyboardInterrupt, then time for a late
    poll."""
    import logging
    import threading

    from exl2_backend.serve.server import build_server

    server = build_server({"device": "cpu"})
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    logging.getLogger("litserve").addHandler(handler)  # after build_server: LitServer sets up its loggers
    try:
        manager = server._init_manager(1)
        server.inference_workers = []
        server.monitor_internal = 0.01
        server._start_worker_monitoring(manager, {})
        time.sleep(0.1)
        server._perform_graceful_shutdown(manager, {}, "keyboard_interrupt")
        time.sleep(0.5)
    finally:
        logging.getLogger("litserve").removeHandler(handler)
    assert not any(t.name == "litserve-monitoring" and t.is_alive() for t in threading.enumerate())
    assert not any("Monitoring worker crashed" in m for m in messages), messages


def test_a_host_litserve_cannot_bind_is_a_typed_error(capsys):
    """LitServe binds 0.0.0.0, 127.0.0.1 or :: only: another address is a ConfigError naming the host, from
    run_server, from the server module's own entry point (exit code 2, one line) and through the CLI."""
    import json

    import pytest

    from exl2_backend.cli.main import main
    from exl2_backend.errors import ConfigError
    from exl2_backend.serve.server import _main, free_port, run_server

    port = free_port()
    with pytest.raises(ConfigError, match="host must be one of") as info:
        run_server(None, host="10.11.12.13", port=port)
    assert info.value.field == "host"
    with pytest.raises(SystemExit) as stop:
        _main(["--settings-json", json.dumps({"host": "10.11.12.13", "port": port})])
    assert stop.value.code == 2 and "ConfigError: host must be one of" in capsys.readouterr().err
    assert main(["serve", "--host", "10.11.12.13", "--port", str(port)]) == 2


def test_a_worker_that_fails_to_load_is_one_typed_line(tmp_path):
    """A directory whose config reads but whose weights do not (a truncated shard): the worker's setup fails, its
    error is logged, and the command ends with EngineUnhealthyError (exit code 2) instead of LitServe's
    RuntimeError traceback; nothing of it is left running."""
    import subprocess
    import sys

    from exl2_backend.format.random_model import write_random_exl2_model
    from exl2_backend.serve.server import free_port

    d = write_random_exl2_model(tmp_path / "m", SMALL, bpw=4.0, seed=0)
    shard = next(d.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = subprocess.Popen([sys.executable, "-m", "exl2_backend.cli.main", "serve", str(d), "--device", "cpu",
                             "--host", "127.0.0.1", "--port", str(free_port())], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        assert "error: EngineUnhealthyError: the inference worker failed to start" in err
        assert "CorruptFileError" in out + err, out[-3000:]  # the worker's own error, logged by LitServe
        assert _group_gone(proc.pid, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
