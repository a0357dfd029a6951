"""Hand-offs between ranks: what a message costs when its receiver has been waiting long.

    python -m benchmarks.handoff                       # 2 and 4 ranks, default sweep
    python -m benchmarks.handoff --ranks 4 --work-us 0 1000 --modes nap bell --repeats 3
    python -m benchmarks.handoff --ranks 4 --blocks 1 8 32 --repeats 5
    python -m benchmarks.handoff --ranks 4 --plans MP.json SD.json --repeats 3

In a model-parallel plan the step's critical path passes from rank to rank: one rank
computes while the others wait for its tile, then it sends, and the receiver, which has
waited the whole time, must notice the message and get a core. ``machine probe`` prices a
message by a chain of tiny Relus alternating between two ranks
(``onnx2soap/measure/probe_messages.py``), where a receiver waits only a few tens of
microseconds, so its waits rarely pass the transport's spinning and first naps. Here a
token goes round the ranks (0 -> 1 -> ... -> N-1 -> 0): each rank, on receiving it,
computes ``work`` (a fixed count of small float32 matmuls, calibrated to the asked
microseconds on rank 0 alone) and sends it on, so every receiver has waited about
(N-1) x work before its message comes. Per hop, from the sender's clock stamped in the
message (``perf_counter``: CLOCK_MONOTONIC, one clock for the host's processes):

- ``latency``: from the sender's ``send`` to the receiver's ``wait`` returning;
- ``work``: how long the receiver's work then took, and its first matmul alone, against
  the same work run back to back on rank 0 alone (the others waiting in the same mode):
  whether an op runs slower right after a hand-off (cold caches, a vCPU that halted);
- ``cpu``: the ranks' processor time per hop (work included).

The ranks wait as the executor's transport waits (``executor/transport.py``'s
``MpiTransport.wait``), in one of three modes: ``spin`` (tests back to back: ranks that
have a core each), ``nap`` (50 us naps, no doorbell), ``bell`` (naps, then sleeps on the
doorbell until a ring: what the executor does where ranks outnumber cores), and
``bell-poll``: ``bell`` with the host's idle CPUs polling rather than halting (a PM QoS
request through ``/dev/cpu_dma_latency``, root only, held for those settings alone).
Each mode's naps ask for no timer slack, as the executor's do.

``--blocks K...``: the probe's own measure through the executor's runtime, on a longer
chain of tiny Relus passed to the next rank every K ops: (passed step - one-rank step) /
messages. At K = 1 it is ``machine probe``'s message; at larger K each receiver has
waited (and slept) longer, and what it adds beyond K = 1 is the hand-off's own cost,
the slower first ops after a long sleep included.

``--plans PLAN...``: each plan trained (``executor.train``, as ``benchmarks/interleave.py``
times it) under the executor's waits as shipped and changed (``VARIANTS``: no doorbell,
shorter naps, spinning, idle CPUs polling), by turns, with the transport's waits counted
by length, the doorbell's sleeps and its rings, per step.

On a shared host, another process's load changes everything here (a rank that has
slept preempts a busy foreign process; one that runs on does not): note the load.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python benchmarks/NAME.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

MODES = ("spin", "nap", "bell", "bell-poll")
SIDE = 64  # the work's matmul: [SIDE, SIDE] float32
WARM_HOPS = 8  # each setting's first round trips, not counted


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p10": at(0.1), "median": statistics.median(xs), "p90": at(0.9), "n": len(xs)}


class _Work:
    """A fixed count of small matmuls: an op's worth of compute, cache-resident."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((SIDE, SIDE), dtype=np.float32)
        self.b = rng.standard_normal((SIDE, SIDE), dtype=np.float32)
        self.c = np.empty((SIDE, SIDE), dtype=np.float32)

    def run(self, reps: int) -> tuple[float, float]:
        """(seconds for all ``reps`` matmuls, seconds for the first alone)."""
        start = time.perf_counter()
        first = start
        for i in range(reps):
            np.matmul(self.a, self.b, out=self.c)
            if i == 0:
                first = time.perf_counter()
        end = time.perf_counter()
        return end - start, first - start

    def reps_for(self, seconds: float) -> int:
        if seconds <= 0:
            return 0
        self.run(200)
        one = statistics.median(self.run(50)[0] / 50 for _ in range(20))
        return max(1, round(seconds / one))


