"""Mixed precision: the executor's losses next to torch.autocast's, and what it costs.

    python -m benchmarks.precision [--steps 20] [--width 256] [--batch 32]

An MLP (3 Linear layers of ``--width``, ReLU) exported from torch, trained with SGD on
the same data from the same weights: by torch (float32; autocast bf16; autocast fp16
with GradScaler) and by the executor on one CPU rank (``--precision fp32|bf16|fp16``).
The table gives each run's loss at the first, middle and last step, the largest
difference from torch's run in the same precision and from torch's float32 run (what the
half format itself moves), and the executor's median step time next to its float32 one
(rounding is extra work on a CPU: float32 arithmetic on rounded values). Needs torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import statistics
import tempfile

import numpy as np

from onnx2soap.precision import Precision

LR = 0.05


def _model(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def torch_losses(width: int, x, y, batch: int, precision: Precision) -> list[float]:
    import torch

    model = _model(width)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision)
    scaler = torch.amp.GradScaler("cpu", enabled=precision.scales_loss)
    losses = []
    for step in range(len(x) // batch):
        xb = torch.from_numpy(x[step * batch : (step + 1) * batch])
        yb = torch.from_numpy(y[step * batch : (step + 1) * batch])
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(xb)
        loss = torch.nn.functional.cross_entropy(logits.float(), yb)
        scaler.scale(loss).backward()
        scaler.step(sgd)
        scaler.update()
        losses.append(loss.item())
    return losses


def our_losses(folder: Path, steps: int, precision: Precision) -> tuple[list[float], float]:
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train

    options = RunOptions(
        plan=folder / "plan.json",
        steps=steps,
        lr=LR,
        data=folder / "data.npz",
        device=DeviceKind.CPU,
        precision=precision,
    )
    result = train(MPI.COMM_SELF, options)
    times = [r.time_s for r in result.steps[1:]] or [result.steps[0].time_s]
    return [r.loss for r in result.steps], statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    import torch

    from onnx2soap.cli import main as onnx2soap_main
    from tests.models import export

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = export(_model(args.width), torch.zeros(args.batch, args.width), folder / "m.onnx")
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.steps * args.batch, args.width)).astype(np.float32)
        y = rng.integers(0, 10, args.steps * args.batch)
        np.savez(folder / "data.npz", input=x, labels=y)
        plan = ["plan", str(model), "--batch", str(args.batch), "--devices", "1"]
        assert (
            onnx2soap_main([*plan, "--strategy", "single-device", "-o", str(folder / "plan.json")])
            == 0
        )
        reference = torch_losses(args.width, x, y, args.batch, Precision.FP32)
        time32 = 0.0
        print(f"\nMLP {args.width} wide, batch {args.batch}, {args.steps} SGD steps, one CPU rank")
        print(
            "| precision | run | loss 1 / mid / last | max diff from torch same | "
            "max diff from torch fp32 | step ms (x fp32) |"
        )
        print("|---|---|---|---|---|---|")
        for precision in Precision:
            theirs = torch_losses(args.width, x, y, args.batch, precision)
            ours, step = our_losses(folder, args.steps, precision)
            if precision is Precision.FP32:
                time32 = step
            for name, losses in (("torch", theirs), ("onnx2soap", ours)):
                same = max(abs(a - b) for a, b in zip(losses, theirs, strict=True))
                full = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
                shown = " / ".join(
                    f"{v:.5f}" for v in (losses[0], losses[len(losses) // 2], losses[-1])
                )
                timing = f"{step * 1e3:.2f} ({step / time32:.2f}x)" if name != "torch" else ""
                print(
                    f"| {precision.value} | {name} | {shown} | {same:.2e} | {full:.2e} | {timing} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
