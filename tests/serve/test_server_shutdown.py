"""Stopping a real server with SIGTERM to its main process alone (docker stop, systemctl stop, kill PID) stops its
API server and inference worker too: nothing of its process group is left, and the port is free again."""

from __future__ import annotations

import os
import signal
import socket
import time

from tests.serve.conftest import SERVER_SETTINGS


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_main_process_stops_every_worker(default_model_dir):
    import httpx

    from exl2_backend.serve.server import ServerProcess

    srv = ServerProcess({**SERVER_SETTINGS, "max_batch_size": 2, "cache_tokens": 2048}, startup_timeout=900).start()
    proc = srv.proc
    try:
        assert httpx.get(srv.base_url + "/health", timeout=30).status_code == 200
        os.kill(proc.pid, signal.SIGTERM)  # the leader only, not its group
        assert proc.wait(60) == 0  # LitServe's graceful path returned: a clean exit
        deadline = time.monotonic() + 60
        while _group_alive(proc.pid) and time.monotonic() < deadline:  # bounded: the workers' shutdown
            time.sleep(0.25)
        assert not _group_alive(proc.pid), "a worker of the stopped server is still running"
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT; a listener still fails it
            s.bind((srv.settings.host, srv.settings.port))  # the API server released the port
        log = srv.log_tail(200)
        assert "Traceback" not in log, log
    finally:
        srv.stop()
