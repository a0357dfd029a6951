"""Group moves (search/groups.py) and the walk that uses them (search/mcmc.py).

Related ops are checked against graphs drawn by hand: a three-layer GPT written with
``onnx.helper`` (benchmarks/gpt_onnx.py names every op of layer k ``h{k}/...``, names
the search never reads) and the example CNN. Every move keeps the plan valid and is
simulated by delta simulation exactly as a full simulation simulates it; the walk with
them never returns a plan slower than its best start, walks every start as successive
halving says, and reaches the exhaustive optimum of a tiny graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpt_onnx import GptShape, write_gpt
from onnx2soap.importer import load_model
from onnx2soap.search.baselines import random_config, random_strategy
from onnx2soap.search.exhaustive import exhaustive
from onnx2soap.search.groups import Block, GroupMove, GroupMoves, find_groups, tandem_repeats
from onnx2soap.search.mcmc import (
    Restarts,
    SearchOptions,
    cost_of,
    halving_rounds,
    mcmc,
)
from onnx2soap.search.regions import RegionMoves, config_shape
from onnx2soap.sim import RooflineCost, Simulator
from onnx2soap.sim.delta import DeltaSimulator
from onnx2soap.sim.presets import preset
from onnx2soap.soap import Partitioner, analyze, candidates, validate
from tests.search.test_mcmc import hybrid_case

# width 16 in 2 heads of 8, 6 tokens, vocabulary 40, MLP 64: no two unrelated ops share a
# signature by an accident of equal sizes
TINY = GptShape(layers=3, width=16, heads=2, vocabulary=40, tokens=6)
LAYER_OPS = 26


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    graph = load_model(write_gpt(tmp_path_factory.mktemp("gpt"), TINY), batch=4).graph
    return graph, analyze(graph)


def layer(graph, k: int) -> tuple[str, ...]:
    return tuple(op.name for op in graph.ops if op.name.startswith(f"h{k}/"))


def test_a_transformer_s_layers_are_one_block_of_three_instances(gpt) -> None:
    graph, space = gpt
    groups = find_groups(graph, space)
    layers = tuple(layer(graph, k) for k in range(3))
    assert len(layers[0]) == LAYER_OPS
    assert groups.blocks == (Block(layers),)
    assert groups.counterparts["h1/attn/Attention"] == ("h0/attn/Attention", "h2/attn/Attention")
    assert groups.instance["h2/mlp/Gelu"] == layers[2]
    outside = ("wte/Gather", "wpe/Add", "ln_f", "lm_head", "loss")
    assert not any(name in groups.counterparts for name in outside)


def test_a_transformer_s_siblings_are_its_ops_of_one_signature(gpt) -> None:
    graph, space = gpt
    siblings = find_groups(graph, space).siblings
    norms = {f"h{k}/ln_{i}" for k in range(3) for i in (1, 2)} | {"ln_f"}
    assert {"h0/ln_1", *siblings["h0/ln_1"]} == norms
    # Q, K, V and the output projection: [16, 16] weights on the same activations
    square = {f"h{k}/attn/{w}/MatMul" for k in range(3) for w in ("q", "k", "v", "out")}
    assert {"h1/attn/v/MatMul", *siblings["h1/attn/v/MatMul"]} == square
    assert siblings["h0/mlp/up/MatMul"] == ("h1/mlp/up/MatMul", "h2/mlp/up/MatMul")
    # K's transpose, composed by the attention's fusion with the swap of its last two
    # axes, is Q's and V's now
    heads = {f"h{k}/attn/{w}/Transpose" for k in range(3) for w in "qv"}
    heads |= {f"h{k}/attn/Attention/K" for k in range(3)}
    assert {"h0/attn/q/Transpose", *siblings["h0/attn/q/Transpose"]} == heads
    assert not {"wte/Gather", "wpe/Add", "lm_head", "loss"} & set(siblings)


def test_a_transformer_s_chains_follow_their_producers(gpt) -> None:
    """Ops without weights, statistics or partial sums follow their latest producer; a
    bias Add has a weight, a MatMul of two activations a contraction to split."""
    graph, space = gpt
    chain = find_groups(graph, space).chain
    a = "h0/attn"
    merge = (f"{a}/merge/Transpose", f"{a}/merge/Reshape")
    assert {k: v for k, v in chain.items() if k.startswith("h0/")} == {
        f"{a}/q/Add": (f"{a}/q/Reshape", f"{a}/q/Transpose"),
        f"{a}/k/Add": (f"{a}/k/Reshape", f"{a}/Attention/K"),
        f"{a}/v/Add": (f"{a}/v/Reshape", f"{a}/v/Transpose", f"{a}/Attention", *merge),
        f"{a}/q/Reshape": (f"{a}/q/Transpose",),
        f"{a}/k/Reshape": (f"{a}/Attention/K",),
        f"{a}/v/Reshape": (f"{a}/v/Transpose", f"{a}/Attention", *merge),
        f"{a}/v/Transpose": (f"{a}/Attention", *merge),  # the attention's latest producer
        f"{a}/Attention": merge,
        f"{a}/merge/Transpose": (f"{a}/merge/Reshape",),
        f"{a}/out/Add": (f"{a}/residual",),
        "h0/mlp/up/Add": ("h0/mlp/Gelu",),
        "h0/mlp/down/Add": ("h0/mlp/residual",),
    }
    assert len(chain) == 3 * 12


def test_the_example_cnn_has_sibling_relus_chains_and_no_block(example_onnx: Path) -> None:
    """conv1 -> relu1 -> pool1 -> {a: conv -> relu, b: pool -> conv -> relu} -> Concat ->
    pool2 -> flatten -> fc1 -> relu_fc -> fc2 -> loss; Concat follows branch b, read last."""
    graph = load_model(example_onnx, batch=8).graph
    groups = find_groups(graph, analyze(graph))
    assert groups.blocks == ()
    a_relu, b_relu = "/branch_a/relu/Relu", "/branch_b/relu/Relu"
    assert groups.siblings == {a_relu: (b_relu,), b_relu: (a_relu,)}
    tail = ("/Concat", "/pool2/MaxPool", "/flatten/Flatten")
    assert groups.chain["/conv1/Conv"] == (
        "/relu1/Relu",
        "/pool1/MaxPool",
        "/branch_b/pool/AveragePool",
    )
    assert groups.chain["/branch_b/conv/Conv"] == (b_relu, *tail)
    assert groups.chain["/branch_a/conv/Conv"] == (a_relu,)
    assert groups.chain["/fc1/Gemm"] == ("/relu_fc/Relu",)
    assert "/fc2/Gemm" not in groups.chain and "loss" not in groups.chain


@pytest.mark.parametrize(
    ("ids", "repeats"),
    [
        ([0, 2, 3, 4, 2, 3, 4, 2, 3, 4, 5], [(1, 3, 3)]),
        ([0, 1] * 4, [(0, 2, 4)]),  # four pairs, not two quadruples
        ([7, 1, 2, 1, 2, 9, 3, 4, 5, 3, 4, 5, 3, 4, 5], [(1, 2, 2), (6, 3, 3)]),
        # a ResNet stem's Relu is its blocks' last op too: the blocks start at it
        ([0, 1, 2, 1, 2, 3, 1, 2, 1, 2, 3, 1, 4], [(1, 5, 2)]),
        ([0, 1, 2, 3], []),
        ([5, 5, 5], []),  # one op repeated: siblings, not a block
    ],
)
def test_tandem_repeats(ids: list[int], repeats: list[tuple[int, int, int]]) -> None:
    assert tandem_repeats(ids) == repeats


@pytest.mark.parametrize("move", list(GroupMove))
def test_group_moves_keep_plans_valid_and_simulate_as_a_full_simulation(gpt, move) -> None:
    """From a random strategy, six moves of one kind in a row, each after a random op's
    config is changed (else a copy has nothing left to copy), each checked against what
    it promises and simulated by delta from the previous state: the step time, memory and
    bytes of a full simulation of the same strategy, exactly."""
    graph, space = gpt
    machine = preset("flexflow-p100:1")
    devices = machine.size
    moves = {op.name: candidates(space[op.name], devices) for op in graph.ops}
    groups = GroupMoves(graph, space, RegionMoves(graph, space, moves))
    g = groups.groups
    partitioner = Partitioner(graph)
    delta = DeltaSimulator(Simulator(machine, RooflineCost()), partitioner)
    full = Simulator(machine, RooflineCost())
    rng = np.random.default_rng(hash(move.value) % 2**32)
    strategy = random_strategy(graph, space, devices, rng)
    _, state = delta.evaluate(strategy)
    related = [op.name for op in graph.ops if g.related(op.name)]
    made = 0
    for _ in range(100):  # a move that changes nothing is drawn again
        if made == 6:
            break
        other = graph.ops[int(rng.integers(len(graph.ops)))].name
        strategy = strategy.replace(other, random_config(space[other], devices, rng))
        pivot = related[int(rng.integers(len(related)))]
        config = moves[pivot][int(rng.integers(len(moves[pivot])))]
        proposal = groups.propose(strategy, pivot, config, move, rng)
        if proposal is None:
            continue
        validate(graph, space, proposal)
        changed = {n for n in strategy.configs if proposal[n] != strategy[n]}
        if move is GroupMove.CHAIN:
            assert proposal[pivot] == config and changed <= {pivot, *g.chain.get(pivot, ())}
            shape = config_shape(space[pivot], config)
            assert all(config_shape(space[n], proposal[n]) == shape for n in changed)
        elif move is GroupMove.SIBLINGS:
            assert proposal[pivot] == config
            assert all(proposal[s] == config for s in g.siblings.get(pivot, ()))
        elif move is GroupMove.BLOCK:
            partners = g.counterparts.get(pivot, g.siblings.get(pivot, ()))
            assert proposal[pivot] == config and all(proposal[p] == config for p in partners)
        else:  # COPY: every instance of the pivot's block now has its instance's configs
            own = g.instance.get(pivot, (pivot,))
            for ops in (b.instances for b in g.blocks if own in b.instances):
                for other in ops:
                    assert [proposal[n] for n in other] == [strategy[n] for n in own]
        ev, state = delta.evaluate(proposal, state)
        reference = full.evaluate(partitioner.partition(proposal))
        assert ev == reference, (move, pivot, sorted(changed))
        strategy, made = proposal, made + 1
    assert made == 6


@pytest.mark.parametrize("seed", [0, 1])
def test_the_walk_is_never_slower_than_its_best_start_and_walks_every_start(gpt, seed) -> None:
    graph, space = gpt
    sim = Simulator(preset("flexflow-p100:2"), RooflineCost())
    result = mcmc(graph, space, sim, SearchOptions(budget_s=300, seed=seed, max_evals=150))
    fitting = {n: ev for n, ev in result.starts.items() if ev.fits}
    best = min(fitting, key=lambda n: fitting[n].step_time_s)
    assert fitting[result.best_start].step_time_s == fitting[best].step_time_s
    assert result.evaluation.step_time_s <= fitting[best].step_time_s
    assert result.walk_gain == fitting[best].step_time_s / result.evaluation.step_time_s >= 1
    # every start walked once, distinct strategies once, fastest first
    names = [n for w in result.walks for n in w.names]
    assert sorted(names) == sorted(result.starts)
    costs = [cost_of(result.starts[w.names[0]]) for w in result.walks]
    assert costs == sorted(costs)
    for w in result.walks:
        assert w.best_step_time_s <= cost_of(result.starts[w.names[0]])
        assert all(result.starts[n] == result.starts[w.names[0]] for n in w.names)
    assert min(w.best_step_time_s for w in result.walks) == result.evaluation.step_time_s
    assert sum(w.proposals for w in result.walks) == result.proposals <= 150
    # successive halving: round k walks counts[k] starts (the rounds it reached)
    counts = halving_rounds(len(result.walks))
    reached = max(w.rounds for w in result.walks)
    assert [sum(w.rounds > k for w in result.walks) for k in range(reached)] == counts[:reached]


def test_group_moves_find_the_brute_force_optimum_of_a_tiny_graph(tmp_path: Path) -> None:
    """The tiny hybrid case (its optimum is no start: test_mcmc.py), half the proposals
    group moves, walked by halving: the exhaustive optimum, under the same simulator, for
    most seeds."""
    graph, space, sim = hybrid_case(tmp_path)
    optimum = exhaustive(graph, space, sim).evaluation.step_time_s
    found = 0
    for seed in range(10):
        options = SearchOptions(budget_s=120, seed=seed, max_evals=300, group_share=0.5)
        assert options.restarts is Restarts.HALVING
        step = mcmc(graph, space, sim, options).evaluation.step_time_s
        assert step >= optimum - 1e-15
        found += step == pytest.approx(optimum, rel=1e-12)
    assert found >= 8
