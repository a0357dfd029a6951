"""The machine model: compute devices, links, and the route between every device pair.

Links are one-directional resources that transfers queue on (FIFO), so an intra-node
NVLink, a PCIe switch port and a node's NIC are separate resources and contention on
each is modelled. A transfer holds every link of its route for its whole duration
(cut-through, like a pipelined DMA), not hop after hop.

Machine file (YAML)::

    name: my-cluster
    devices:
      - {name: gpu0, peak_flops: 9.3e12, memory_bandwidth: 7.3e11, memory: 17179869184,
         kernel_overhead: 5.0e-6}   # optional: peak_flops_half, model ("H100 SXM")
    links:
      - {name: nvlink-0-1, bandwidth: 2.0e10, latency: 1.0e-6}
    routes:
      - {src: 0, dst: 1, links: [nvlink-0-1]}

    transfers_use_compute: false   # true: a transfer also holds both end devices (CPUs)
    cores: 0                       # > 0: the devices share so many cores (CPU ranks)
    message_busy: 4.5e-05          # optional: of a message's latency, what holds its ends
    ring_step_latency: 1.0e-05     # optional: a ring all-reduce step's latency
    ring_step_curve: [[1024, 9.0e-06], [16777216, 2.6e-03]]  # optional: measured steps
    resume: {after: 2.0e-04, cost: 6.0e-04, slowdown: 6.0}  # optional: a rank that slept
    cooling: {cost: 1.6e-04, after: 1.5e-03}  # optional: a message after a long silence
    margin: 0.1                    # optional: the simulator's step error here, a fraction

Units: FLOP/s, bytes/s, bytes, seconds. Every ordered pair of distinct devices needs a
route. A machine has at most ``MAX_DEVICES`` devices (routes grow with the square of the
count) and a machine file is at most ``MAX_MACHINE_FILE_BYTES``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType

import yaml

from onnx2soap.errors import MachineError
from onnx2soap.soap.plan import MAX_DEVICES

MAX_MACHINE_FILE_BYTES = 256 << 20
RESUME_KEYS = frozenset({"after", "cost", "slowdown"})


class _MachineLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's floats: PyYAML follows YAML 1.1, which reads ``5e-6`` and
    ``9.3e12`` (no dot, or no sign in the exponent) as strings, while a person writing a
    machine file by hand means numbers. (The resolver is added to this subclass only.)"""


_MachineLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


@dataclass(frozen=True)
class ComputeDevice:
    name: str
    peak_flops: float
    memory_bandwidth: float
    memory: int
    kernel_overhead: float = 5e-6  # fixed cost of launching one task
    # Float16 matrix products (a GPU's tensor cores); None: no faster than peak_flops.
    peak_flops_half: float | None = None
    # The GPU model ("H100 SXM") whose published kernel rates price it (sim/achieved.py);
    # None: priced by its peaks alone.
    model: str | None = None


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Resume:
    """What a rank pays for having slept through a wait: a device that waited longer
    than ``after`` seconds for a task's inputs (a message, a ring's slowest member) owes
    ``cost`` seconds, which its next compute tasks pay, each at most ``slowdown`` times
    its own duration, until it is paid or the device waits again (a new wait owes
    ``cost`` afresh, the rest forgotten). CPU ranks that outnumber their cores nap and
    then sleep while they wait, and come back to cold caches and a core another rank
    has had: on 4 ranks of a 2-core VM, GPT-2's first op after such a hand-off ran 6-8x
    its time and the next few dozen 1.2-1.6x, 0.4-0.9 ms a hand-off in all, where a
    rank that runs one small op between messages pays a few times that op
    (docs/benchmarks.md)."""

    after: float
    cost: float
    slowdown: float = 6.0


