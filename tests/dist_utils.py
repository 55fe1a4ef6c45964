"""Run test functions on real gloo process groups (2-3 ranks on 127.0.0.1).

Two ways to run ``fn(rank, world_size, *args, **kwargs)`` on every rank:

* :func:`run` sends it to a long-lived group of workers for that world size (started on
  first use, shared by every test of the session). Spawning ranks costs seconds apiece
  (torch, numba), so most tests share them. If any rank raises, hangs, or dies, the
  group is killed and the next :func:`run` starts a fresh one.
* :func:`run_fresh` starts a group for one call and shuts it down, and also fails if a
  rank does not exit afterwards. For tests that leave a process group or DDP reducer in
  an unknown state (errors raised inside backward), and for "no rank hangs" checks.
* :func:`run_outcomes` is :func:`run_fresh` for fault tests in which a rank is meant to
  die or fail: it returns every rank's outcome (returned, raised, died, hung) instead of
  raising, so the test can check what the *other* ranks did.

``pg_timeout`` (run_fresh, run_outcomes) sets the gloo group's timeout, as a user's
``init_process_group(timeout=...)`` does.

Ranks are started with ``spawn`` (numba's OpenMP layer is not fork-safe), with one torch
thread and ``NUMBA_NUM_THREADS=1``. ``fn`` must be a module-level function of an
importable module; its return value must pickle. A failure on any rank fails the test
with that rank's traceback; a rank that does not answer within ``timeout`` seconds fails
it with a list of the ranks that hung.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing.connection
import os
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port

__all__ = ["WorkerFailure", "WorkerGroup", "run", "run_fresh", "run_outcomes", "free_port", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 90.0  # seconds for one call on all ranks
_PG_TIMEOUT = 60.0  # gloo's own timeout: a stuck collective raises (with a traceback) first
_START_TIMEOUT = 120.0  # spawn + import torch/numba + rendezvous
_ERROR_GRACE = 10.0  # after one rank failed, how long the others get to report
_EXIT_TIMEOUT = 20.0
_WORKER_ENV = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class WorkerFailure(AssertionError):
    """A rank raised, died, hung, or did not exit; the message holds every rank's story."""


