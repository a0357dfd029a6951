"""Doorbells (executor/doorbell.py): ranks that share cores sleep until a peer rings, on
3 ranks under a real mpiexec. The executor's runs on more ranks than this host's cores
(the 3- and 4-rank tests on a 2-core machine) wait on them throughout. And a rank that
naps asks the kernel for naps without timer slack (the kernel's own figure for it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.executor.mpi import run_driver

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="doorbells are Linux abstract sockets"
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[int, dict]:
    driver = Path(__file__).with_name("doorbell_driver.py")
    return run_driver(driver, 3, tmp_path_factory.mktemp("doorbell"))


def test_every_rank_sees_every_flag_awake_at_first(seen) -> None:
    assert all(seen[r]["flags"] == {"0": 0, "1": 0, "2": 0} for r in range(3))


def test_a_ring_wakes_a_sleeping_rank_long_before_its_timeout(seen) -> None:
    assert seen[1]["rung"] is True
    assert seen[1]["woke_after_s"] < 2.5  # the driver's sleep: 5 s unless rung


def test_an_awake_rank_is_not_rung(seen) -> None:
    assert seen[2]["rung_awake"] is False


def test_a_rank_ready_once_it_says_it_sleeps_does_not_sleep(seen) -> None:
    assert seen[2]["ready_first"] is True and seen[2]["ready_first_s"] < 2.5


def test_messages_and_rings_arrive_whole_with_waits_on_the_bell(seen) -> None:
    assert seen[1]["received"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert seen[0]["summed"] == seen[2]["summed"] == [4.0] * 5  # (0 + 1) + (2 + 1)


def test_a_rank_that_naps_has_no_timer_slack() -> None:
    # In a process of its own: the slack is the thread's (and inherited), and a test must
    # not keep it. The process starts from Linux's default, 50,000 ns, whatever it got.
    code = (
        "import ctypes; ctypes.CDLL(None).prctl(29, 50000, 0, 0, 0)\n"
        "read = lambda: int(open('/proc/self/timerslack_ns').read())\n"
        "before = read()\n"
        "from executor.transport import nap_precisely\n"
        "nap_precisely()\n"
        "print(before, read())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["50000", "1"]
