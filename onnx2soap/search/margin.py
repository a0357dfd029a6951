"""Which plan to trust where the simulator cannot tell plans apart (``Machine.margin``).

The search returns the plan it predicts fastest. On a machine whose predictions are
known to be off by some fraction of a step (``Machine.margin``: 6-21 % on CPU ranks of
a shared VM, ``docs/benchmarks.md``), a plan predicted faster by less than that is
faster only by the host's toss, and the search's pick among many near-equal plans is
the one the model is most optimistic about. What the model knows least are messages
(their latency, the waits and the resumes after them), so among the plans predicted
within the margin of the fastest, the one that moves the fewest bytes is kept. In
``benchmarks/fidelity.py``'s CPU runs the searched plan then measured within 5 % of
the fastest on 7 of 8 model-machine pairs, twice, against 3-5 of 8 before.

A margin of 0 (the presets, whose figures the model was built from) trusts every
difference: the fastest plan is returned, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnx2soap.sim import Evaluation


def steadiest(incumbent: str, contenders: Mapping[str, Evaluation], margin: float) -> str:
    """The contender to return in place of ``incumbent`` (a key of ``contenders``, the
    plan predicted fastest): among those that fit and are predicted within ``margin``
    of it, the one that moves the fewest bytes, the faster of equals; the incumbent
    where none moves fewer bytes, where it does not fit (no trade of memory for
    noise), or where the margin is 0."""
    first = contenders[incumbent]
    if margin <= 0 or not first.fits:
        return incumbent
    bound = first.step_time_s * (1 + margin)
    close = [
        (e.bytes_moved, e.step_time_s, name)
        for name, e in contenders.items()
        if e.fits and e.step_time_s <= bound and e.bytes_moved < first.bytes_moved
    ]
    return min(close)[2] if close else incumbent
