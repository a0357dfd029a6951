"""ONNX's own node test cases, per op: how many pass, are skipped (and why), or fail.

    python -m benchmarks.conformance [--op Conv] [--cases]

The cases are generated from the installed onnx's ``onnx.backend.test.case`` definitions
for every op onnx2soap defines, and run through ``executor.backend`` on the CPU exactly as
``tests/conformance/test_onnx_node_cases.py`` runs them (see ``tests.conformance.cases``).
A skip is a case the importer refuses (the distinct reasons are listed, names and numbers
left out); a failure is a wrong output or a crash. A case with several outputs passes on
the outputs onnx2soap computes; "of them partly" counts the passes that left some output
unchecked (refused: LayerNormalization's Mean, MaxPool's Indices). ``--cases`` lists every
case that did not pass with its full reason, and the outputs partial passes left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import time
from collections import Counter, defaultdict

import onnx

from tests.conformance.cases import (
    EXPANDED,
    ConformanceCase,
    Outcome,
    Status,
    node_cases,
    run_case,
    short_reason,
)


def _outcome(case: ConformanceCase) -> Outcome:
    try:
        return run_case(case)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return Outcome(Status.FAILED, f"{type(e).__name__}: {first}")


def _reasons(outcomes: list[Outcome]) -> str:
    counts = Counter(short_reason(o.reason) for o in outcomes if o.status is Status.SKIPPED)
    return "; ".join(f"{r} ({n})" if n > 1 else r for r, n in counts.most_common())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", action="append", help="only these op types (repeatable)")
    parser.add_argument("--cases", action="store_true", help="list every case not passed")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    cases = [c for c in node_cases() if not args.op or c.op_type in args.op]
    by_op: dict[str, list[tuple[ConformanceCase, Outcome]]] = defaultdict(list)
    for case in cases:
        by_op[case.op_type].append((case, _outcome(case)))
    elapsed = time.perf_counter() - start

    print(f"ONNX node test cases (onnx {onnx.__version__}) through executor.backend, CPU\n")
    print("| op | cases | passed | of them partly | skipped | failed | why skipped |")
    print("|---|---:|---:|---:|---:|---:|---|")
    totals: Counter[Status] = Counter()
    partly = 0
    for op in sorted(by_op):
        outcomes = [o for _, o in by_op[op]]
        n = Counter(o.status for o in outcomes)
        part = sum(1 for o in outcomes if o.status is Status.PASSED and o.unchecked)
        totals.update(n)
        partly += part
        print(
            f"| {op} | {len(outcomes)} | {n[Status.PASSED]} | {part} | {n[Status.SKIPPED]} | "
            f"{n[Status.FAILED]} | {_reasons(outcomes)} |"
        )
    print(
        f"| **all {len(set(by_op) - {EXPANDED})} ops** | {len(cases)} | {totals[Status.PASSED]} | "
        f"{partly} | {totals[Status.SKIPPED]} | {totals[Status.FAILED]} | |"
    )
    failed = [(c, o) for op in sorted(by_op) for c, o in by_op[op] if o.status is Status.FAILED]
    if failed:
        print("\nFailed:")
        for c, o in failed:
            print(f"- {c.name} ({c.op_type}): {o.reason}")
    if args.cases:
        print("\nSkipped:")
        for op in sorted(by_op):
            for c, o in by_op[op]:
                if o.status is Status.SKIPPED:
                    print(f"- {c.name} ({op}): {o.reason}")
        print("\nPassed on some outputs (the others refused):")
        for op in sorted(by_op):
            for c, o in by_op[op]:
                for name, why in o.unchecked if o.status is Status.PASSED else ():
                    print(f"- {c.name} ({op}), output '{name}': {why}")
    print(f"\n{len(cases)} cases in {elapsed:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
