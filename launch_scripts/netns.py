"""Shaped links for the benchmarks: a network namespace whose loopback is the only link.

The benchmarks that compare coded and plain collectives at a given link speed run their
ranks inside a fresh network namespace (``ip netns``): it holds only 127.0.0.1, so
nothing outside the machine is reached, and its loopback is shaped with a token-bucket
filter (``tc qdisc ... tbf``). :func:`namespace` makes one and deletes it however the run
ends (an exception, SIGTERM, SIGHUP); :func:`exec_argv` is the command that runs a
program inside it; :func:`shape` changes its rate between runs. The recipe is
``launch_scripts/netns.sh``'s. Root and iproute2 are needed, which is why it lives beside
the benchmarks that import it and is not installed with the package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys

from comm_codec.core.errors import LinkShapingError

__all__ = ["exec_argv", "namespace", "shape", "shaping_unavailable"]

# tbf's bucket and queue: 256 kB bursts (what gloo's socket writes need at 10 Gbit/s),
# 50 ms of queue before drops.
_TBF = ("burst", "256kb", "latency", "50ms")


def shaping_unavailable() -> str | None:
    """Why this process cannot shape a link (not root, no ``ip``/``tc``), or None if it can."""
    if os.geteuid() != 0:
        return "shaped links need root (a network namespace)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"shaped links need iproute2 ({' and '.join(missing)} not found: apt-get install iproute2)"
    return None


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise LinkShapingError(f"{' '.join(argv)} failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def shape(name: str, rate: str | None) -> str:
    """Shape the namespace's loopback to rate (tc's units: ``"10gbit"``); None: unshaped.

    Args:
        name: a namespace made by :func:`namespace`.
        rate: tbf's rate, or None to remove the shaping.

    Returns:
        ``tc qdisc show dev lo`` inside the namespace, for the run's log.

    Raises:
        LinkShapingError: tc refused (a bad rate, no such namespace).
    """
    inside = ["ip", "netns", "exec", name]
    if rate is None:
        subprocess.run([*inside, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # none: fine
    else:
        _run([*inside, "tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, *_TBF])
    return _run([*inside, "tc", "qdisc", "show", "dev", "lo"]).strip()


def exec_argv(name: str, argv: list[str]) -> list[str]:
    """The command that runs argv inside the namespace, gloo bound to its loopback.

    (``TORCH_CPP_LOG_LEVEL=ERROR``: the namespace has no DNS, and c10d warns about every
    peer's host name otherwise.)
    """
    return ["ip", "netns", "exec", name, "env", "GLOO_SOCKET_IFNAME=lo", "TORCH_CPP_LOG_LEVEL=ERROR", *argv]


@contextlib.contextmanager
def namespace(name: str, rate: str | None = None):
    """A fresh network namespace with its loopback up (and shaped to rate), deleted on exit.

    Args:
        name: the namespace's name; one that exists already is refused (another run's).
        rate: tbf's rate for its loopback (``"1gbit"``), or None for unshaped.

    Yields:
        The name.

    Raises:
        LinkShapingError: not root, no iproute2, the name taken, or ip/tc failing.
    """
    why = shaping_unavailable()
    if why:
        raise LinkShapingError(why)
    if name in _run(["ip", "netns", "list"]).split():
        raise LinkShapingError(
            f"network namespace {name} exists already (another run?); delete it with "
            f"'ip netns del {name}' or choose another name"
        )
    _run(["ip", "netns", "add", name])
    # A run killed with SIGTERM or SIGHUP still unwinds through finally and deletes it.
    previous = {s: signal.signal(s, lambda signum, _: sys.exit(128 + signum)) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        if rate is not None:
            shape(name, rate)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        print(f"(namespace {name} deleted)", file=sys.stderr, flush=True)
