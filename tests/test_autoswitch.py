"""The coding decision of comm_codec.comm.autoswitch, driven by injected step times.

Single-process: without an initialized process group the agreement gathers this
process's own row, so these tests pin the decision logic (the probe schedule, the
medians, hysteresis, re-checks, counters, the checks on gathered rows). Rank agreement
and switching on real gloo ranks are in tests/test_ddp.py.
"""

import math

import pytest

import comm_codec as cc
from comm_codec.comm import autoswitch
from comm_codec.comm.autoswitch import AutoSwitch, decide
from comm_codec.ddp import HuffmanState

pytestmark = pytest.mark.unit


class _Steps:
    """Drive an AutoSwitch step by step with a fake clock: a step costs ``cost(step, coded)`` s."""

    def __init__(self, switch: AutoSwitch, cost):
        self.switch, self.cost, self.now = switch, cost, 0.0
        switch.clock = lambda: self.now
        self.modes = []

    def run(self, steps: int) -> list[bool]:
        for _ in range(steps):
            step = len(self.modes)
            coded = self.switch.begin_step(step)
            self.modes.append(coded)
            self.now += self.cost(step, coded)
        return self.modes


@pytest.mark.parametrize(
    "incumbent, plain, coded, expected",
    [
        (None, 100.0, 90.0, True),  # 10 % faster: worth the CPU
        (None, 100.0, 96.0, False),  # 4 % is within the 5 % hysteresis: plain stays
        (None, 100.0, 95.0, False),  # exactly the threshold does not switch
        (False, 100.0, 120.0, False),
        (True, 100.0, 102.0, True),  # coding stays unless plain is > 5 % faster
        (True, 95.5, 100.0, True),
        (True, 94.9, 100.0, False),
        (True, 50.0, 100.0, False),
    ],
)
def test_decide_with_hysteresis(incumbent, plain, coded, expected):
    assert decide(incumbent, plain, coded, 0.05) is expected


def test_probe_schedule_then_decision_then_recheck():
    sw = AutoSwitch("auto", probe_steps=2, recheck_every=5, hysteresis=0.05)
    # Coding is faster (60 vs 100 ms); the uncounted first coded step is slow (cold).
    drive = _Steps(sw, lambda step, coded: 5.0 if step == 0 else (0.06 if coded else 0.10))
    modes = drive.run(6)
    assert modes == [True, False, True, False, True, True]  # warm, P, C, P, C, then decided
    assert sw.decision["coded"] is True and sw.decision["step"] == 5
    assert sw.decision["plain_ms"] == pytest.approx(100.0) and sw.decision["coded_ms"] == pytest.approx(60.0)
    assert "compressing pays here: 60 vs 100 ms/step plain; re-checking every 5 steps" == sw.decision["reason"]
    assert sw.switches == 0 and sw.probes == 1
    # Steady until step 10, where the next probe starts.
    modes = drive.run(10)
    assert modes[6:10] == [True] * 4
    assert modes[10:15] == [True, False, True, False, True] and sw.probes == 2


def test_switches_back_when_the_link_gets_fast_and_counts_it():
    sw = AutoSwitch("auto", probe_steps=1, recheck_every=4, hysteresis=0.05)

    def cost(step, coded):  # the link speeds up at step 5: coding then costs more than it saves
        if step < 5:
            return 0.5 if coded else 1.0
        return 0.7 if coded else 0.4

    drive = _Steps(sw, cost)
    drive.run(3)  # warm, P, C
    drive.run(1)
    assert sw.coded is True and sw.switches == 0
    drive.run(4 + 3 + 1)  # steady to step 7, probe 7..9, decide at 10
    assert sw.coded is False and sw.switches == 1
    assert sw.decision["reason"].startswith("switched: plain all-reduce is faster here: 400 vs 700 ms/step")


