"""The ``onnx2soap`` command: inspect, plan, annotate, simulate, compare, machine, profile,
show, plot.

Every user error is printed as one line on stderr and exits with code 2, no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from onnx2soap.cli import (
    annotate_cmd,
    compare_cmd,
    inspect_cmd,
    machine_cmd,
    plan_cmd,
    plot_cmd,
    profile_cmd,
    show_cmd,
    simulate_cmd,
)
from onnx2soap.errors import UserError
from onnx2soap.options import OneLineParser

EXIT_USER_ERROR = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a killed writer


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="onnx2soap",
        description="Find SOAP parallelization plans for ONNX models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (
        inspect_cmd,
        plan_cmd,
        annotate_cmd,
        simulate_cmd,
        compare_cmd,
        machine_cmd,
        profile_cmd,
        show_cmd,
        plot_cmd,
    )
    for module in commands:
        module.register(sub)
    return parser


def one_line(message: str) -> str:
    """A message on one line whatever it quotes: whitespace runs become one space, other
    control characters (a NUL, an escape sequence) are shown escaped."""
    text = " ".join(message.split())
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = args.run(args) or 0
        sys.stdout.flush()  # a reader gone is found here, not at exit (a traceback there)
        return code
    except UserError as e:
        print(f"onnx2soap: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("onnx2soap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output left (``onnx2soap plan ... | head -1``): whatever the
        # command wrote to files is complete; say nothing more, as a killed pipe would.
        # Python's flush at exit would fail again on the closed pipe, hence devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
