"""Issue 29's families train as torch does, and on N ranks as on one device.

One float64 SGD step of the executor on one device is one ``torch.optim.SGD`` step of the
same torch module on the same batch (``tests/llm/reference.py`` says what torch is made to
do as the file says it), for Llama, Mistral and Qwen2 (rotary positions, RMSNorm,
grouped-query attention, SiLU gates; Llama's and Qwen2's heads tied), RoBERTa's masked LM
(position ids computed from the ids), a Conv1d+GroupNorm audio classifier, T5 and BART
fed their labels (shifted right in the graph) and torch's nn.Transformer (time-major
inside). Then two steps on a random 2-rank plan under mpiexec equal two steps on one
device (for one of the three decoders a run, drawn); and, for the families that compute
integers from the data, a data-parallel plan splits those integer ops by batch too.

Compared: the loss to 1e-12 relative and every trainable weight to 1e-10 relative, with
an absolute floor of 1e-12 for the attention key biases (softmax ignores a number added to
all of a query's scores, so their gradient is zero in exact arithmetic and both sides
hold rounding noise after the step: tests/sequences/test_torch_step.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.executor.mpi import assert_same_training, make_plan, mpirun
from tests.llm.runs import one_device
from tests.sampling import seeded_sample

pytestmark = pytest.mark.mpi

BATCH, LR = 4, 0.1
LOSS_RTOL, RTOL, ATOL = 1e-12, 1e-10, 1e-12
RANDOM_RANKS, RANDOM_SEED, STEPS = 2, 5, 2
CASES = [
    ("llama", "dynamo"),
    ("mistral", "dynamo"),
    ("qwen2", "dynamo"),
    ("roberta", "dynamo"),
    ("roberta", "legacy"),
    ("audio", "dynamo"),
    ("audio", "legacy"),
    ("t5", "dynamo"),
    ("bart", "dynamo"),
    ("transformer", "dynamo"),
]
# Exporter variants of a family train like it on many ranks: their one step equal to
# torch's is enough (CI time). T5's integer ops are BART's (tests/llm/test_integer_data.py
# has every kind, split by batch).
# Llama, Mistral and Qwen2 are one decoder (rotary positions, RMSNorm, grouped-query
# attention, SiLU gates) told apart by a tied head and q/k/v biases: each still steps as
# torch does, and tied weights train on random plans in tests/executor and
# tests/sequences, so one of the three, drawn (tests/sampling.py), trains on a random
# plan a run (CI's 20 minutes).
DECODERS = {"llama", "mistral", "qwen2"}
RANDOM_PLANS = seeded_sample(
    [c for c in CASES if c not in {("roberta", "legacy"), ("audio", "legacy")}],
    "llm-random-plans",
    per=lambda case: "decoder" if case[0] in DECODERS else case,
)
INTEGER_DATA = [("roberta", "dynamo"), ("bart", "dynamo")]


def _ids(case: tuple[str, str]) -> str:
    return "-".join(case)


def _data(name: str, directory: Path) -> tuple[dict[str, np.ndarray], Path]:
    from tests.llm.reference import batch_data

    arrays = batch_data(name, BATCH, np.random.default_rng(2024))
    path = directory / "data.npz"
    np.savez(path, **arrays)
    return arrays, path


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_one_step_is_torch_sgd(llm_onnx, tmp_path: Path, case: tuple[str, str]) -> None:
    from tests.llm.reference import one_torch_thread, torch_model, torch_step

    name, exporter = case
    path = llm_onnx(name, exporter)
    arrays, data = _data(name, tmp_path)
    with warnings.catch_warnings(), one_torch_thread():
        warnings.simplefilter("ignore")
        model, onnx_name = torch_model(name, path)
        loss, weights = torch_step(name, model, arrays, LR)
    plan = tmp_path / "one.json"
    make_plan(path, plan, 1, BATCH, "data-parallel")
    losses, ours = one_device(plan, data, 1, LR)
    np.testing.assert_allclose(losses, [loss], rtol=LOSS_RTOL, atol=0, err_msg=_ids(case))
    # Every trainable weight saved once, under its initializer's name, and compared.
    assert set(ours) == set(onnx_name.values()), _ids(case)
    for torch_name, want in weights.items():
        got = ours[onnx_name[torch_name]]
        np.testing.assert_allclose(
            got, want, rtol=RTOL, atol=ATOL, err_msg=f"{_ids(case)}: {onnx_name[torch_name]}"
        )


@pytest.mark.parametrize(("name", "exporter"), RANDOM_PLANS)
def test_random_plan_trains_like_one_device(llm_onnx, tmp_path: Path, name, exporter) -> None:
    path = llm_onnx(name, exporter)
    _, data = _data(name, tmp_path)
    one = tmp_path / "one.json"
    make_plan(path, one, 1, BATCH, "data-parallel")
    losses, weights = one_device(one, data, STEPS, LR)
    plan = tmp_path / f"random-{RANDOM_RANKS}.json"
    make_plan(path, plan, RANDOM_RANKS, BATCH, "random", RANDOM_SEED)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    run = mpirun(plan, RANDOM_RANKS, tmp_path, *args)
    assert_same_training(run, losses, weights, rtol=RTOL)


@pytest.mark.parametrize("case", INTEGER_DATA, ids=_ids)
def test_integer_ops_split_by_batch_train_like_one_device(llm_onnx, tmp_path: Path, case):
    """Data parallelism over 2 ranks splits every op that computes integers from the data
    (position ids, the decoder's shifted labels) by batch, as every other op; the ranks
    train exactly like one device."""
    from onnx2soap.importer import load_model
    from onnx2soap.soap import DimKind, analyze, load_plan

    name, exporter = case
    path = llm_onnx(name, exporter)
    _, data = _data(name, tmp_path)
    plan = tmp_path / "dp.json"
    make_plan(path, plan, 2, BATCH, "data-parallel")
    degrees = {op.name: dict(op.degrees) for op in load_plan(plan).ops}
    graph = load_model(path, BATCH).graph
    space = analyze(graph)
    computed = [
        op
        for op in graph.ops
        if not graph.tensors[op.output].dtype.is_float and graph.tensors[op.output].batched
    ]
    assert computed, f"{_ids(case)} computes no integers from its data"
    for op in computed:
        (sample,) = (d for d in space[op.name] if d.kind is DimKind.SAMPLE)
        assert sample.splittable and degrees[op.name] == {sample.name: 2}, (op.name, op.type)
    one = tmp_path / "one.json"
    make_plan(path, one, 1, BATCH, "data-parallel")
    losses, weights = one_device(one, data, STEPS, LR)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    assert_same_training(mpirun(plan, 2, tmp_path, *args), losses, weights, rtol=RTOL)


def _llama_reference(llm_onnx, tmp_path: Path, batch: int = BATCH):
    """(the Llama's file, its data, one device's losses and weights after STEPS steps)."""
    from tests.llm.reference import batch_data

    path = llm_onnx("llama", "dynamo")
    data = tmp_path / "data.npz"
    np.savez(data, **batch_data("llama", batch, np.random.default_rng(2024)))
    one = tmp_path / "one.json"
    make_plan(path, one, 1, batch, "data-parallel")
    losses, weights = one_device(one, data, STEPS, LR)
    return path, data, losses, weights


def _rule_plan(path: Path, plan: Path, devices: int, batch: int, *rule: str):
    """The plan ``onnx2soap plan --strategy ...`` writes, as loaded back."""
    from onnx2soap.cli import main as onnx2soap_main
    from onnx2soap.soap import load_plan

    argv = ["plan", str(path), "--devices", str(devices), "--batch", str(batch), "-o", str(plan)]
    assert onnx2soap_main([*argv, *rule]) == 0
    return load_plan(plan)


def _trains_like(plan: Path, ranks: int, tmp_path: Path, data: Path, losses, weights) -> None:
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    assert_same_training(mpirun(plan, ranks, tmp_path, *args), losses, weights, rtol=RTOL)


def test_sequence_parallel_megatron_trains_like_one_device(llm_onnx, tmp_path: Path) -> None:
    """``--strategy megatron --sequence-parallel`` on 2 ranks of a Llama with 4 sequences
    (enough to split by samples): the attention by heads, the ops between the blocks
    (RMSNorm's pieces, the residual adds) along the sequence instead; the ranks train
    exactly like one device."""
    from onnx2soap.importer import load_model
    from onnx2soap.soap import DimKind, analyze

    path, data, losses, weights = _llama_reference(llm_onnx, tmp_path)
    plan = tmp_path / "sp.json"
    doc = _rule_plan(path, plan, 2, BATCH, "--strategy", "megatron", "--sequence-parallel")
    graph = load_model(path, BATCH).graph
    space = analyze(graph)
    degrees = {op.name: dict(op.degrees) for op in doc.ops}
    (attention, *_) = [op for op in graph.ops if op.type == "Attention"]
    assert degrees[attention.name].get("h") == 2 and degrees[attention.name].get("n", 1) == 1
    by_sequence = [
        op
        for op in graph.ops
        if op.type == "Add"
        and graph.tensors[op.output].batched
        and any(
            d.kind is not DimKind.SAMPLE and degrees[op.name].get(d.name, 1) == 2
            for d in space[op.name]
        )
    ]
    assert len(by_sequence) >= 4, "the residual adds of both layers, by the sequence"
    _trains_like(plan, 2, tmp_path, data, losses, weights)


def test_context_parallel_plan_trains_like_one_device(llm_onnx, tmp_path: Path) -> None:
    """``--strategy context`` on 4 ranks of a Llama: every op along the sequence, the
    attention along its queries reading every key; its mask is causal, so the 8 tokens
    are cut in 8 chunks, rank i holding chunks i and 7 - i (head-tail), and the ops
    between the attentions (norms, MLP, residual adds) are cut alike, so nothing moves
    between them; the ranks train exactly like one device. ``--no-head-tail`` cuts one
    contiguous chunk a rank."""
    from onnx2soap.importer import load_model
    from onnx2soap.soap import Partitioner, analyze

    path, data, losses, weights = _llama_reference(llm_onnx, tmp_path)
    plan = tmp_path / "cp.json"
    doc = _rule_plan(path, plan, 4, BATCH, "--strategy", "context")
    graph = load_model(path, BATCH).graph
    configs = {op.name: op for op in doc.ops}
    degrees = {op.name: dict(op.degrees) for op in doc.ops}
    space = analyze(graph)
    head_tail = (0, 1, 2, 3, 3, 2, 1, 0)
    for attention in (op for op in graph.ops if op.type == "Attention"):
        assert degrees[attention.name] == {"m": 8}, degrees[attention.name]
        assert configs[attention.name].devices == head_tail
    tokens = graph.tensors[graph.inputs[0]].shape[1]
    by_sequence = [
        op
        for op in graph.ops
        if any(d.size == tokens and degrees[op.name].get(d.name) == 8 for d in space[op.name])
    ]
    assert len(by_sequence) > len(graph.ops) // 2
    assert all(configs[op.name].devices == head_tail for op in by_sequence)
    # tiles cross devices on the edges the contiguous plan's cross alone: into the
    # attention (K and V), from the tied embedding's weight, from the rotary frequencies
    types = {op.name: op.type for op in graph.ops}

    def crossing(plan_doc) -> set[tuple[str, str]]:
        pg = Partitioner(graph).partition(plan_doc.strategy(graph, space))
        return {
            (types[e.producer], types[e.consumer])
            for e in pg.edges
            for o in e.overlaps
            if pg.tasks[e.producer][o.src_task].device != pg.tasks[e.consumer][o.dst_task].device
        }

    contiguous = _rule_plan(
        path, tmp_path / "cpc.json", 4, BATCH, "--strategy", "context", "--no-head-tail"
    )
    for op in contiguous.ops:
        if types[op.name] == "Attention":
            assert dict(op.degrees) == {"m": 4} and op.devices == (0, 1, 2, 3)
    moved = crossing(doc)
    assert ("Slice", "Attention") in moved and moved == crossing(contiguous), moved
    _streams_keys(graph, doc.strategy(graph, space), 4)
    _trains_like(plan, 4, tmp_path, data, losses, weights)


def _streams_keys(graph, strategy, ranks: int) -> None:
    """Ring attention: every attention task takes its keys in one block a rank, its own
    rank's first and the others in ring order (rank r: r, r-1, ...), and no rank's
    program waits for a K or V piece before the attention's kernel (the kernel waits
    for each block as it reaches it)."""
    from executor.program import Compute, Phase, Wait, compile_program
    from onnx2soap.soap import Partitioner
    from onnx2soap.soap.streamed import key_blocks

    pg = Partitioner(graph).partition(strategy)
    index = {op.name: i for i, op in enumerate(graph.ops)}
    attentions = [op for op in graph.ops if op.type == "Attention"]
    for op in attentions:
        for task in pg.tasks[op.name]:
            blocks = key_blocks(op, pg.tasks[op.name], task)
            order = [b.device for b in blocks]
            assert sorted(order) == list(range(ranks)) and order[0] == task.device, order
            # the blocks it works on in ring order; those past its causal diagonal last
            working = [b.device for b in blocks if b.share > 0]
            ring = [(task.device - s) % ranks for s in range(ranks)]
            assert working == [d for d in ring if d in working]
            assert order[: len(working)] == working
            assert sum(b.share for b in blocks) == pytest.approx(1.0)
    streamed = {index[op.name] for op in attentions}
    for rank in range(ranks):
        program = compile_program(pg, rank).instructions
        waited = {
            ins.transfer.consumer[0]
            for ins in program
            if isinstance(ins, Wait) and ins.transfer.phase is Phase.FORWARD
            if ins.transfer.operand in (1, 2)
        }
        assert not waited & streamed
        assert any(isinstance(i, Compute) and i.op in streamed for i in program)


def test_context_parallel_with_zero3_trains_like_one_device(llm_onnx, tmp_path: Path) -> None:
    """``--strategy context --zero-stage 3`` (FSDP with context parallelism) on 2 ranks:
    the weights sharded over the sequence's devices, gathered for each op."""
    path, data, losses, weights = _llama_reference(llm_onnx, tmp_path)
    plan = tmp_path / "cpz.json"
    doc = _rule_plan(path, plan, 2, BATCH, "--strategy", "context", "--zero-stage", "3")
    assert doc.zero_stage == 3
    _trains_like(plan, 2, tmp_path, data, losses, weights)


def test_one_long_sequence_over_ranks_trains_like_one_device(llm_onnx, tmp_path: Path) -> None:
    """One sequence, context parallelism over 2 ranks: every op, the loss too, splits the
    positions (the loss's partial sums, as a split batch's), in head and tail chunks (4,
    on ranks 0, 1, 1, 0: the mask is causal); nothing lands whole on one rank, and the
    ranks train exactly like one device."""
    from onnx2soap.importer import load_model

    path, data, losses, weights = _llama_reference(llm_onnx, tmp_path, batch=1)
    plan = tmp_path / "cp1.json"
    doc = _rule_plan(path, plan, 2, 1, "--strategy", "context")
    graph = load_model(path, 1).graph
    ops = {op.name: op for op in doc.ops}
    loss = ops[graph.loss_op.name]
    assert max(dict(loss.degrees).values()) == 4 and loss.devices == (0, 1, 1, 0)  # positions
    _trains_like(plan, 2, tmp_path, data, losses, weights)


@pytest.mark.gpu
def test_context_parallel_on_gpus_trains_like_one_device(llm_onnx, tmp_path: Path) -> None:
    """Ring attention over NCCL (4 ranks, a GPU each): each attention kernel waits for
    its blocks' K and V pieces as it reaches them, on device arrays; exactly one CPU
    device's training."""
    from tests.optional import cupy_or_skip

    cp = cupy_or_skip()
    if cp.cuda.runtime.getDeviceCount() < 4:
        pytest.skip("needs 4 GPUs (NCCL takes one per rank)")
    path, data, losses, weights = _llama_reference(llm_onnx, tmp_path)
    plan = tmp_path / "cp.json"
    _rule_plan(path, plan, 4, BATCH, "--strategy", "context")
    args = ("--steps", str(STEPS), "--lr", str(LR), "--dtype", "float64", "--data", str(data))
    run = mpirun(plan, 4, tmp_path, *args, "--device", "cuda", "--transport", "nccl")
    assert_same_training(run, losses, weights, rtol=RTOL)


def test_context_parallel_trains_like_one_device_in_bf16(llm_onnx, tmp_path: Path) -> None:
    """Ring attention in mixed precision: the blocks' K and V pieces are stored in bf16
    and widened into the kernel's float32 copies as they arrive (made before they
    were there); 4 ranks against one device in bf16, within a few half-format ulps
    (sums in other orders move values across rounding boundaries: up to 1.6e-4 here),
    where a block read before it was copied in would be garbage."""
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train
    from onnx2soap.precision import Precision

    path, data, _, _ = _llama_reference(llm_onnx, tmp_path)
    plan = tmp_path / "cp.json"
    _rule_plan(path, plan, 4, BATCH, "--strategy", "context")

    def one(precision: Precision):
        options = RunOptions(
            plan=tmp_path / "one.json",
            steps=STEPS,
            lr=LR,
            data=data,
            device=DeviceKind.CPU,
            precision=precision,
        )
        return train(MPI.COMM_SELF, options, gather=True)

    ref = one(Precision.BF16)
    args = ("--steps", str(STEPS), "--lr", str(LR), "--data", str(data), "--precision", "bf16")
    run = mpirun(plan, 4, tmp_path, *args)
    assert run.returncode == 0, run.stderr[-2000:]
    np.testing.assert_allclose(run.losses, [r.loss for r in ref.steps], rtol=2e-3)
    for name, w in ref.weights.items():
        np.testing.assert_allclose(run.weights[name], w, rtol=0, atol=1e-3, err_msg=name)
