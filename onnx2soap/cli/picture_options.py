"""Options shared by the picture commands (``show``, ``plot``): output, size, resolution."""

from __future__ import annotations

import argparse
import re

from onnx2soap.options import int_in
from onnx2soap.viz.render import Size

MIN_PIXELS, MAX_PIXELS = 100, 8000  # 8000² RGBA is 256 MB: the most a picture may take
MIN_DPI, MAX_DPI = 30, 600
_SIZE = re.compile(r"([0-9]{1,5})[xX]([0-9]{1,5})")


def pixels(text: str) -> tuple[int, int]:
    """argparse ``type=``: ``WxH`` in pixels, each within [MIN_PIXELS, MAX_PIXELS]."""
    m = _SIZE.fullmatch(text.strip())
    if not m or not all(MIN_PIXELS <= int(v) <= MAX_PIXELS for v in m.groups()):
        raise argparse.ArgumentTypeError(
            f"must be WIDTHxHEIGHT in pixels, each in [{MIN_PIXELS}, {MAX_PIXELS}], "
            f"got {text[:40]!r}"
        )
    return int(m[1]), int(m[2])


def add_picture_options(p: argparse.ArgumentParser, default: tuple[int, int]) -> None:
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument(
        "--size",
        type=pixels,
        default=default,
        metavar="WxH",
        help=f"picture size in pixels (default {default[0]}x{default[1]})",
    )
    p.add_argument(
        "--dpi",
        type=int_in(MIN_DPI, MAX_DPI),
        default=100,
        help=f"dots per inch: larger draws text and lines larger (default 100; "
        f"{MIN_DPI} to {MAX_DPI})",
    )


def picture_size(args: argparse.Namespace) -> Size:
    width, height = args.size
    return Size(width, height, args.dpi)