@dataclass(frozen=True)
class Cooling:
    """What a message or a ring costs beyond its latency when its ends have not
    communicated for a while: a communication task that starts ``gap`` seconds after
    the last one of any device it holds ended costs ``cost · (1 - exp(-gap / after))``
    more. On CPU ranks of a VM whose ranks spin while they wait, a bare MPI round trip
    takes 3 us back to back and 12, 29 and 80 us after 1, 3 and 10 ms without one, and
    a two-rank ring of 128 floats 40-200 us after 0.1-6 ms of the ranks streaming
    memory (``machine probe`` fits it there): so resnet18's data-parallel statistics
    rings, an op's compute apart, took 87 us where its ILP plan's, a message
    apart, took 22. The first communication of a step counts its gap from the step's
    start (the previous step ended with a sum over the ranks). Only tasks that hold
    their end devices cool (``transfers_use_compute``: ranks whose cores copy)."""

    cost: float
    after: float


@dataclass(frozen=True)
class RingCurve:
    """A ring step's time by the bytes of its chunk, measured on the host (``machine
    probe``: the transport's all-reduces of growing arrays, back to back): ``points``
    are (chunk bytes, seconds a step), bytes increasing, seconds not decreasing. What a
    step costs beyond its latency (``extra``) is the curve's rise from its first point,
    linear between points and at the last two's slope beyond: summing a chunk and
    copying it cost more per byte once they leave the caches, which one bandwidth
    does not say (2 ranks here: 6.4 GB/s a step at 8 MiB chunks, 3.4 at 32 MiB)."""

    points: tuple[tuple[int, float], ...]

    def extra(self, nbytes: int) -> float:
        pts = self.points
        base = pts[0][1]
        if nbytes <= pts[0][0]:
            return 0.0
        for (b0, s0), (b1, s1) in pairwise(pts):
            if nbytes <= b1:
                return s0 - base + (s1 - s0) * (nbytes - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2], pts[-1]
        return s1 - base + (s1 - s0) * (nbytes - b1) / (b1 - b0)


class IntraLink(Enum):
    """What links the devices of a node, as NCCL's latency model tells them apart."""

    NVLINK = "nvlink"  # NVLink, directly or through an NVSwitch
    PCIE = "pcie"


@dataclass(frozen=True)
class NodeLayout:
    """Which node each device is on (``of[d]``), and what links a node's devices: the
    collectives of GPUs on such a machine are priced as NCCL runs them
    (``sim/collectives.py``)."""

    of: tuple[int, ...]
    intra: IntraLink = IntraLink.NVLINK
    # The share of an NVLink's datasheet bandwidth NCCL's topology counts on for its
    # collectives (NVIDIA/nccl src/graph/topo.h: an NVLink 4 link at 20.6 GB/s of its
    # 25, NVLink 2 and 3 at 20 of 25, NVLink 1 at 18 of 20); 1 for PCIe.
    nvlink_share: float = 1.0
    # Whether the node's NVSwitches reduce (NVLink SHARP, third-generation NVSwitch:
    # H100 nodes), so that NCCL may run its NVLS algorithms (``sim/collectives.py``).
    nvls: bool = False


