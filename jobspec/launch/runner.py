"""Which DeepSpeed runner command starts the ranks, and the rendezvous port it gets."""
from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def runner_prefix() -> list[str]:
    """How to start DeepSpeed's runner with *this* interpreter.

    The `deepspeed` script next to sys.executable is used when present (it is what a user would type);
    otherwise `python -m deepspeed.launcher.runner`, because a `deepspeed` found elsewhere on PATH
    (another venv, a pyenv shim) may run a different Python than the one jobspec runs in.
    """
    script = shutil.which("deepspeed")
    if script and Path(script).resolve().parent == Path(sys.executable).resolve().parent:
        return [script]
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def resolve_runner(argv: list) -> list[str]:
    """The compiled argv with its leading `deepspeed` replaced by this interpreter's runner."""
    argv = [str(a) for a in argv]
    return runner_prefix() + argv[1:] if argv and argv[0] == "deepspeed" else argv
