"""Run a command to its end: its wall time, exit and its own peak RSS.

Linux folds the address space a process replaces at ``exec`` into its peak RSS, and a
child spawned by a big process (pytest, an hour into the suite: a GB) starts in a copy
of its parent's, so ``wait4``'s ``ru_maxrss`` of a direct child reports at least the
parent's size. The command therefore runs as the grandchild of a small interpreter
(``python -m benchmarks.peak_rss REPORT ARGV...``), whose ``wait4`` sees only the
command's own peak (floored at that interpreter's ~15 MB) and writes it to REPORT.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import os
import resource
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    wall_s: float
    peak_rss: int  # bytes, of the command itself
    exit_code: int
    error: str  # the last line it printed on stderr when it failed
    stderr: str


def _limit(cap_bytes: int | None):
    if cap_bytes is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))


def measure(argv: list[str], cap_bytes: int | None = None, cwd: Path | None = None) -> Measured:
    """Run ``argv`` (its address space capped at ``cap_bytes``, if given) to its end."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report, err = Path(tmp) / "peak", Path(tmp) / "stderr"
        with err.open("wb") as sink:
            code = subprocess.run(
                [sys.executable, "-m", "benchmarks.peak_rss", str(report), *map(str, argv)],
                stdout=subprocess.DEVNULL,
                stderr=sink,
                preexec_fn=_limit(cap_bytes),
                cwd=cwd,
                env={**os.environ, "PYTHONPATH": _with_repo(os.environ.get("PYTHONPATH"))},
            ).returncode
        wall = time.perf_counter() - start
        text = err.read_text(errors="replace")
        peak = int(report.read_text()) if report.exists() else 0
    lines = text.strip().splitlines()
    error = lines[-1][:160] if code and lines else ""
    return Measured(wall, peak, code, error, text)


def _with_repo(path: str | None) -> str:
    """PYTHONPATH with this repository first, so ``-m benchmarks.peak_rss`` is found from
    any working directory."""
    repo = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join([repo, path]) if path else repo


def main(argv: list[str]) -> int:
    report, command = Path(argv[0]), argv[1:]
    proc = subprocess.Popen(command)
    _, status, usage = os.wait4(proc.pid, 0)
    report.write_text(str(usage.ru_maxrss * 1024))  # Linux reports KiB
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
