"""Which ranks run the steps, and how the others follow the run.

A plan may leave devices without work: the single-device plan, or a searched plan that
uses two of four devices. Their ranks' programs are empty. They sit the steps out: they
take no part in the step's collectives, and the first working rank (the leader) sends
each of them a note per step (the step's record, or why the run stops). Between notes
they nap a millisecond at a time; they wake for every note, and with them for the
checkpoints, evaluations and the end of the run, which all ranks do together.

Why: a nonblocking collective completes only when every rank drives it, so an idle rank
in the step's collectives must poll all step long. Where ranks share cores, the polling
takes the cores the working ranks need: the example CNN's data parallelism on 2 of 4
ranks on 2 cores measured 17-20 ms a step against 10 ms on 2 ranks (each of the idle
ranks' 50 us naps costs 26-34 us of processor time on a VM), and longer naps delay every
step's end by as much (naps of up to 5 ms: 21 ms a step).

A signal that reaches only an idle rank still stops the run: the idle rank passes it to
the leader, which stops every rank at the next step boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mpi4py import MPI

from executor.records import StepRecord
from executor.transport import wait_patiently

IDLE_NAP_S = 1e-3  # an idle rank's nap between notes: ~4 % of a core on a VM, and the
# most a checkpoint or evaluation waits for it to join
NOTE, PLEA = 1, 2  # tags on the crew's own communicator


@dataclass(frozen=True)
class Note:
    """What the leader tells the idle ranks after a step: its record, or that the run
    stops (a signal, or the one line that says what is wrong)."""

    record: StepRecord | None = None
    interrupted: int = 0
    error: str | None = None


@dataclass
class Crew:
    """``steppers``: the working ranks' communicator (None on an idle rank), over which
    the step's collectives run. ``notes``: the world's, for notes and pleas only."""

    rank: int
    leader: int
    idle: tuple[int, ...]
    steppers: MPI.Comm | None
    notes: MPI.Comm
    _sent: list = field(default_factory=list)
    _pleaded: bool = False
    _pleas: dict[int, int] = field(default_factory=dict)  # idle rank -> its signal

    @classmethod
    def form(cls, comm: MPI.Comm, working: bool) -> Crew:
        """Collective: every rank says whether its program has instructions."""
        rank, flags = comm.Get_rank(), comm.allgather(working)
        steppers = comm.Split(0 if working else MPI.UNDEFINED, rank)
        leader = flags.index(True)
        idle = tuple(r for r, w in enumerate(flags) if not w)
        return cls(rank, leader, idle, steppers if working else None, comm.Dup())

    @property
    def working(self) -> bool:
        return self.steppers is not None

    def tell(self, note: Note) -> None:
        """The leader's note to every idle rank (others: nothing)."""
        if self.rank != self.leader:
            return
        self._sent = [r for r in self._sent if not r.Test()]
        self._sent += [self.notes.isend(note, dest=r, tag=NOTE) for r in self.idle]

    def hear(self, stop: Callable[[], int] | None) -> Note:
        """An idle rank: nap until the leader's next note, passing on a signal received
        meanwhile."""
        heard: list = []

        def arrived() -> bool:
            message = self.notes.improbe(source=self.leader, tag=NOTE)
            if message is not None:
                heard.append(message.recv())
            return bool(heard)

        def plead() -> None:
            signum = stop() if stop is not None else 0
            if signum and not self._pleaded:
                self._sent.append(self.notes.isend(signum, dest=self.leader, tag=PLEA))
                self._pleaded = True

        wait_patiently(arrived, plead, nap=True, nap_s=IDLE_NAP_S)
        return heard[0]

    def pleaded(self) -> int:
        """The leader: a signal an idle rank passed on (0: none)."""
        if self.rank != self.leader:
            return 0
        status = MPI.Status()
        while self.notes.iprobe(source=MPI.ANY_SOURCE, tag=PLEA, status=status):
            source = status.Get_source()
            self._pleas[source] = self.notes.recv(source=source, tag=PLEA)
        return next(iter(self._pleas.values()), 0)

    def close(self) -> None:
        """Collective, after the steps: every plea is received and every note delivered,
        so no message outlives the run."""
        pleaded = self.notes.allgather(self._pleaded)
        if self.rank == self.leader:
            for r, sent in enumerate(pleaded):
                if sent and r not in self._pleas:
                    self._pleas[r] = self.notes.recv(source=r, tag=PLEA)
        wait_patiently(lambda: MPI.Request.Testall(self._sent), nap=True, nap_s=IDLE_NAP_S)
        if self.steppers is not None:
            self.steppers.Free()
        self.notes.Free()
