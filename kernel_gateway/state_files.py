"""The gateway's own JSON files in its state directory, written all or nothing.

One way to write them (registry, agent uids, tokens, job records, Library
settings): a temporary file beside the target, never following a symlink,
fsynced, then renamed over it, so a crash leaves the old file or the new one.
These are the operator's paths, never an agent's; an agent's tree is written
only through ``tools/fs.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any


def write_json(path: str, data: Any, mode: int = 0o644, **dump: Any) -> None:
    """Replace ``path`` with ``data`` as JSON (``dump`` goes to ``json.dump``)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, **dump)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
