"""How a replica group splits an op: data parallelism's rule, and the pipeline rule's
inside each stage, one answer for both."""

from __future__ import annotations

import math

from onnx2soap.soap.dims import DimKind, SoapDim
from onnx2soap.soap.partition import ParallelConfig


def replica_split_kind(dims: tuple[SoapDim, ...]) -> DimKind:
    """The kind of dim data parallelism splits an op along: its samples; an op without a
    sample dim (computed from weights or constants alone: the Identity that shares a
    tied weight, its transposed read for the LM head) along its first splittable weight
    dim, else its first other kept dim, so that its readers gather it from every replica
    instead of from one device that sends each the whole tensor. A batch of one (a
    sample dim that cannot split) keeps an op whole."""
    if any(d.kind is DimKind.SAMPLE for d in dims):
        return DimKind.SAMPLE
    split = (
        k
        for k in (DimKind.PARAMETER, DimKind.ATTRIBUTE)
        for d in dims
        if d.kind is k and d.splittable
    )
    return next(split, DimKind.SAMPLE)


def split_first(dims: tuple[SoapDim, ...], kind: DimKind, group: tuple[int, ...]) -> ParallelConfig:
    """The op's first splittable dim of ``kind`` split over as many of ``group``'s devices
    as it allows; whole on the group's first device where none splits."""
    degrees = [1] * len(dims)
    for i, d in enumerate(dims):
        if d.kind is kind and d.splittable:
            degrees[i] = min(len(group), d.max_degree)
            break
    return ParallelConfig(tuple(degrees), group[: math.prod(degrees)])


def replica_config(
    dims: tuple[SoapDim, ...], group: tuple[int, ...], weight_only: bool = False
) -> ParallelConfig:
    """The op split over ``group`` as data parallelism splits it: data parallelism's
    own configs, and the pipeline rule's inside each stage.

    A weight-only op (``soap/copies.py``; the caller says) is computed whole on every
    device of the group (``copies``), as DDP computes it: its readers read it where
    they are and only its weights' gradients are summed. Split along a weight dim
    instead, every reader gathered it from every replica and sent the gradients back
    each step (rnntc's LSTM weights, fed through Slice x 4 -> Concat: 758.6 ms a step
    on alpa-v100:16 where DDP takes about 150-185). Whole on a stage's first device, a
    tied weight's Identity sent the whole weight to every device of the head's stage
    each microbatch and held it a slot each (GPT-1.3B in 8 stages of 8 V100s: 62.7 GiB
    on the first device, 15.9 on its stage's others; spread, 24.6 on each)."""
    if weight_only and len(group) > 1:
        return ParallelConfig((1,) * len(dims), tuple(group), len(group))
    return split_first(dims, replica_split_kind(dims), group)
