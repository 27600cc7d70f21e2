"""Credentials never leave the process: masking for anything written or shown, and splitting
`user:pass@` out of tracking URIs (MLflow takes them from the environment instead).

No heavy imports: `jobspec compile` masks the run files it writes with this too.
"""
from __future__ import annotations

import os
import re
from urllib.parse import urlsplit, urlunsplit

SECRET_ENV_VARS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "HF_TOKEN",
                   "HUGGING_FACE_HUB_TOKEN")

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")


def mask_secrets(text: str) -> str:
    """`text` with `user:pass@` in URIs replaced by `***@` and secret env values replaced by
    `***`."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    for var in SECRET_ENV_VARS:
        secret = os.environ.get(var)
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def mask_tree(value):
    """A copy of a YAML/JSON tree with every string masked: dump the masked tree rather than mask
    the dumped text, where a secret that was a whole value would become `***`, a YAML alias."""
    if isinstance(value, dict):
        return {key: mask_tree(child) for key, child in value.items()}
    if isinstance(value, list):
        return [mask_tree(child) for child in value]
    return mask_secrets(value) if isinstance(value, str) else value


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(uri without userinfo, username, password): MLflow takes credentials from the environment."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri, None, None
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=host)), user or None, password or None
