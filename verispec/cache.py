"""The one on-disk cache: what is measured or converted once per machine and kept (``~/.cache/verispec``, or
``$VERISPEC_CACHE``).

Entries are JSON documents under a *kind* (a folder: ``costs``, ``kernels``, ``llama-check``) and a *key* (a hash
of everything the entry depends on, made by ``key``). ``read`` returns None for a missing or unreadable entry, and
``write`` writes a whole file and renames it into place, so a reader never sees half of one. Folders that are not
JSON (a de-quantised model, a parsed tokenizer, cached answers) live under ``path(kind)`` too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))


def path(kind: str, name: str = "") -> Path:
    """The folder of ``kind`` (or a file ``name`` in it)."""
    folder = root() / kind
    return folder / name if name else folder


def key(*parts) -> str:
    """A short stable hash of ``parts`` (their ``str``), for file names."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


def read(kind: str, entry: str) -> dict | None:
    try:
        data = json.loads(path(kind, f"{entry}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write(kind: str, entry: str, data: dict) -> None:
    """Best effort: a read-only or full disk only costs a measurement next time."""
    target = path(kind, f"{entry}.json")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(target)
    except OSError:
        pass