@dataclass(frozen=True)
class Machine:
    """``transfers_use_compute``: a transfer also holds the sending and the receiving
    device, as on CPU ranks, whose cores copy every message themselves; GPUs have copy
    engines and NICs, so their transfers overlap with compute.

    ``cores``: where CPU ranks outnumber the host's cores, the cores they share (0: a
    core, or a GPU, each). Device ``d`` then runs on core ``d mod cores``, and what the
    devices of one core do is done one after the other (the operating system gives them
    the core in turns): a core is one more resource their tasks hold.

    ``message_busy``: where transfers use compute, the seconds of a message's latency
    that its two end devices spend on it (sending, waking up, receiving); the rest of
    the latency holds nothing: the devices, with their cores, are free for other work
    (ranks that nap while they wait give their core away), and the next message on the
    links need not wait for it. None: all of the latency holds the devices and links
    (ranks that spin while they wait).

    ``ring_step_latency``: the latency of one step of a ring all-reduce, in place of its
    route's (a step's time is this plus its chunk at the route's bandwidth). A step
    costs the runtime more than a message (every member sends, receives, waits for
    both and sums the chunk), which ``machine probe`` measures. None: the route's
    latency.

    ``ring_step_curve``: a ring step's time by its chunk's bytes, measured
    (``RingCurve``): a step then costs its latency plus the curve's rise, in place of
    its bytes at the route's bandwidth. None: the route's bandwidth.

    ``resume``: what a device pays for having slept through a long wait (``Resume``);
    None: nothing (GPUs, whose streams do not sleep; ranks that were never measured).

    ``cooling``: what a communication costs its ranks after a silence (``Cooling``);
    None: nothing (the presets; ranks that nap, which ``resume`` covers).

    ``nodes``: the devices' nodes (``NodeLayout``): GPUs whose collectives NCCL runs,
    priced by its model (``sim/collectives.py``); None (CPU ranks, a machine file
    without them): collectives are the executor's lock-step rings, step by step.

    ``margin``: the simulator's step error on this machine, as a fraction of a step
    (what ``benchmarks/fidelity.py`` measures as the step error after the common
    factor). The search trades a plan for one that moves more bytes only where that
    one is predicted faster by more than this (``search/margin.py``): a smaller gain is
    a coin the host tosses, and messages are what the model knows least. 0: every
    predicted difference is trusted (the presets).

    Resources, in the simulator's numbering: devices ``0..D-1``, links ``D..D+L-1``, then
    the shared cores."""

    name: str
    devices: tuple[ComputeDevice, ...]
    links: tuple[Link, ...]
    routes: Mapping[tuple[int, int], tuple[int, ...]]  # (src, dst) -> link indices
    transfers_use_compute: bool = False
    cores: int = 0
    message_busy: float | None = None
    ring_step_latency: float | None = None
    resume: Resume | None = None
    margin: float = 0.0
    cooling: Cooling | None = None
    nodes: NodeLayout | None = None
    ring_step_curve: RingCurve | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "routes", MappingProxyType(dict(self.routes)))
        if self.nodes is not None and len(self.nodes.of) != len(self.devices):
            raise MachineError(
                f"machine {self.name!r}: nodes: {len(self.nodes.of)} entries for "
                f"{len(self.devices)} devices"
            )

    @property
    def shares_cores(self) -> bool:
        return 0 < self.cores < self.size

    def core(self, device: int) -> int | None:
        """The resource of the core ``device`` shares, or None (a core of its own)."""
        if not self.shares_cores:
            return None
        return self.size + len(self.links) + device % self.cores

    def resource_name(self, r: int) -> str:
        """A resource's name in pictures and traces: its device's, its link's, or its
        core's."""
        if r < self.size:
            return self.devices[r].name
        if r < self.size + len(self.links):
            return self.links[r - self.size].name
        return f"core{r - self.size - len(self.links)}"

    @property
    def resources(self) -> int:
        """How many resources the simulator has: devices, links, shared cores."""
        return self.size + len(self.links) + (self.cores if self.shares_cores else 0)

    @property
    def size(self) -> int:
        return len(self.devices)

    def route(self, src: int, dst: int) -> tuple[int, ...]:
        return self.routes[(src, dst)]

    def transfer_time(self, src: int, dst: int, nbytes: int) -> float:
        """Unloaded time of one transfer: the slowest link's rate plus every latency."""
        links = [self.links[i] for i in self.route(src, dst)]
        return sum(link.latency for link in links) + nbytes / min(x.bandwidth for x in links)


# --- YAML -----------------------------------------------------------------------------------


def _number(doc: Mapping, key: str, where: str, source: str, integer: bool = False) -> float:
    value = doc.get(key) if isinstance(doc, Mapping) else None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        kind = "a positive integer" if integer else "a positive finite number"
        raise MachineError(f"{source}: {where}.{key}: must be {kind}, got {value!r}")
    if integer and int(value) != value:
        raise MachineError(f"{source}: {where}.{key}: must be an integer, got {value!r}")
    return int(value) if integer else float(value)


def _name(doc: Mapping, where: str, source: str) -> str:
    value = doc.get("name") if isinstance(doc, Mapping) else None
    if not isinstance(value, str) or not value:
        raise MachineError(f"{source}: {where}.name: must be a non-empty string")
    return value


