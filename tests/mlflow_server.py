"""A real `mlflow server` on 127.0.0.1 for the outage, security and load tests.

Starting one costs ~30 s here (imports), so the test modules share one per pytest process
(`shared()`); `restart()` brings it back on the SAME port and store, as an operator would.
The store is a file store (no 7-28 s sqlite schema migration): MLFLOW_ALLOW_FILE_STORE opts in.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ENV = {"MLFLOW_ALLOW_FILE_STORE": "true"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = Path(root), port or _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "MlflowServer":
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", str(self.root / "store"), "--default-artifact-root", str(self.root / "art"),
             "--workers", "1"],
            env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.3)
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (the CLI and its uvicorn workers): an abrupt outage."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> "MlflowServer":
        self.kill()
        return self.start()


_shared: MlflowServer | None = None


def shared() -> MlflowServer:
    """One server per test process, started on first use, killed at exit."""
    global _shared
    if _shared is None:
        os.environ.update(ENV)  # in-process clients read the file store's artifacts too
        _shared = MlflowServer(Path(tempfile.mkdtemp(prefix="jobspec-mlflow-server-"))).start()
        atexit.register(_shared.kill)
    elif not _shared.healthy():
        _shared.restart()
    return _shared


# --- tiny jobs for real launches ---------------------------------------------------------------

def write_job(directory: Path, name: str, tracking_uri: str, *, ranks: int = 1, max_steps: int = 3,
              hidden: int = 32, seq_len: int = 16, micro: int = 4, extra: dict | None = None) -> Path:
    """A spec file for the tiniest real job (1 rank, a 2-layer BERT on synthetic tokens)."""
    import spec_builder
    spec = {
        "name": name,
        "model": {"architecture": "bert", "task": "token-classification",
                  "config": {"hidden_size": hidden, "num_hidden_layers": 2, "num_attention_heads": 2,
                             "intermediate_size": 2 * hidden, "vocab_size": 512,
                             "max_position_embeddings": max(64, seq_len)}},
        "data": {"synthetic": {"num_samples": 256, "seq_len": seq_len, "vocab_range": [5, 500],
                               "labels": "learnable"}, "num_workers": 0, "pin_memory": False},
        "training": {"max_steps": max_steps, "micro_batch_size": micro, "optimizer": {"lr": 1e-3}},
        "resources": {"gpus_per_node": ranks},
        "output_dir": f"out-{name}",
        "checkpoint": {"save_final": False},
        "logging": {"every_n_steps": 1, "progress": "lines",
                    "mlflow": {"tracking_uri": tracking_uri, "experiment": "reliability"}},
    }
    for section, values in (extra or {}).items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    return spec_builder.write_job(directory, base=spec, filename=f"{name}.yaml")


def launch_argv(job: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "jobspec", "launch", str(job), *args]


def only_run_dir(directory: Path, name: str) -> Path:
    runs = sorted((Path(directory) / f"out-{name}").glob("run-*"))
    assert len(runs) == 1, runs
    return runs[0]


# --- one launch with credentials planted: the security test's, also one of the load test's --------

TOKEN, HF, PASSWORD = "mlflow-tok-5f3a9c1e", "hf_planted_77d2e1b0", "pw-8c1d4e7f2a"
_planted: tuple[Path, Path, str] | None = None


def planted_launch(directory: Path) -> tuple[Path, Path, str]:
    """(its directory, its run dir, its stdout+stderr): a tiny job (1 rank, 2 steps) against the shared
    server, with MLFLOW_TRACKING_TOKEN, HF_TOKEN and a password in the tracking URI planted (also in the
    description and a tag). Launched once per test process, into `directory` on the first call: the
    security test reads everything it left for the secrets, and the load test counts it as one of its
    launches (the same tiny job against the same server), so CI launches it once instead of twice."""
    global _planted
    if _planted is None:
        server = shared()
        uri = server.uri.replace("http://", f"http://alice:{PASSWORD}@")
        job = write_job(directory, "secrets", uri, max_steps=2,
                        extra={"description": f"planted {TOKEN}", "logging": {
                            "every_n_steps": 1, "progress": "lines",
                            "mlflow": {"tracking_uri": uri, "experiment": "security",
                                       "tags": {"note": f"tok {HF}"}}}})
        env = {**os.environ, **ENV, "MLFLOW_TRACKING_TOKEN": TOKEN, "HF_TOKEN": HF}
        proc = subprocess.run(launch_argv(job), cwd=directory, capture_output=True, text=True, timeout=600,
                              env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        _planted = (Path(directory), only_run_dir(directory, "secrets"), proc.stdout + proc.stderr)
    return _planted