@contextlib.contextmanager
def _child_env(extra: dict | None):
    """Set environment variables for processes started inside the block, then restore."""
    env = dict(_WORKER_ENV, **(extra or {}))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_main(rank: int, world: int, port: int, conn, pg_timeout: float) -> None:
    """A rank's loop: join the gloo group, then run (fn, args) messages until None."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the test process went away
            break
        if message is None:
            break
        try:
            fn, args, kwargs = pickle.loads(message)
            value = fn(rank, world, *args, **kwargs)
            reply = ("ok", pickle.dumps(value))
        except BaseException:
            reply = ("error", traceback.format_exc())
        conn.send(reply)
    dist.destroy_process_group()


class WorkerGroup:
    """``world_size`` spawned ranks joined in one gloo process group.

    Args:
        world_size: number of ranks.
        env: extra environment variables for the ranks.
    """

    def __init__(self, world_size: int, env: dict | None = None, pg_timeout: float = _PG_TIMEOUT):
        self.world_size = world_size
        self.broken = False
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        with _child_env(env):
            for rank in range(world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, port, child, pg_timeout),
                    name=f"gloo-rank{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        self._collect("start", _START_TIMEOUT)

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results by rank.

        Raises:
            WorkerFailure: a rank raised, died or did not answer in ``timeout`` seconds
                (the group is then killed and marked broken).
        """
        if self.broken:
            raise RuntimeError("this worker group is broken; start a new one")
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(message)
        name = getattr(fn, "__qualname__", repr(fn))
        return [pickle.loads(v) for v in self._collect(name, timeout)]

    def _collect(self, what: str, timeout: float) -> list:
        replies, dead, waited = self._wait_replies(timeout)
        world = self.world_size
        failed = len(replies) < world or any(status != "ok" and status != "ready" for status, _ in replies.values())
        if not failed:
            return [replies[r][1] for r in range(world)]
        lines = [f"{what} failed on {world} gloo ranks:"]
        for rank in range(world):
            if rank in replies and replies[rank][0] == "error":
                lines.append(f"--- rank {rank} raised:\n{replies[rank][1]}")
            elif rank in replies:
                lines.append(f"--- rank {rank}: ok")
            elif rank in dead:
                lines.append(f"--- rank {rank} died (exit code {dead[rank]}) without answering")
            else:
                lines.append(f"--- rank {rank} did not answer in {waited:.0f} s (hung; limit {timeout:.0f} s)")
        self.kill()
        raise WorkerFailure("\n".join(lines))

    def outcomes(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list[dict]:
        """Run fn on every rank; return each rank's outcome instead of raising.

        Returns:
            One dict per rank: ``{"status": "ok", "value": ...}``, ``{"status": "error",
            "traceback": str}``, ``{"status": "died", "exitcode": int}`` or ``{"status":
            "hung"}``, with ``"seconds"``: when the rank answered or died, from the start.
        """
        message = pickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(message)
        start = time.monotonic()
        replies, dead, _ = self._wait_replies(timeout, stop_early=False, start=start)
        out = []
        for rank in range(self.world_size):
            if rank in replies:
                status, payload, when = replies[rank]
                out.append(
                    {"status": "ok", "value": pickle.loads(payload), "seconds": when}
                    if status == "ok"
                    else {"status": "error", "traceback": payload, "seconds": when}
                )
            elif rank in dead:
                out.append({"status": "died", "exitcode": dead[rank][0], "seconds": dead[rank][1]})
            else:
                out.append({"status": "hung", "seconds": None})
        return out

    def _wait_replies(self, timeout: float, stop_early: bool = True, start: float | None = None):
        """Collect replies until every rank answered or died, or the time is up.

        With ``stop_early`` the others get _ERROR_GRACE seconds after a first failure;
        without it, replies carry the time they came (seconds from ``start``) and dead
        ranks their exit code and time.
        """
        world = self.world_size
        replies: dict[int, tuple] = {}
        start = time.monotonic() if start is None else start
        deadline = time.monotonic() + timeout
        first_error = None
        waiting = {self._conns[r]: r for r in range(world)}
        sentinels = {self._procs[r].sentinel: r for r in range(world)}
        dead: dict[int, object] = {}
        while len(replies) + len(dead) < world:
            now = time.monotonic()
            limit = deadline if first_error is None or not stop_early else min(deadline, first_error + _ERROR_GRACE)
            if now >= limit:
                break
            ready = multiprocessing.connection.wait(list(waiting) + list(sentinels), timeout=limit - now)
            for obj in ready:
                if obj in waiting:
                    rank = waiting[obj]
                    try:
                        reply = obj.recv()
                    except (EOFError, OSError):
                        continue  # the sentinel will say it died
                    replies[rank] = reply if stop_early else (*reply, time.monotonic() - start)
                    del waiting[obj]
                    if reply[0] == "error" and first_error is None:
                        first_error = time.monotonic()
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank not in replies:
                        self._procs[rank].join(1)
                        code = self._procs[rank].exitcode
                        dead[rank] = code if stop_early else (code, time.monotonic() - start)
                        waiting = {c: r for c, r in waiting.items() if r != rank}
                        if first_error is None:
                            first_error = time.monotonic()
        return replies, dead, time.monotonic() - (deadline - timeout)

    def close(self, timeout: float = _EXIT_TIMEOUT) -> list[int]:
        """Ask every rank to leave; return the ranks that did not exit in time (killed)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + timeout
        stuck = []
        for rank, proc in enumerate(self._procs):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                stuck.append(rank)
        self.kill()
        return stuck

    def kill(self) -> None:
        """Kill every rank still running (only processes this group started)."""
        self.broken = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        self._conns = []


_GROUPS: dict[int, WorkerGroup] = {}


def _group(world_size: int) -> WorkerGroup:
    group = _GROUPS.get(world_size)
    if group is None or group.broken:
        group = _GROUPS[world_size] = WorkerGroup(world_size)
    return group


def run(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on the shared group of ``world_size`` ranks.

    Returns:
        The return values, indexed by rank.

    Raises:
        WorkerFailure: with every failing rank's traceback, or the ranks that hung.
    """
    return _group(world_size).run(fn, *args, timeout=timeout, **kwargs)


def run_fresh(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    pg_timeout: float = _PG_TIMEOUT,
    **kwargs,
) -> list:
    """Like :func:`run`, on ranks started for this call alone, which must then exit.

    Raises:
        WorkerFailure: a rank failed or hung, or did not exit within 20 s afterwards
            (a thread stuck in a collective keeps a process alive).
    """
    group = WorkerGroup(world_size, env=env, pg_timeout=pg_timeout)
    try:
        results = group.run(fn, *args, timeout=timeout, **kwargs)
    except BaseException:
        group.kill()
        raise
    stuck = group.close()
    if stuck:
        raise WorkerFailure(f"ranks {stuck} returned but did not exit within {_EXIT_TIMEOUT:.0f} s (hung at exit)")
    return results


def run_outcomes(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict | None = None,
    pg_timeout: float = _PG_TIMEOUT,
    **kwargs,
) -> list[dict]:
    """Run fn on ranks started for this call; return every rank's outcome, never raise for it.

    For fault tests: a rank may be meant to die, stall or raise. Ranks still running at
    the end are killed.

    Returns:
        One dict per rank, as :meth:`WorkerGroup.outcomes` describes.
    """
    group = WorkerGroup(world_size, env=env, pg_timeout=pg_timeout)
    try:
        return group.outcomes(fn, *args, timeout=timeout, **kwargs)
    finally:
        group.kill()


@atexit.register
def _close_all() -> None:
    """Kill the shared ranks at the end of the session (a clean exit only costs time;
    run_fresh is the check that ranks can exit)."""
    for group in _GROUPS.values():
        group.kill()
    _GROUPS.clear()
