"""A hub id with no hub to reach: the Hugging Face cache only, said once, instead of every file
request retried for ~25 s (huggingface_hub's backoff: 1+2+4+8+8 s) in the launcher and then again
on every rank, each retry a warning line.

Before the launcher reads anything of a spec's hub ids (`model.name_or_path`, `data.tokenizer` that
are not local paths), one TCP connect to the hub's endpoint (HF_ENDPOINT) says whether it answers.
When it does not, HF_HUB_OFFLINE=1 is set in the launcher's environment, which the ranks inherit:
what is in the local cache loads at once, what is not fails at once with transformers' own "not in
the cached files" error (positioned on `model.name_or_path` by the launch's checks and the ranks').
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

from jobspec.spec.types import JobSpec

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 3.0
TRUE = {"1", "ON", "YES", "TRUE"}


def hub_ids(spec: JobSpec) -> list[str]:
    """The spec's names that are hub ids, not local paths (validate made existing paths
    absolute)."""
    names = [spec["model"]["name_or_path"], spec["data"]["tokenizer"]]
    return [n for n in names if n and not Path(n).is_absolute() and not Path(n).exists()]


def reachable(endpoint: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    parts = urlsplit(endpoint)
    port = parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def offline_if_unreachable(spec: JobSpec, environ=os.environ) -> bool:
    """Set HF_HUB_OFFLINE=1 (and say so) when the spec names hub ids and the hub does not answer;
    True when it did. Nothing changes when the user chose offline mode or the spec names no hub
    id."""
    if environ.get("HF_HUB_OFFLINE", "").upper() in TRUE:
        # huggingface_hub may have been imported before the variable was set
        _offline_in_this_process()
        return False
    if not hub_ids(spec):
        return False
    endpoint = environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    if reachable(endpoint):
        return False
    environ["HF_HUB_OFFLINE"] = "1"
    _offline_in_this_process()
    print(f"jobspec: {urlsplit(endpoint).hostname} does not answer: {', '.join(hub_ids(spec))} "
          "from the local Hugging Face cache only (HF_HUB_OFFLINE=1)", flush=True)
    return True


def _offline_in_this_process() -> None:
    """huggingface_hub reads HF_HUB_OFFLINE once, when it is imported: an import before the variable
    was set would go on trying the hub (25 s of retries per file), so its constant is set too."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        # a module attribute mypy cannot see
        setattr(constants, "HF_HUB_OFFLINE", True)  # noqa: B010