def _list(doc: Mapping, key: str, source: str) -> list:
    value = doc.get(key)
    if not isinstance(value, list) or (not value and key != "routes"):
        raise MachineError(f"{source}: {key}: must be a non-empty list")
    return value


def _nonnegative(value) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value >= 0
    )


def machine_from_dict(doc: Mapping, source: str) -> Machine:
    if not isinstance(doc, Mapping):
        raise MachineError(f"{source}: a machine file must be a mapping")
    listed = _list(doc, "devices", source)
    if len(listed) > MAX_DEVICES:
        raise MachineError(
            f"{source}: devices: {len(listed)} devices; a machine has at most {MAX_DEVICES}"
        )
    devices = []
    for i, d in enumerate(listed):
        w = f"devices[{i}]"
        overhead = d.get("kernel_overhead", 5e-6) if isinstance(d, Mapping) else None
        if not _nonnegative(overhead):
            raise MachineError(f"{source}: {w}.kernel_overhead: must be a finite number >= 0")
        half = None
        if isinstance(d, Mapping) and d.get("peak_flops_half") is not None:
            half = _number(d, "peak_flops_half", w, source)
        model = d.get("model") if isinstance(d, Mapping) else None
        if model is not None and not isinstance(model, str):
            raise MachineError(
                f"{source}: {w}.model: must be a string (a GPU model), got {model!r}"
            )
        devices.append(
            ComputeDevice(
                _name(d, w, source),
                _number(d, "peak_flops", w, source),
                _number(d, "memory_bandwidth", w, source),
                int(_number(d, "memory", w, source, integer=True)),
                float(overhead),
                half,
                model,
            )
        )
    links = []
    for i, x in enumerate(doc.get("links") or []):
        w = f"links[{i}]"
        latency = x.get("latency") if isinstance(x, Mapping) else None
        if not _nonnegative(latency):
            raise MachineError(
                f"{source}: {w}.latency: must be a finite number >= 0, got {latency!r}"
            )
        links.append(Link(_name(x, w, source), _number(x, "bandwidth", w, source), float(latency)))
    by_name = {x.name: i for i, x in enumerate(links)}
    if len(by_name) != len(links):
        raise MachineError(f"{source}: links: names must be unique")
    routes = {}
    for i, r in enumerate(doc.get("routes") or []):
        w = f"routes[{i}]"
        src, dst = (r.get("src"), r.get("dst")) if isinstance(r, Mapping) else (None, None)
        for key, v in (("src", src), ("dst", dst)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < len(devices):
                raise MachineError(
                    f"{source}: {w}.{key}: must be a device index 0..{len(devices) - 1}"
                )
        names = r.get("links")
        if not isinstance(names, list) or not names:
            raise MachineError(f"{source}: {w}.links: must be a non-empty list of link names")
        unknown = [n for n in names if not isinstance(n, str) or n not in by_name]
        if unknown:
            raise MachineError(f"{source}: {w}.links: unknown links {unknown}")
        routes[(src, dst)] = tuple(by_name[n] for n in names)
    missing = [
        (a, b)
        for a in range(len(devices))
        for b in range(len(devices))
        if a != b and (a, b) not in routes
    ]
    if missing:
        raise MachineError(f"{source}: routes: no route for device pairs {missing[:4]}…")
    use_compute = doc.get("transfers_use_compute", False)
    if not isinstance(use_compute, bool):
        raise MachineError(f"{source}: transfers_use_compute: must be true or false")
    cores = doc.get("cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise MachineError(f"{source}: cores: must be an integer >= 0 (0: a core each)")
    busy = doc.get("message_busy")
    if busy is not None and not _nonnegative(busy):
        raise MachineError(
            f"{source}: message_busy: must be a finite number >= 0 (seconds), got {busy!r}"
        )
    ring = doc.get("ring_step_latency")
    if ring is not None and not _nonnegative(ring):
        raise MachineError(
            f"{source}: ring_step_latency: must be a finite number >= 0 (seconds), got {ring!r}"
        )
    name = str(doc.get("name") or Path(source).stem)
    busy = None if busy is None else float(busy)
    ring = None if ring is None else float(ring)
    resume = _resume(doc.get("resume"), source)
    margin = doc.get("margin", 0.0)
    if not _nonnegative(margin) or margin >= 1:
        raise MachineError(
            f"{source}: margin: must be a fraction >= 0 and < 1 (0.1: a tenth of a step), "
            f"got {margin!r}"
        )
    return Machine(
        name,
        tuple(devices),
        tuple(links),
        routes,
        use_compute,
        cores,
        busy,
        ring,
        resume,
        float(margin),
        _cooling(doc.get("cooling"), source),
        _nodes(doc.get("nodes"), len(devices), source),
        _ring_curve(doc.get("ring_step_curve"), source),
    )


def _ring_curve(doc, source: str) -> RingCurve | None:
    """``ring_step_curve: [[bytes, seconds], ...]``: two points or more, bytes whole and
    increasing, seconds finite and not decreasing."""
    if doc is None:
        return None
    what = (
        f"{source}: ring_step_curve: must be a list of at least two [bytes, seconds] "
        "pairs, bytes increasing integers > 0, seconds finite, >= 0 and not decreasing"
    )
    if not isinstance(doc, list) or len(doc) < 2:
        raise MachineError(what)
    points = []
    for pair in doc:
        if not isinstance(pair, list) or len(pair) != 2:
            raise MachineError(what)
        nbytes, seconds = pair
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise MachineError(what)
        if not _nonnegative(seconds):
            raise MachineError(what)
        points.append((nbytes, float(seconds)))
    rising = all(a[0] < b[0] and a[1] <= b[1] for a, b in pairwise(points))
    if not rising:
        raise MachineError(what)
    return RingCurve(tuple(points))


_NODE_FIELDS = {"of", "intra", "nvlink_share", "nvls"}


def _nodes(doc, devices: int, source: str) -> NodeLayout | None:
    """``nodes: {of: [0, 0, 1, 1], intra: nvlink, nvlink_share: 0.824, nvls: true}``:
    each device's node (integers), what links a node's devices (nvlink or pcie, nvlink
    if left out), the share of an NVLink's bandwidth NCCL counts on (above 0, at most
    1; 1 if left out) and whether the switches reduce (false if left out)."""
    if doc is None:
        return None
    kinds = ", ".join(k.value for k in IntraLink)
    if not isinstance(doc, Mapping) or not set(doc) <= _NODE_FIELDS or "of" not in doc:
        raise MachineError(
            f"{source}: nodes: must be a mapping of 'of' (each device's node), 'intra' "
            f"({kinds}), 'nvlink_share' and 'nvls', got {doc!r}"[:300]
        )
    of = doc["of"]
    valid = isinstance(of, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in of
    )
    if not valid or len(of) != devices:
        raise MachineError(
            f"{source}: nodes.of: must list {devices} node numbers >= 0, one per device"
        )
    intra = doc.get("intra", IntraLink.NVLINK.value)
    if intra not in {k.value for k in IntraLink}:
        raise MachineError(f"{source}: nodes.intra: must be one of {kinds}, got {intra!r}")
    share = doc.get("nvlink_share", 1.0)
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
        raise MachineError(
            f"{source}: nodes.nvlink_share: must be above 0 and at most 1, got {share!r}"
        )
    nvls = doc.get("nvls", False)
    if not isinstance(nvls, bool):
        raise MachineError(f"{source}: nodes.nvls: must be true or false, got {nvls!r}")
    return NodeLayout(tuple(of), IntraLink(intra), float(share), nvls)


def _cooling(doc, source: str) -> Cooling | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or set(doc) != {"cost", "after"}:
        raise MachineError(
            f"{source}: cooling: must be a mapping of cost and after (seconds), got {doc!r}"
        )
    for key in ("cost", "after"):
        if not _nonnegative(doc[key]) or (key == "after" and not doc[key] > 0):
            raise MachineError(
                f"{source}: cooling.{key}: must be a finite number "
                + (">= 0" if key == "cost" else "> 0")
                + f" (seconds), got {doc[key]!r}"
            )
    return Cooling(float(doc["cost"]), float(doc["after"]))


def _resume(doc, source: str) -> Resume | None:
    if doc is None:
        return None
    if not isinstance(doc, Mapping) or not {"after", "cost"} <= set(doc) <= RESUME_KEYS:
        raise MachineError(
            f"{source}: resume: must be a mapping of after and cost (seconds) and optionally "
            f"slowdown, got {doc!r}"
        )
    for key in doc:
        if not _nonnegative(doc[key]):
            raise MachineError(
                f"{source}: resume.{key}: must be a finite number >= 0, got " + repr(doc[key])
            )
    return Resume(float(doc["after"]), float(doc["cost"]), float(doc.get("slowdown", 6.0)))


def machine_to_dict(m: Machine) -> dict:
    return {
        "name": m.name,
        "devices": [
            {
                "name": d.name,
                "peak_flops": d.peak_flops,
                "memory_bandwidth": d.memory_bandwidth,
                "memory": d.memory,
                "kernel_overhead": d.kernel_overhead,
                **({"peak_flops_half": d.peak_flops_half} if d.peak_flops_half else {}),
                **({"model": d.model} if d.model else {}),
            }
            for d in m.devices
        ],
        "links": [
            {"name": x.name, "bandwidth": x.bandwidth, "latency": x.latency} for x in m.links
        ],
        "routes": [
            {"src": s, "dst": d, "links": [m.links[i].name for i in r]}
            for (s, d), r in sorted(m.routes.items())
        ],
        "transfers_use_compute": m.transfers_use_compute,
        **({"cores": m.cores} if m.cores else {}),
        **({"message_busy": m.message_busy} if m.message_busy is not None else {}),
        **({"ring_step_latency": m.ring_step_latency} if m.ring_step_latency is not None else {}),
        **({"resume": asdict(m.resume)} if m.resume is not None else {}),
        **({"margin": m.margin} if m.margin else {}),
        **({"cooling": asdict(m.cooling)} if m.cooling is not None else {}),
        **({"nodes": _nodes_dict(m.nodes)} if m.nodes is not None else {}),
        **(
            {"ring_step_curve": [list(p) for p in m.ring_step_curve.points]}
            if m.ring_step_curve is not None
            else {}
        ),
    }


def _nodes_dict(nodes: NodeLayout) -> dict:
    doc: dict = {"of": list(nodes.of), "intra": nodes.intra.value}
    if nodes.nvlink_share != 1.0:
        doc["nvlink_share"] = nodes.nvlink_share
    if nodes.nvls:
        doc["nvls"] = True
    return doc


def _read_machine_text(path: Path) -> str:
    try:
        if path.exists() and not path.is_file():  # a folder, /dev/zero or a FIFO
            raise MachineError(f"{path}: cannot read the machine file (not a regular file)")
        with path.open("rb") as f:
            data = f.read(MAX_MACHINE_FILE_BYTES + 1)
    except FileNotFoundError as e:
        raise MachineError(f"{path}: no such machine file") from e
    except OSError as e:
        raise MachineError(f"{path}: cannot read the machine file ({e.strerror or e})") from e
    if len(data) > MAX_MACHINE_FILE_BYTES:
        raise MachineError(f"{path}: a machine file is at most {MAX_MACHINE_FILE_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MachineError(f"{path}: not a text file ({e.reason})") from e


def load_machine_file(path: Path) -> Machine:
    path = Path(path)
    text = _read_machine_text(path)
    try:
        doc = yaml.load(text, Loader=_MachineLoader)  # a SafeLoader: no arbitrary objects
    except (yaml.YAMLError, RecursionError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise MachineError(f"{path}: not YAML ({first})") from e
    return machine_from_dict(doc, str(path))


def dump_machine(m: Machine) -> str:
    return yaml.safe_dump(machine_to_dict(m), sort_keys=False, default_flow_style=None)
