"""The attention op's CPU kernels next to torch's, and its memory next to the unfused chain.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python -m benchmarks.attention

Time: forward + backward of ``onnx2soap.ops.flash`` (numpy, float32, causal) next to
torch's ``scaled_dot_product_attention`` on the CPU (same shapes, one thread, autograd's
backward), alternating in one run; the median of ``--repeat`` after a warm-up, and the
ratio (issue 46's goal: at most 1.5).

Memory: the peak bytes numpy allocates (tracemalloc) in forward + backward of the fused
kernels, next to the unfused chain as the executor ran it before (scores, scaled scores
and probabilities made, the probabilities kept for the backward, the scores' gradient
made): the chain's inputs and outputs excluded from both.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from onnx2soap.ops import flash

MIB = 1 << 20


def _fused(q, k, v, grad, causal: bool) -> Callable[[], None]:
    """As the executor runs them: the forward's log-sum-exp kept for the backward."""
    problem = flash.Problem(1 / float(np.sqrt(q.shape[-1])), causal)

    def run() -> None:
        out, lse = flash.forward_with_lse(np, q, k, v, None, problem)
        flash.backward(np, q, k, v, None, out, grad, problem, lse=lse)

    return run


def _chain(q, k, v, grad, causal: bool) -> Callable[[], None]:
    """MatMul, Mul, Add (the causal mask), Softmax, MatMul, and their backwards."""
    n = k.shape[2]
    mask = np.where(np.tri(n, dtype=bool), 0, np.float32(-1e9)).astype(q.dtype)

    def run() -> None:
        scores = q @ np.swapaxes(k, -1, -2)
        scaled = scores * np.float32(1 / np.sqrt(q.shape[-1]))
        del scores
        if causal:
            scaled = scaled + mask
        e = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
        del scaled
        p = e / e.sum(axis=-1, keepdims=True)
        del e
        out = p @ v
        dv = np.swapaxes(p, -1, -2) @ grad
        dp = grad @ np.swapaxes(v, -1, -2)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
        del dp, p
        ds *= np.float32(1 / np.sqrt(q.shape[-1]))
        dq, dk = ds @ k, np.swapaxes(ds, -1, -2) @ q
        del ds, out, dv, dq, dk

    return run


def _torch(q, k, v, grad, causal: bool) -> Callable[[], None]:
    import torch

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tg = torch.tensor(grad)

    def run() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        out.backward(tg)
        for t in (tq, tk, tv):
            t.grad = None

    return run


def _median_ms(runs: list[Callable[[], None]], repeat: int) -> list[float]:
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def _peak_mib(run: Callable[[], None]) -> float:
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / MIB


def _inputs(batch: int, heads: int, tokens: int, width: int):
    rng = np.random.default_rng(0)
    shape = (batch, heads, tokens, width)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--time-up-to", type=int, default=2048, help="time these lengths")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-causal", action="store_true")
    args = parser.parse_args(argv)
    causal = not args.no_causal
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    print(f"b={args.batch} heads={args.heads} width={args.width} causal={causal}, float32")
    print(
        f"{'tokens':>6} {'fused ms':>9} {'torch ms':>9} {'ratio':>6} "
        f"{'fused MiB':>10} {'chain MiB':>10} {'ratio':>6}"
    )
    for tokens in args.tokens:
        q, k, v, grad = _inputs(args.batch, args.heads, tokens, args.width)
        fused, chain = _fused(q, k, v, grad, causal), _chain(q, k, v, grad, causal)
        timing = "" + " " * 26
        if tokens <= args.time_up_to and torch is not None:
            ours, theirs = _median_ms([fused, _torch(q, k, v, grad, causal)], args.repeat)
            timing = f"{ours:9.1f} {theirs:9.1f} {ours / theirs:6.2f}"
        fused_mib, chain_mib = _peak_mib(fused), _peak_mib(chain)
        print(
            f"{tokens:6d} {timing} {fused_mib:10.1f} {chain_mib:10.1f} "
            f"{fused_mib / chain_mib:6.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