def test_hysteresis_keeps_the_mode_on_a_near_tie():
    sw = AutoSwitch("auto", probe_steps=3, recheck_every=2, hysteresis=0.05)
    drive = _Steps(sw, lambda step, coded: 0.098 if coded else 0.100)  # 2 % apart
    drive.run(1 + 6 + 1)
    assert sw.coded is False
    drive.run(2 + 7)
    assert sw.coded is False and sw.switches == 0
    assert "(kept: a switch needs a 5 % gain)" in sw.decision["reason"]


def test_always_and_never_do_not_measure():
    for mode, expected in (("always", True), ("never", False)):
        sw = AutoSwitch(mode)
        drive = _Steps(sw, lambda step, coded: 1.0)
        assert drive.run(12) == [expected] * 12
        assert sw.decision is None and sw.probes == 0


def test_invalid_mode_names_the_allowed_ones():
    with pytest.raises(cc.ConfigError, match=r"mode='sometimes'; allowed: 'auto', 'always', 'never'"):
        AutoSwitch("sometimes")
    with pytest.raises(ValueError, match=r"mode='ALWAYS'; allowed: 'auto', 'always', 'never'"):
        HuffmanState(mode="ALWAYS")
    with pytest.raises(ValueError, match="recheck_every=0; allowed: an integer >= 1"):
        HuffmanState(recheck_every=0)
    with pytest.raises(cc.ConfigError, match=r"hysteresis=1.5; allowed: a fraction in \[0, 1\)"):
        AutoSwitch(hysteresis=1.5)


def test_rows_from_ranks_out_of_step_or_with_broken_figures_are_refused():
    good = [3.0, 2, 0.1, 2, 0.2]
    autoswitch.check_rows([good, list(good)], 3)
    with pytest.raises(
        RuntimeError,
        match=r"ranks reached the decision at different steps \(rank 0 at step 3, "
        r"rank 1 at step 4\)",
    ):
        autoswitch.check_rows([good, [4.0, 2, 0.1, 2, 0.2]], 3)
    with pytest.raises(RuntimeError, match="rank 1 measured no valid step times at step 3"):
        autoswitch.check_rows([good, [3.0, 2, math.nan, 2, 0.2]], 3)
    with pytest.raises(RuntimeError, match="rank 0 measured no valid step times"):
        autoswitch.check_rows([[3.0, 0, math.nan, 2, 0.2], good], 3)


def test_the_slowest_rank_decides(monkeypatch):
    """Per mode the gathered maximum counts: a synchronous step waits for its slowest rank."""
    sw = AutoSwitch("auto", probe_steps=1, recheck_every=100)
    rows = [[3.0, 1, 0.100, 1, 0.080], [3.0, 1, 0.101, 1, 0.120]]  # rank 1 finds coding slower
    # what the all-gather would return from two ranks
    monkeypatch.setattr(autoswitch, "gather_rows", lambda mine, group, device: rows)
    drive = _Steps(sw, lambda step, coded: 0.1)
    drive.run(4)
    assert sw.coded is False
    assert sw.decision["plain_ms"] == pytest.approx(101.0) and sw.decision["coded_ms"] == pytest.approx(120.0)
    assert sw.decision["per_rank_ms"] == [[100.0, 80.0], [101.0, 120.0]]


def test_pickled_switch_keeps_its_decision_and_probes_again_on_resume():
    import pickle

    sw = AutoSwitch("auto", probe_steps=1, recheck_every=50)
    _Steps(sw, lambda step, coded: 0.05 if coded else 0.1).run(4)
    clone = pickle.loads(pickle.dumps(sw))
    assert clone.coded is True and clone.decision == sw.decision
    drive = _Steps(clone, lambda step, coded: 0.1)
    assert drive.run(1) == [True]  # the resumed run measures first (a new run, maybe a new link)
    assert clone.probes == sw.probes + 1


def test_default_threads_is_the_ranks_share_of_the_cores(monkeypatch):
    import os

    import numba
    import torch

    from comm_codec.comm.engine import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 8)
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # never more than torch computes with
    assert default_threads(1) == 2
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    assert default_threads(1) == 1
