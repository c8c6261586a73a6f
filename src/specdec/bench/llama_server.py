"""llama.cpp's llama-server as a peer of the load benchmark (`--peer llama-server`).

The binary is built by scripts/bench/peers/build_llama_server.py (into DEFAULT_BINARY). The
benchmark starts one server per mode on a free local port with pinned flags: the target's GGUF
file, `--threads` CPU threads, `--slots` slots of the model's whole window each (-c slots x
window), the default KV type and flash-attention setting, no web UI, and for speculation
`--spec-type ngram-mod` (n-grams of the context, llama.cpp's counterpart of specdec's ngram
drafter). Flags this build does not know are found in its `--help` and left out or refused.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from specdec.gguf_file import gguf_file

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist the build script takes llama.cpp from
DEFAULT_BINARY = Path.home() / ".cache" / "specdec" / f"llama-server-{LLAMA_CPP_PYTHON}" / "llama-server"
SPEC_TYPE = "ngram-mod"
HOST = "127.0.0.1"


@dataclass(frozen=True)
class LlamaServerConfig:
    binary: Path
    model: Path  # the GGUF file
    window: int  # the model's own context length; each slot gets all of it
    threads: int = 2
    slots: int = 4
    spec_type: str | None = None  # None: plain decoding
    no_webui: bool = True  # only where the build has the flag


def context_window(gguf_path: Path) -> int:
    """The model's window, `<arch>.context_length` in the file's metadata."""
    f = gguf_file(gguf_path)
    arch = f.meta("general.architecture")
    window = f.meta(f"{arch}.context_length")
    if window is None:
        raise SystemExit(f"loadbench: {gguf_path.name} has no {arch}.context_length")
    return int(window)


def server_flags(config: LlamaServerConfig, port: int) -> list[str]:
    """The command line, binary first."""
    cmd = [str(config.binary), "-m", str(config.model), "--host", HOST, "--port", str(port),
           "-t", str(config.threads), "--parallel", str(config.slots),
           "-c", str(config.slots * config.window)]
    if config.no_webui:
        cmd.append("--no-webui")
    if config.spec_type:
        cmd += ["--spec-type", config.spec_type]
    return cmd


@cache
def help_text(binary: Path) -> str:
    run = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    return run.stdout + run.stderr


def has_flag(help_: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_, re.MULTILINE) is not None


def check_binary(binary: Path, spec_type: str | None) -> bool:
    """Refuse a missing binary or a speculative type this build lacks; return whether it
    takes --no-webui."""
    if not binary.exists():
        raise SystemExit(f"loadbench: no llama-server at {binary}; build it with "
                         "python scripts/bench/peers/build_llama_server.py (or pass --llama-server PATH)")
    help_ = help_text(binary)
    if spec_type and not (has_flag(help_, "--spec-type") and spec_type in help_):
        raise SystemExit(f"loadbench: this llama-server has no --spec-type {spec_type}")
    return has_flag(help_, "--no-webui")


def free_port() -> int:
    # The port is free when we ask; the server binds it a moment later (a race we accept locally).
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(config: LlamaServerConfig) -> tuple[subprocess.Popen, str]:
    """Start the server; return the process (its stderr's lines in `proc.tail`) and its URL.
    The caller waits for /health and stops it."""
    port = free_port()
    proc = subprocess.Popen(server_flags(config, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, errors="replace")
    lines: list[str] = []
    # Drain stderr so the server never blocks on a full pipe; the tail explains a failed start.
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    proc.tail = lines
    return proc, f"http://{HOST}:{port}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
