"""A real `specdec serve` process for the scripts: started on a free port, ready when it returns."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx


def spawn(serve_args: list[str], ready_timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """`specdec serve --port 0 SERVE_ARGS`; returns (process, base URL) once /health is 200.
    Its stderr keeps being read, so a chatty server never blocks on a full pipe."""
    cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", "0", *serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    for line in proc.stderr:
        tail.append(line)
        if match := re.search(r"listening on (http://\S+)", line):
            break
    else:
        raise SystemExit("the server did not start:\n" + "".join(tail[-20:]))
    threading.Thread(target=lambda: [tail.append(x) for x in proc.stderr], daemon=True).start()
    url = match.group(1)
    deadline = time.time() + ready_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited:\n" + "".join(tail[-20:]))
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not become ready")
