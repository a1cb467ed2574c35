"""The cache directory: small JSON files, each written atomically and read back whole; a file
that cannot be read says why (``Unreadable``), and the caller warns and measures again.
``forget()`` clears them.

Usage:
    >>> import batchwidgets as bw
    >>> bw.forget()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV = "BATCHWIDGETS_CACHE_DIR"
FORMAT = 1  # of the files: a file of another format is foreign, and ignored

# NOTE [ Writing the cache atomically ]
# An entry is written to a temporary file in the same folder, flushed to disk, then renamed
# over the entry's name (``os.replace``, atomic on POSIX and Windows): a reader sees the old
# file or the new one whole, never half of one, and two processes writing the same entry at
# once each rename a whole file, the last one winning. A process killed mid-write leaves a
# temporary file (``.*.tmp``) that no reader opens and ``forget()`` removes. Whatever goes
# wrong (a full disk, a folder without write access, a file another program wrote), the
# answer is measured as without a cache, with one warning saying why.


class Unreadable(ValueError):
    """A cache file that is there but cannot be used: unreadable, truncated, or foreign."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"the file {path} {why}")
        self.path = path


def cache_dir() -> Path:
    """Where remembered answers live: ``$BATCHWIDGETS_CACHE_DIR``, else the platform's user
    cache folder (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux, ``~/Library/Caches`` on macOS,
    ``%LOCALAPPDATA%`` on Windows) under ``batchwidgets``."""
    chosen = os.environ.get(ENV)
    if chosen:
        return Path(chosen).expanduser()
    home = Path.home()
    if sys.platform == "win32":
        root = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return Path(root) / "batchwidgets" / "Cache"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "batchwidgets"
    return Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "batchwidgets"


def entry_path(kind: str, key: str) -> Path:
    """The file of one entry: ``<cache_dir>/<kind>/<key>.json``."""
    return cache_dir() / kind / f"{key}.json"


def read(kind: str, key: str) -> dict[str, Any] | None:
    """The entry stored under ``key``, or None where none is; ``Unreadable`` where the file
    cannot be read, is truncated, or is not of this format and key."""
    path = entry_path(kind, key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):  # none stored (or no folder to store in)
        return None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise Unreadable(path, f"cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
        raise Unreadable(path, f"is not a batchwidgets cache file of format {FORMAT} for its key")
    return entry


def write(kind: str, key: str, entry: dict[str, Any]) -> Path:
    """Store ``entry`` under ``key`` atomically (NOTE [ Writing the cache atomically ]) and
    return the file's path; an ``OSError`` where it cannot be written."""
    path = entry_path(kind, key)
    text = json.dumps({"format": FORMAT, "key": key, **entry}, separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp",
                                             dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def forget(kind: str | None = None) -> int:
    """Remove the remembered entries (of ``kind``, or all) and any half-written file; the
    number of entries removed."""
    root = cache_dir()
    folders = [root / kind] if kind is not None else [p for p in _children(root) if p.is_dir()]
    removed = 0
    for folder in folders:
        for path in _children(folder):
            if path.suffix == ".json" or (path.name.startswith(".") and path.suffix == ".tmp"):
                try:
                    path.unlink()
                except FileNotFoundError:  # another process removed it first
                    continue
                removed += path.suffix == ".json"
    return removed


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
