"""Input and output paths: inputs must be regular files; writes are atomic.

Readers see the old file or the new one, never half of one. An output path is checked
before any work (``check_output``), so a run is not thrown away at the end for a path that
could never be written. A symlink is written through to its target (atomically there),
so the link survives; a device node, FIFO or folder is refused rather than replaced.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from onnx2soap.errors import UserError


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _has_nul(path: Path | str) -> bool:
    return "\0" in os.fspath(path)


def check_input(path: Path | str, what: str = "input file") -> Path:
    """``path`` as a Path, refused unless it is a regular file (after symlinks).

    /dev/zero or a FIFO would make a reader hash or parse for ever."""
    path = Path(path)
    if _has_nul(path):
        raise UserError(f"{path!r}: a {what} path cannot contain a NUL byte")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError as e:
        raise UserError(f"{path}: no such {what}") from e
    except OSError as e:
        raise UserError(f"{path}: cannot read the {what} ({_reason(e)})") from e
    if not stat.S_ISREG(mode):
        raise UserError(f"{path}: the {what} must be a regular file, not {_kind(mode)}")
    return path


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _target(path: Path) -> Path:
    """Where a write to ``path`` lands: a symlink's final target (dangling or not)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_output(path: Path | str) -> Path:
    """Refuse, before any work, an output path that cannot be written atomically.

    Returns where the data will land (a symlink's target). Missing folders are created
    by the write, so the nearest existing ancestor must be a writable folder."""
    path = Path(path)
    if _has_nul(path):
        raise UserError(f"{path!r}: an output path cannot contain a NUL byte")
    if not path.name or path.name in (".", ".."):
        raise UserError(f"{path}: an output path must name a file")
    target = _target(path)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise UserError(f"{path}: cannot write ({_reason(e)})") from e
    if mode is not None and not stat.S_ISREG(mode):
        raise UserError(f"{path}: cannot write over {_kind(mode)}; give a regular file path")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{path}: cannot write ({folder} is not a folder)")
    # The rename needs write and search permission on the folder, not on the file.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write (folder {folder} is not writable)")
    return target


def check_directory(path: Path | str) -> Path:
    """Refuse, before any work, a folder path that cannot hold outputs (a checkpoint
    folder): a file in its place, or no writable ancestor to create it in."""
    path = Path(path)
    if _has_nul(path):
        raise UserError(f"{path!r}: a folder path cannot contain a NUL byte")
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: not a folder; give a folder path")
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write (folder {folder} is not writable)")
    return path


def temporary_beside(target: Path, suffix: str = "tmp") -> Path:
    """A fresh hidden name in ``target``'s folder: written, then renamed over it."""
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


def write_atomic(path: Path | str, data: str | bytes) -> None:
    """Write ``data`` to a temporary file beside the target, then rename it over it."""
    path = Path(path)
    target = check_output(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary_beside(target)
        # O_EXCL: never reuse a stray file; mode 0o666 minus the umask, like a plain open().
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({_reason(e)})") from e
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise UserError(f"{path}: cannot write ({_reason(e)})") from e
        raise
