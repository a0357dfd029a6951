"""A recomputed tile's lifetime as the executor has it (``executor/step.py``: dropped
after its last forward reader, rematerialized before the backward of the first op, in
the backward's order, that needs it, directly or through a recomputed reader's own
rematerialization, and dropped after its own backward), against peaks by hand.

``total`` on a chain of seven ops on one device, the last one the loss: each op's tile
100 bytes (none for the loss), the gradient its backward makes 10, its backward kernel
1 byte of its own, its forward none beyond a recomputed op's tile, which its forward
kernel makes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx2soap.importer import load_model
from onnx2soap.sim import RooflineCost, make_simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.memory import OpMemory, Order, order_of, rematerialized_at, total
from onnx2soap.soap import ParallelConfig, Partitioner, Strategy, analyze
from tests.sim.test_pipeline_price import chain_of_gemms
from tests.sim.tiny import round_machine

TILE, GRAD, KERNEL, OPS = 100, 10, 1, 7
CHAIN = (*((i + 1,) for i in range(OPS - 1)), ())  # op i's reader: op i + 1
ORDER = Order(CHAIN, ((),) * OPS)  # no activation gradients: every gradient held


def _chain(recomputed: set[int]) -> tuple[list[int], list[OpMemory]]:
    """(held per device, the ops): ``held`` is what the step keeps to its end, the kept
    ops' tiles and every gradient."""
    ops = []
    for i in range(OPS):
        tile = 0 if i == OPS - 1 else TILE
        redone = i in recomputed
        ops.append(
            OpMemory(
                held=((0, GRAD + (0 if redone else tile)),),
                outputs=((0, 0 if redone else tile),),
                grads=((0, GRAD),),
                forward=((0, tile if redone else 0),),
                backward=((0, KERNEL),),
                redone=((0, tile),) if redone else (),
            )
        )
    held = sum(n for m in ops for _, n in m.held)
    return [held], ops


def test_a_segment_is_made_again_at_its_checkpoints_readers_backward() -> None:
    """Op 3 kept (a checkpoint), 0-2 and 4-5 recomputed. 4 and 5 are made again before
    the loss's backward (5 for the loss, 4 for 5's rematerialization), 0-2 before op 3's.
    Held to the end: op 3's tile and 7 gradients, 170. In the backward at op j, the
    tiles made again and not yet through their own backward, less the gradients of the
    ops before j, not yet made (10 j): op 6, 1 + 200 - 60; op 5, 1 + 200 - 50; op 4,
    1 + 100 - 40; op 3, 1 + 300 - 30; op 2, 1 + 300 - 20 = 281, the most; op 1, 1 + 200 -
    10; op 0, 1 + 100. The forward's most is 300 (op 5: op 3's tile, op 4's still read,
    its own), 130 over what is held less the tiles and gradients (170 - 100 - 70 = 0).
    Peak: 170 + 281 = 451."""
    held, ops = _chain({0, 1, 2, 4, 5})
    assert rematerialized_at(ops, CHAIN) == [3, 3, 3, 3, 6, 6, 6]
    assert total(held, ops, ORDER) == (451,)
    # Counted in its own kernels only (the model before, readers assumed to run with
    # it): op 0's backward, 1 + 100, so 271: 180 bytes short.
    assert total(held, ops) == (170 + 101,)


def test_without_a_checkpoint_the_whole_forward_is_made_again_at_once() -> None:
    """Ops 0-5 recomputed: all made again before the loss's backward. Held: 7 gradients,
    70; at op 5, 1 + 600 - 50 = 551: 621, where the checkpoint kept it at 451."""
    held, ops = _chain({0, 1, 2, 3, 4, 5})
    assert rematerialized_at(ops, CHAIN) == [6] * OPS
    assert total(held, ops, ORDER) == (70 + 551,)


def test_a_kept_op_is_not_made_again() -> None:
    """Nothing recomputed: each op is its own, and the peak is the plain one: 670 held,
    at op 0's backward everything but nothing unmade, 1."""
    held, ops = _chain(set())
    assert rematerialized_at(ops, CHAIN) == list(range(OPS))
    assert total(held, ops, ORDER) == (671,)


@pytest.mark.parametrize("recompute", [(), ("g1", "g2"), ("g0", "g2"), ("g0", "g1", "g2")])
def test_delta_prices_a_checkpointed_chain_as_the_full_simulation(
    tmp_path: Path, recompute
) -> None:
    """A chain of four Gemms on one device, some recomputed: delta simulation (the
    search's) gives the full simulation's peak and step; recomputing lowers the peak."""
    graph = load_model(chain_of_gemms(tmp_path / "chain.onnx", 4), batch=8).graph
    space = analyze(graph)
    configs = {op.name: ParallelConfig((1,) * len(space[op.name]), (0,)) for op in graph.ops}
    strategy = Strategy(1, configs)
    partitioner = Partitioner(graph)
    sim = make_simulator(round_machine(1), RooflineCost(), recompute=recompute)
    ev = sim.evaluate(partitioner.partition(strategy))
    assert DeltaSimulator(sim, partitioner).evaluate(strategy)[0] == ev
    plain = make_simulator(round_machine(1), RooflineCost()).evaluate(
        partitioner.partition(strategy)
    )
    assert ev.peak_memory_bytes[0] <= plain.peak_memory_bytes[0]
    assert order_of(graph).consumers[0] == (1,)
