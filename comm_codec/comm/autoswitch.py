"""Compress or send plainly: decided from this run's own step times, the same on every rank.

Coding pays where the wire is the bottleneck and costs time where the CPU is: the same
model can train faster coded on a slow link and slower coded on a fast one. No fixed
threshold can know the link, the load on the cores or the compression ratio of this
model's gradients, so :class:`AutoSwitch` measures.

Every ``recheck_every`` steps it *probes*: one coded step that is not counted (the first
coded step after plain ones pays for cold caches, or builds the books), then plain and
coded steps alternating, ``probe_steps`` of each, each timed from the start of one step
to the start of the next (so forward, backward, communication and optimizer all count).
At the end of a probe every rank contributes its medians to one small all-gather; every
rank then applies the same pure function, :func:`decide`, to the same gathered numbers
(the slowest rank's median per mode: a synchronous step is as slow as its slowest
rank), so all ranks switch at the same step without a second round. Hysteresis: the
mode in use is kept unless the other one is faster by more than ``hysteresis`` (a
fraction), so noise does not make the decision flap; with no mode in use yet (the first
probe), plain is the incumbent: coding has to earn its CPU time.

The owner (the DDP hook, the DeepSpeed plugin, or an FSDP2 state) calls
:meth:`AutoSwitch.begin_step` once at the start of every step, on every rank, with the
same step numbers, and codes that step if it returns True; its ``stats()`` carry
:meth:`AutoSwitch.stats`, so every owner reports the decision under the same keys.
Nothing here knows about buckets or books. (The DDP hook begins a step at its first
bucket; FSDP2, whose first collective of a step may be an all-gather prefetched at any
point, begins step s+1 where step s's backward pass ends: the interval between two
calls is still one whole step, forward, backward and optimizer.)

Faults: a rank whose step counter differs, or whose figures are not finite positive
times, makes every rank raise the same AgreementError at the agreement (they all see the
same gathered rows); a rank that dies before the agreement makes the others' all-gather
fail within the process group's timeout.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

from ..core.errors import AgreementError
from .agreement import gather_rows
from .config import MODES, check

__all__ = ["MODES", "AutoSwitch", "agree", "check_mode", "check_rows", "decide"]

log = logging.getLogger(__name__)

# One row per rank in the agreement: step, plain steps timed, plain median (s), coded
# steps timed, coded median (s).
_ROW = 5


def check_mode(mode) -> str:
    """Return ``mode`` if it is one of :data:`MODES`; raise ConfigError naming them if not."""
    check(mode=mode)
    return mode


def decide(incumbent: bool | None, plain_s: float, coded_s: float, hysteresis: float) -> bool:
    """Return whether to code, given the two modes' step times and the mode in use.

    Args:
        incumbent: True (coding now), False (plain now) or None (no decision yet: plain
            is the incumbent).
        plain_s, coded_s: step times of the two modes (any unit, the same for both).
        hysteresis: the fraction by which the other mode must be faster to switch.

    Returns:
        True to code, False to send plainly.
    """
    if incumbent:
        return not plain_s < coded_s * (1.0 - hysteresis)
    return coded_s < plain_s * (1.0 - hysteresis)


class AutoSwitch:
    """Decide per step whether to code, from A/B step times agreed across ranks.

    Args:
        mode: "auto" (measure and decide), "always" (code every step) or "never".
        probe_steps: steps timed per mode in a probe (plus one uncounted coded step).
        recheck_every: steps between the end of one probe and the start of the next.
        hysteresis: fraction by which the other mode must be faster to switch to it.
        clock: seconds, monotonic (tests inject their own timings here).
        plain_name: what the plain mode is called in the decision's reason (the DDP
            hook's "plain all-reduce"; FSDP2's "plain reduce-scatter/all-gather").

    Raises:
        ConfigError: an unknown mode, or out-of-range numbers (CommConfig's rules, :func:`~comm_codec.comm.config.check`).
    """

    __slots__ = (
        # what users tune
        "mode",
        "probe_steps",
        "recheck_every",
        "hysteresis",
        "clock",
        "plain_name",
        # internal state
        "_schedule",
        "_next_probe",
        "_last_start",
        "_last_mode",
        "_samples",
        # what was decided, and on what
        "coded",
        "decision",
        "switches",
        "probes",
    )

    def __init__(
        self,
        mode: str = "auto",
        probe_steps: int = 4,
        recheck_every: int = 200,
        hysteresis: float = 0.05,
        clock=time.perf_counter,
        plain_name: str = "plain all-reduce",
    ):
        check(mode=mode, probe_steps=probe_steps, recheck_every=recheck_every, hysteresis=hysteresis)
        self.mode = mode
        self.probe_steps = probe_steps
        self.recheck_every = recheck_every
        self.hysteresis = float(hysteresis)
        self.clock = clock
        self.plain_name = plain_name
        self.coded = {"auto": None, "always": True, "never": False}[mode]
        self.decision: dict | None = None
        self.switches = 0
        self.probes = 0
        self._schedule: list = []  # modes of the probe's steps still to run: True, False, or "warm"
        self._next_probe = None  # step at which the next probe starts (None: at the first call)
        self._last_start = None
        self._last_mode = None  # True / False: the last step's mode if timed, else None
        self._samples = {True: [], False: []}

    @property
    def probing(self) -> bool:
        """True while a probe runs (its steps alternate between the modes)."""
        return bool(self._schedule) or (self._last_mode is not None)

    def begin_step(self, step: int, group=None, device=None) -> bool:
        """Start step ``step``; return whether to code it. Call on every rank, every step.

        At the end of a probe this is collective (one all-gather over ``group``).

        Args:
            step: the owner's step counter (the same on every rank).
            group: the process group the ranks agree over.
            device: where the agreement's tensor lives (NCCL: a CUDA device).

        Raises:
            AgreementError: at an agreement, if the ranks' step counters or figures
                disagree (on every rank alike).
        """
        now = self.clock()
        if self._last_mode is not None and self._last_start is not None:
            self._samples[self._last_mode].append(now - self._last_start)
        self._last_start = now
        self._last_mode = None
        if self.mode != "auto":
            return self.coded
        if not self._schedule and (self._samples[True] or self._samples[False]):
            self._agree(step, group, device)
        if not self._schedule and (self._next_probe is None or step >= self._next_probe):
            self._schedule = ["warm"] + [False, True] * self.probe_steps
            self.probes += 1
        if self._schedule:
            planned = self._schedule.pop(0)
            if planned == "warm":
                return True
            self._last_mode = planned
            return planned
        return self.coded

    def stats(self) -> dict:
        """The decision keys of an owner's ``stats()``: mode, decision, switches, probes.

        ``decision`` is None before the first measurement, else the dict of :func:`agree`
        (coded, step, plain_ms, coded_ms, per_rank_ms, reason); ``switches`` counts changes
        of decision since the first, ``probes`` the measurements started.
        """
        return {"mode": self.mode, "decision": self.decision, "switches": self.switches, "probes": self.probes}

    def state_dict(self) -> dict:
        """The decision and counters (for stats and pickling); no clock, no samples."""
        return {
            "mode": self.mode,
            "probe_steps": self.probe_steps,
            "recheck_every": self.recheck_every,
            "hysteresis": self.hysteresis,
            "plain_name": self.plain_name,
            "coded": self.coded,
            "decision": self.decision,
            "switches": self.switches,
            "probes": self.probes,
        }

    def __getstate__(self):
        state = self.state_dict()
        state["next_probe"] = self._next_probe
        return state

    def __setstate__(self, state):
        self.__init__(
            state["mode"],
            state["probe_steps"],
            state["recheck_every"],
            state["hysteresis"],
            plain_name=state.get("plain_name", "plain all-reduce"),
        )
        self.coded, self.decision = state["coded"], state["decision"]
        self.switches, self.probes = state["switches"], state["probes"]
        # A resumed run probes at once: its link and load may not be the saved run's.
        self._next_probe = None

    # -- internal -------------------------------------------------------------------------
    def _agree(self, step: int, group, device) -> None:
        """Gather every rank's medians, check them, and decide the same on every rank."""
        plain, coded = self._samples[False], self._samples[True]
        self._samples = {True: [], False: []}
        before = self.coded
        self.decision = agree(
            plain,
            coded,
            step,
            group,
            self.hysteresis,
            incumbent=before,
            device=device,
            recheck_every=self.recheck_every,
            plain_name=self.plain_name,
        )
        self.coded = self.decision["coded"]
        if before is not None and self.coded != before:
            self.switches += 1
        self._next_probe = step + self.recheck_every


def agree(
    plain_s: list[float],
    coded_s: list[float],
    step: int,
    group=None,
    hysteresis: float = 0.05,
    *,
    incumbent: bool | None = None,
    device=None,
    recheck_every: int | None = None,
    plain_name: str = "plain all-reduce",
    unit: str = "ms/step",
) -> dict:
    """Decide from every rank's timings of both modes, the same on every rank (collective).

    Each rank's medians go to one all-gather; the slowest rank's median per mode is
    what :func:`decide` weighs.

    Args:
        plain_s, coded_s: this rank's times (seconds) of plain and of coded runs of the
            same work (whole steps, or all-reduces of the same buffer).
        step: the step the decision is made at (checked to be the same on every rank).
        group: the process group (None: the default one; or no group initialized).
        hysteresis, incumbent: as for :func:`decide`.
        device: the device of the gathered tensor (NCCL: a CUDA device).
        recheck_every: said in the reason, if given.
        plain_name: what the reason calls the plain mode.
        unit: what one timing is, in the reason's words (e.g. "ms per all-reduce" where
            single collectives were timed instead of whole steps).

    Returns:
        ``{"coded", "step", "plain_ms", "coded_ms", "per_rank_ms", "reason"}``.

    Raises:
        AgreementError: the ranks' steps differ or a rank has no valid times (every rank).
    """
    mine = [float(step), len(plain_s), _median(plain_s), len(coded_s), _median(coded_s)]
    rows = gather_rows(mine, group, device)
    check_rows(rows, step)
    plain = max(r[2] for r in rows)
    coded = max(r[4] for r in rows)
    choice = decide(incumbent, plain, coded, hysteresis)
    return {
        "coded": choice,
        "step": step,
        "plain_ms": 1e3 * plain,
        "coded_ms": 1e3 * coded,
        "per_rank_ms": [[1e3 * r[2], 1e3 * r[4]] for r in rows],
        "reason": _reason(choice, plain, coded, incumbent, hysteresis, recheck_every, plain_name, unit),
    }


def _reason(
    coded: bool,
    plain_s: float,
    coded_s: float,
    before,
    hysteresis: float,
    recheck_every,
    plain_name: str,
    unit: str = "ms/step",
) -> str:
    if coded:
        words = f"compressing pays here: {1e3 * coded_s:.0f} vs {1e3 * plain_s:.0f} {unit} plain"
    else:
        words = f"{plain_name} is faster here: {1e3 * plain_s:.0f} vs {1e3 * coded_s:.0f} {unit} compressed"
    if before is not None and coded == before:
        words += f" (kept: a switch needs a {100 * hysteresis:.0f} % gain)"
    elif before is not None:
        words = "switched: " + words
    return words + (f"; re-checking every {recheck_every} steps" if recheck_every else "")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def check_rows(rows: list[list[float]], step: int) -> None:
    """Refuse to decide on rows that cannot be right (every rank checks the same rows)."""
    steps = {int(r[0]) for r in rows}
    if len(steps) != 1:
        listing = ", ".join(f"rank {i} at step {int(r[0])}" for i, r in enumerate(rows))
        raise AgreementError(
            f"comm_codec auto mode: ranks reached the decision at different steps ({listing}); "
            "every rank must run the same steps with the same settings"
        )
    for i, r in enumerate(rows):
        if not (r[1] >= 1 and r[3] >= 1 and all(math.isfinite(v) and v > 0 for v in (r[2], r[4]))):
            raise AgreementError(
                f"comm_codec auto mode: rank {i} measured no valid step times at step {step} "
                f"(plain {r[2]!r} s over {int(r[1])} steps, coded {r[4]!r} s over {int(r[3])}); "
                "its clock or its step counter is broken"
            )
