"""The runtime's assembly copies on CPU ranks: a tile not read in place costs a copy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.taskgraph import TaskKind
from onnx2soap.soap import Partitioner, Strategy
from tests.sim.test_makespan import config
from tests.sim.tiny import round_machine, tiny_graph

COPY_BW = 1e6  # bytes/s: a copy of b bytes, read and written, takes 2b us


def _machine(devices: int, use_compute: bool = True):
    m = round_machine(devices, use_compute=use_compute)
    slow = tuple(replace(d, memory_bandwidth=COPY_BW) for d in m.devices)
    return replace(m, devices=slow)


def _copies(graph, strategy, machine) -> list[tuple[str, float]]:
    sim = Simulator(machine, RooflineCost())
    tg = sim.task_graph(Partitioner(graph).partition(strategy), names=True)
    return [
        (tg.names[i], float(tg.duration[i]))
        for i in range(tg.size)
        if tg.kind[i] == int(TaskKind.TRANSFER) and tg.names[i].startswith("copy ")
    ]


def test_split_tiles_are_copied_into_the_whole_buffer(tmp_path) -> None:
    """Gemm in two batch halves on device 0, the loss whole there: logits [4, 4] is
    assembled from two [2, 4] tiles (32 bytes each) forward, and its gradient summed
    into each half's zeroed buffer backward (fill, read two, write: 4 passes)."""
    g = tiny_graph(tmp_path)
    s = Strategy(1, {"gemm": config(g, "gemm", [0, 0], n=2), "loss": config(g, "loss", [0])})
    found = _copies(g, s, _machine(1))
    tiles = [v for k, v in found if k.startswith("copy logits")]
    grads = [v for k, v in found if k.startswith("copy grad logits")]
    assert tiles == pytest.approx([2 * 32 / COPY_BW] * 2, rel=1e-12)
    assert grads == pytest.approx([4 * 32 / COPY_BW] * 2, rel=1e-12)


def test_a_whole_local_tile_is_read_in_place(tmp_path) -> None:
    g = tiny_graph(tmp_path)
    s = Strategy(1, {"gemm": config(g, "gemm", [0]), "loss": config(g, "loss", [0])})
    assert _copies(g, s, _machine(1)) == []


def _extra(g, s, devices: int) -> list[float]:
    """Per transfer, the copy the runtime adds to it on CPU ranks (against copy engines)."""
    pg = Partitioner(g).partition(s)
    a = Simulator(_machine(devices), RooflineCost()).task_graph(pg, names=True)
    b = Simulator(_machine(devices, use_compute=False), RooflineCost()).task_graph(pg, names=True)
    sent = {name: i for i, name in enumerate(b.names) if name.startswith(("send ", "grad "))}
    return sorted(
        float(a.duration[i] - b.duration[sent[name]])
        for i, name in enumerate(a.names)
        if name in sent
    )


def test_a_whole_received_tile_is_read_in_place(tmp_path) -> None:
    """Logits made on device 0, the loss on device 1: the receive buffer is the loss's
    whole input, and the loss's gradient the Gemm's whole output gradient (layout.Received)."""
    g = tiny_graph(tmp_path)
    s = Strategy(2, {"gemm": config(g, "gemm", [0]), "loss": config(g, "loss", [1])})
    assert _extra(g, s, 2) == [0.0, 0.0]
    assert _copies(g, s, _machine(2, use_compute=False)) == []