def _worker(args: argparse.Namespace) -> None:
    import gc

    from mpi4py import MPI

    from executor.device import CpuDevice
    from executor.doorbell import Doorbell
    from executor.transport import MpiTransport, nap_precisely, oversubscribed, wait_patiently

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    crowded = oversubscribed(comm)
    bell = Doorbell.open(comm)  # opened by all; used by the bell mode only
    nap_precisely()
    device, work = CpuDevice(), _Work()
    reps = {w: comm.bcast(work.reps_for(w * 1e-6) if rank == 0 else None) for w in args.work_us}
    stamp = np.zeros(1, dtype=np.float64)
    inbox = np.zeros(1, dtype=np.float64)
    results = []
    idle_poll = _IdlePoll()
    gc.disable()
    for repeat in range(args.repeats):
        for mode_asked in args.modes:
            if rank == 0:
                idle_poll(mode_asked == "bell-poll")
            mode = "bell" if mode_asked == "bell-poll" else mode_asked
            transport = MpiTransport(
                comm, device, nap=mode != "spin", bell=bell if mode == "bell" else None
            )
            for work_us in args.work_us:
                r = reps[work_us]
                # Alone: rank 0 works back to back, the others wait in this mode.
                comm.Barrier()
                alone = []
                if rank == 0:
                    for _ in range(args.hops):
                        alone.append(work.run(r))
                    done = comm.Ibarrier()
                else:
                    done = comm.Ibarrier()
                    wait_patiently(
                        done.Test, nap=mode != "spin", bell=bell if mode == "bell" else None
                    )
                done.Wait()
                # Passed round: every hop a message.
                comm.Barrier()
                latencies, works, firsts = [], [], []
                prev, nxt = (rank - 1) % size, (rank + 1) % size
                rounds = max(1, args.hops // size) + WARM_HOPS
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for i in range(rounds):
                    if i == WARM_HOPS:
                        cpu0, wall0 = time.process_time(), time.perf_counter()
                    if rank != 0:
                        pending = transport.recv(inbox, prev)
                        transport.wait(pending)
                        arrived = time.perf_counter()
                        if i >= WARM_HOPS:
                            latencies.append(arrived - inbox[0])
                    took, first = work.run(r)
                    if i >= WARM_HOPS and (rank != 0 or i > WARM_HOPS):
                        works.append(took)
                        firsts.append(first)
                    stamp[0] = time.perf_counter()
                    transport.send(stamp, nxt)
                    if rank == 0:
                        pending = transport.recv(inbox, prev)
                        transport.wait(pending)
                        if i >= WARM_HOPS:
                            latencies.append(time.perf_counter() - inbox[0])
                    transport.end_step()
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
                comm.Barrier()
                gathered = comm.gather((latencies, works, alone, cpu, wall, firsts), root=0)
                if rank == 0:
                    lat = [x for g in gathered for x in g[0]]
                    wk = [x for g in gathered for x in g[1]]
                    al = [t for t, _ in gathered[0][2]]
                    first_alone = [f for _, f in gathered[0][2]]
                    first_after = [x for g in gathered for x in g[5]]
                    hops = (rounds - WARM_HOPS) * size
                    cpu_all = sum(g[3] for g in gathered)
                    wall = gathered[0][4]
                    row = {
                        "ranks": size,
                        "oversubscribed": crowded,
                        "mode": mode_asked,
                        "work_us": work_us,
                        "repeat": repeat,
                        "reps": r,
                        "latency_s": _quantiles(lat),
                        "work_after_handoff_s": _quantiles(wk),
                        "work_alone_s": _quantiles(al),
                        "first_matmul_after_handoff_s": _quantiles(first_after),
                        "first_matmul_alone_s": _quantiles(first_alone),
                        "hop_s": wall / hops,  # wall per hop: work + latency
                        "cpu_per_hop_s": cpu_all / hops,
                    }
                    results.append(row)
                    print(_line(row), flush=True)
    idle_poll(False)
    gc.enable()
    bell.close() if bell is not None else None
    if rank == 0 and args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


# --plans: the executor's own waits changed, to see what the bell's sleeps cost a step.
VARIANTS = ("shipped", "no-bell", "short-naps", "spin", "idle-poll")
QOS = Path("/dev/cpu_dma_latency")


class _IdlePoll:
    """While open, this host's idle CPUs poll instead of halting: a PM QoS request of 0 us
    wake-up latency (Linux's ``/dev/cpu_dma_latency``, held as long as the file is open;
    root only). On a VM a halted vCPU leaves the guest, and waking it is the host's
    business. Opened on rank 0 only: the request is the node's."""

    def __init__(self) -> None:
        self.file = None

    def __call__(self, on: bool) -> None:
        if on and self.file is None:
            self.file = open(QOS, "wb", buffering=0)  # noqa: SIM115
            self.file.write((0).to_bytes(4, sys.byteorder))
        elif not on and self.file is not None:
            self.file.close()
            self.file = None


WAIT_BUCKETS = (20e-6, 300e-6)  # ready at once / napping / past the naps (on the bell)


def _apply(variant: str) -> None:
    """Set how the executor's ranks wait (``executor/transport.py``'s module globals,
    read at every wait): ``shipped`` as released; ``no-bell``: 50 us naps, never the
    doorbell; ``short-naps``: 10 us naps, never the doorbell; ``spin``: no naps (the
    ranks test back to back, as ranks with a core each do); ``idle-poll``: as shipped,
    the idle CPUs polling (``_IdlePoll``)."""
    import executor.train as train_module
    import executor.transport as tr

    if not hasattr(tr, "_handoff_saved"):
        tr._handoff_saved = (tr.NAPS_BEFORE_BELL, tr.wait_patiently.__defaults__)
        train_module._handoff_oversubscribed = train_module.oversubscribed
    naps, defaults = tr._handoff_saved
    tr.NAPS_BEFORE_BELL = naps if variant in ("shipped", "idle-poll") else 10**9
    nap_s = 10e-6 if variant == "short-naps" else tr.NAP_S
    tr.wait_patiently.__defaults__ = (*defaults[:2], nap_s, *defaults[3:])
    if variant == "spin":
        train_module.oversubscribed = lambda comm: False
    else:
        train_module.oversubscribed = train_module._handoff_oversubscribed


class _Counts:
    """Per rank: the transport's waits by how long they took, bell sleeps and rings."""

    def __init__(self) -> None:
        self.waits = [0, 0, 0]
        self.wait_s = 0.0
        self.sleeps = self.rung = self.rings = 0

    def install(self) -> None:
        import executor.doorbell as db
        import executor.transport as tr

        counts = self
        wait, sleep, ring = tr.MpiTransport.wait, db.Doorbell.sleep, db.Doorbell.ring

        def timed_wait(transport, pending):
            start = time.perf_counter()
            wait(transport, pending)
            took = time.perf_counter() - start
            counts.waits[sum(took > b for b in WAIT_BUCKETS)] += 1
            counts.wait_s += took

        def counted_sleep(bell, seconds, ready):
            counts.sleeps += 1
            rung = sleep(bell, seconds, ready)
            counts.rung += rung
            return rung

        def counted_ring(bell, rank):
            if bell.peers.get(rank) is not None and bell.asleep[rank][0]:
                counts.rings += 1
            ring(bell, rank)

        tr.MpiTransport.wait = timed_wait
        db.Doorbell.sleep = counted_sleep
        db.Doorbell.ring = counted_ring

    def take(self) -> tuple:
        out = (*self.waits, self.wait_s, self.sleeps, self.rung, self.rings)
        self.__init__()
        return out


def _plans_worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from executor.kinds import DeviceKind
    from executor.train import RunOptions, train

    comm = MPI.COMM_WORLD
    counts = _Counts()
    counts.install()
    warm = 2
    idle_poll = _IdlePoll()

    def setting(variant: str) -> None:
        _apply(variant)
        if comm.Get_rank() == 0:
            idle_poll(variant == "idle-poll")
        comm.Barrier()

    def run(plan: Path, steps: int):
        options = RunOptions(plan=plan, steps=steps, device=DeviceKind.CPU)
        return train(comm, options)

    results = {
        (str(p), v): {"times": [], "counts": [], "steps": 0}
        for p in args.plans
        for v in args.variants
    }
    for plan in args.plans:
        for variant in args.variants:
            setting(variant)
            run(plan, warm)
    for _ in range(args.repeats):
        for plan in args.plans:
            for variant in args.variants:
                setting(variant)
                done = run(plan, warm)  # the run's first steps make buffers: not counted
                counts.take()
                done = run(plan, args.steps)
                mine = counts.take()
                summed = comm.reduce(np.array(mine, dtype=float), op=MPI.SUM, root=0)
                r = results[(str(plan), variant)]
                r["times"] += [s.time_s for s in done.steps[warm:]]
                r["steps"] += args.steps
                if summed is not None:
                    r["counts"].append(summed.tolist())
    setting("shipped")
    if comm.Get_rank() != 0:
        return
    rows = []
    for (plan, variant), r in results.items():
        c = np.sum(np.array(r["counts"]), axis=0) / r["steps"]
        row = {
            "plan": plan,
            "variant": variant,
            "ranks": comm.Get_size(),
            "step_s": _quantiles(r["times"]),
            "per_step": dict(
                zip(
                    (
                        "waits_ready",
                        "waits_napping",
                        "waits_long",
                        "wait_s",
                        "bell_sleeps",
                        "bell_sleeps_rung",
                        "rings",
                    ),
                    c.tolist(),
                    strict=True,
                )
            ),
        }
        rows.append(row)
        ps, st = row["per_step"], row["step_s"]
        print(
            f"{Path(plan).stem:28} {variant:10} step median {st['median'] * 1e3:7.2f} ms "
            f"(p10 {st['p10'] * 1e3:.2f}, p90 {st['p90'] * 1e3:.2f})  waits/step <20us "
            f"{ps['waits_ready']:.1f}, 20-300us {ps['waits_napping']:.1f}, >300us "
            f"{ps['waits_long']:.1f}; bell sleeps {ps['bell_sleeps']:.1f} (rung "
            f"{ps['bell_sleeps_rung']:.1f}), rings {ps['rings']:.1f}",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


# --blocks: the probe's chain of tiny Relus (onnx2soap/measure/probe_messages.py), longer,
# passed from rank to rank every K ops instead of every op.
CHAIN_LENGTH = 128


def _block_plan(graph, devices: int, block: int):
    """Op i on device (i // block) mod devices, each op whole (block 0: all on 0)."""
    from onnx2soap.measure.probe_messages import whole_ops_plan

    return whole_ops_plan(graph, devices, lambda i: (i // block) % devices if block else 0)


def _blocks_worker(args: argparse.Namespace) -> None:
    """What a message adds to a step of the executor's runtime when the chain changes
    rank every ``block`` ops: (passed step - one-rank step) / messages, the probe's
    measure (``message_costs``) at block 1. The longer the block, the longer each
    receiver has waited (and slept) before its message comes."""
    from mpi4py import MPI

    import onnx2soap.measure.probe_messages as pm
    from executor.program import Send
    from executor.transport import nap_precisely, oversubscribed

    comm = MPI.COMM_WORLD
    size, nap = comm.Get_size(), oversubscribed(comm)
    if nap:
        nap_precisely()
    pm.CHAIN_OPS = CHAIN_LENGTH
    with tempfile.TemporaryDirectory() as folder:
        model = pm.chain_model(Path(folder)) if comm.Get_rank() == 0 else None
    model = comm.bcast(model, root=0)
    graph = model.graph
    per: dict[int, list[float]] = {b: [] for b in args.blocks}
    steps: dict[int, list[float]] = {b: [] for b in [0, *args.blocks]}
    for _ in range(args.repeats):
        alone = pm._step_seconds(comm, model, _block_plan(graph, size, 0), nap)
        steps[0].append(alone.seconds)
        for block in args.blocks:
            apart = pm._step_seconds(comm, model, _block_plan(graph, size, block), nap)
            sends = sum(isinstance(x, Send) for x in apart.program.instructions)
            messages = comm.allreduce(sends)
            per[block].append((apart.seconds - alone.seconds) / messages)
            steps[block].append(apart.seconds)
    if comm.Get_rank() != 0:
        return
    rows = []
    for block in args.blocks:
        row = {
            "ranks": size,
            "block": block,
            "message_s": _quantiles(per[block]),
            "step_s": statistics.median(steps[block]),
            "one_rank_step_s": statistics.median(steps[0]),
        }
        rows.append(row)
        m = row["message_s"]
        print(
            f"ranks {size} block {block:3} ops: a message adds {_us(m['median'])} us "
            f"(rounds {_us(min(per[block]))}-{_us(max(per[block]))}); step "
            f"{row['step_s'] * 1e3:.2f} ms, one rank {row['one_rank_step_s'] * 1e3:.2f} ms",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:7.1f}"


def _line(row: dict) -> str:
    lat, wk, al = row["latency_s"], row["work_after_handoff_s"], row["work_alone_s"]
    slow = wk["median"] / al["median"] if row["reps"] and wk and al else None
    fa, fl = row["first_matmul_after_handoff_s"], row["first_matmul_alone_s"]
    return (
        f"ranks {row['ranks']} {row['mode']:9} work {row['work_us']:6g} us  latency median "
        f"{_us(lat['median'])} (p10 {_us(lat['p10'])}, p90 {_us(lat['p90'])}) us  "
        f"work after/alone {'-' if slow is None else f'{slow:.2f}'}  first matmul after/alone "
        f"{_us(fa.get('median'))}/{_us(fl.get('median'))} us  hop {_us(row['hop_s'])} us  "
        f"cpu/hop {_us(row['cpu_per_hop_s'])} us"
    )


def _mpiexec() -> list[str]:
    from onnx2soap.cli.machine_cmd import find_mpiexec

    return [find_mpiexec()]


def _oversubscribe(ranks: int) -> list[str]:
    from benchmarks.fidelity import _oversubscribe

    return _oversubscribe(ranks)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", choices=MODES, default=["spin", "nap", "bell"])
    p.add_argument(
        "--work-us",
        type=float,
        nargs="+",
        default=[0, 50, 200, 1000, 3000],
        help="compute per hop, microseconds (each receiver waits about ranks-1 of them)",
    )
    p.add_argument("--hops", type=int, default=200, help="timed hops per setting (default 200)")
    p.add_argument("--repeats", type=int, default=2, help="sweeps, one after another")
    p.add_argument("--json", type=Path, help="write every setting's figures here")
    p.add_argument(
        "--plans",
        type=Path,
        nargs="+",
        help="instead: time these plans (on --ranks' first count) under each of --variants",
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--blocks",
        type=int,
        nargs="+",
        help=f"instead: the probe's Relu chain ({CHAIN_LENGTH} ops) passed on every K ops",
    )
    p.add_argument("--steps", type=int, default=10, help="with --plans: timed steps a round")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if any(r < 2 for r in args.ranks):
        p.error("--ranks: at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        if args.blocks:
            _blocks_worker(args)
        else:
            (_plans_worker if args.plans else _worker)(args)
        return 0
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    print(f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime())}, load {os.getloadavg()}")
    rows = []
    if args.plans:
        args.ranks = args.ranks[:1]
    for ranks in args.ranks:
        # Spinning ranks on shared cores starve the rank that works: the executor never
        # spins there, and such a setting takes minutes. Asked for, it runs.
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "handoff.json"
            command = [*_mpiexec(), *_oversubscribe(ranks), "-n", str(ranks), sys.executable]
            command += ["-m", "benchmarks.handoff", "--worker", "--out", str(out)]
            command += ["--repeats", str(args.repeats)]
            if args.blocks:
                command += ["--blocks", *map(str, args.blocks)]
            elif args.plans:
                command += ["--plans", *map(str, args.plans), "--variants", *args.variants]
                command += ["--steps", str(args.steps)]
            else:
                command += ["--modes", *args.modes, "--work-us", *map(str, args.work_us)]
                command += ["--hops", str(args.hops)]
            subprocess.run(command, env=env, check=True)
            rows += json.loads(out.read_text())
    print(f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime())}, load {os.getloadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
