"""Atomic file writes: readers see the old file or the new one, never half of one."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from onnx2soap.errors import UserError


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: never reuse a stray file; mode 0o666 minus the umask, like a plain open().
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from e
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"{path}: cannot write ({e.strerror or e})") from e
        raise
