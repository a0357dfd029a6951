"""``plan --start``'s line in ``plan``'s report; the start itself is search/start.py's."""

from __future__ import annotations

from onnx2soap.cli.common import seconds
from onnx2soap.search.start import StartResult


def start_line(result: StartResult, searching: bool) -> str:
    ev = result.evaluation
    fit = "" if ev.fits else ", does not fit in device memory"
    if not searching:
        how = "the plan"
    elif result.kept:
        how = "kept: the search found nothing faster"
    else:
        how = "the search found a faster plan"
    return f"  start: {result.path} ({seconds(ev.step_time_s)}{fit}): {how}"
