"""Where a local tracking store lives, so that commands that only read (`launch --from-run`,
`report`) can say "nothing there" instead of letting MLflow create an empty store: opening a SQLite
URI creates the database file (and its tables), and a missing file store would be made on first
write. Servers and other databases are not looked at here (nothing local to create).
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit


def local_store_path(uri: str) -> Path | None:
    """The file (SQLite) or directory (file store) a local tracking URI names; None for anything
    else."""
    if uri.startswith("sqlite:///"):
        name = uri[len("sqlite:///"):].split("?", 1)[0]
        return None if name in ("", ":memory:") else Path(unquote(name))
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    if not parts.scheme or len(parts.scheme) == 1:   # a plain path (or a Windows drive letter)
        return Path(uri)
    return None


def missing_local_store(uri: str) -> Path | None:
    """The absolute path of a local store that does not exist (a read would create it), else
    None."""
    path = local_store_path(uri)
    if path is None:
        return None
    exists = path.is_file() if uri.startswith("sqlite:") else path.is_dir()
    return None if exists else path.absolute()