def test_a_received_piece_is_copied_on_its_receiver_after_its_transfer(tmp_path) -> None:
    """Gemm in batch halves on devices 0 and 1, the loss whole on 1: the half received
    from device 0 (32 bytes) is copied into the loss's buffer by device 1 alone, once it
    has arrived (the runtime copies it inside the loss's instruction: device 0 is not
    held for it); its gradient, device 0's whole output gradient, is read in place."""
    g = tiny_graph(tmp_path)
    s = Strategy(2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [1])})
    assert _extra(g, s, 2) == [0.0, 0.0]  # the transfers themselves as on copy engines
    tg = Simulator(_machine(2), RooflineCost()).task_graph(Partitioner(g).partition(s), names=True)
    (i,) = [i for i, name in enumerate(tg.names) if name == "copy logits 0->1"]
    assert float(tg.duration[i]) == pytest.approx(2 * 32 / COPY_BW, rel=1e-12)
    assert tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]].tolist() == [1]
    (pred,) = tg.pred_idx[tg.pred_ptr[i] : tg.pred_ptr[i + 1]].tolist()
    assert tg.names[pred] == "send logits 0->1"


def test_a_strided_tile_is_staged_by_its_sender(tmp_path) -> None:
    """The Gemm whole on device 0, the Relu in feature halves on devices 0 and 1, the
    loss on 1: device 1's half of y [4, 4] (columns 2-3, 32 bytes) is strided in device
    0's tile, so device 0 copies it into a staging buffer before sending it (the
    executor's ``send``); backward, device 0's half of the logits' gradient is strided
    in the loss's [4, 4] input gradient, staged by device 1. The other pieces are whole
    tiles or whole input gradients, sent as they are."""
    g = tiny_graph(tmp_path, relu=True)
    s = Strategy(
        2,
        {
            "gemm": config(g, "gemm", [0]),
            "relu": config(g, "relu", [0, 1], f=2),
            "loss": config(g, "loss", [1]),
        },
    )
    pg = Partitioner(g).partition(s)
    tg = Simulator(_machine(2), RooflineCost()).task_graph(pg, names=True)
    staged = {name: i for i, name in enumerate(tg.names) if name.startswith("stage ")}
    assert staged.keys() == {"stage y 0->1", "stage grad logits 0->1"}
    for name, device, message in (
        ("stage y 0->1", 0, "send y 0->1"),
        ("stage grad logits 0->1", 1, "grad logits 0->1"),
    ):
        i = staged[name]
        assert float(tg.duration[i]) == pytest.approx(2 * 32 / COPY_BW, rel=1e-12)
        assert tg.res_idx[tg.res_ptr[i] : tg.res_ptr[i + 1]].tolist() == [device]
        (sent,) = [j for j, n in enumerate(tg.names) if n == message]
        assert tg.pred_idx[tg.pred_ptr[sent] : tg.pred_ptr[sent + 1]].tolist() == [i]
    # On copy engines nothing is staged on the cores.
    engines = Simulator(_machine(2, use_compute=False), RooflineCost()).task_graph(pg, names=True)
    assert not any(name.startswith("stage ") for name in engines.names)


def test_a_received_copy_does_not_wait_for_the_message_in_flight(tmp_path) -> None:
    """Ranks that nap (``message_busy``): a message holds its ends for part of its
    latency and the rest is in flight, holding nothing. The receiver's copy follows the
    held part and the consumer waits for the in-flight rest after it: a copy placed
    after the rest would stall the receiver's in-order tasks for it (GPT-2's random
    plans on 4 ranks on 2 cores were predicted at 2.3x what they measure)."""
    g = tiny_graph(tmp_path)
    s = Strategy(2, {"gemm": config(g, "gemm", [0, 1], n=2), "loss": config(g, "loss", [1])})
    napping = replace(_machine(2), message_busy=0.5e-6)
    tg = Simulator(napping, RooflineCost()).task_graph(Partitioner(g).partition(s), names=True)

    def preds(name: str) -> list[str]:
        (i,) = [i for i, n in enumerate(tg.names) if n == name]
        return [tg.names[j] for j in tg.pred_idx[tg.pred_ptr[i] : tg.pred_ptr[i + 1]]]

    assert preds("copy logits 0->1") == ["send logits 0->1"]
    assert preds("in flight send logits 0->1") == ["copy logits 0->1"]
