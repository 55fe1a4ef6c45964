"""launch_scripts/netns.py: the benchmarks' shaped loopback, made and deleted for real.

Where this process may make network namespaces (root, iproute2), a real one is made,
shaped, entered and deleted; elsewhere each test checks that the refusal says why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from comm_codec.core.errors import LinkShapingError

from helpers import launch_script

netns = launch_script("netns")

pytestmark = pytest.mark.unit

NAME = f"cc-test-{os.getpid()}"
CAN = netns.shaping_unavailable() is None


def _listed() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_a_shaped_namespace_holds_only_loopback_and_is_deleted_after():
    if not CAN:
        return _refused()
    with netns.namespace(NAME, "1gbit") as ns:
        assert ns in _listed()
        shown = netns.shape(ns, "2gbit")
        assert "tbf" in shown and "rate 2Gbit" in shown, shown
        links = subprocess.run(
            netns.exec_argv(ns, ["ip", "-o", "link", "show"]), capture_output=True, text=True, check=True
        ).stdout
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
        probe = [sys.executable, "-c", "import os; print(os.environ['GLOO_SOCKET_IFNAME'])"]
        env = subprocess.run(netns.exec_argv(ns, probe), capture_output=True, text=True, check=True).stdout
        assert env.strip() == "lo"
        with pytest.raises(LinkShapingError, match="exists already"):
            with netns.namespace(NAME):
                pass
        assert ns in _listed()  # the refused second one left the first alone
    assert NAME not in _listed()


def test_a_bad_rate_is_refused_and_the_namespace_still_deleted():
    if not CAN:
        return _refused()
    with pytest.raises(LinkShapingError, match="tc qdisc replace"):
        with netns.namespace(NAME, "fast"):
            pass
    assert NAME not in _listed()


def _refused():
    """Where namespaces cannot be made, the refusal says why (and nothing is left behind)."""
    with pytest.raises(LinkShapingError, match="need root|need iproute2"):
        with netns.namespace(NAME):
            pass


def test_lab_tools_are_not_installed_with_the_package():
    """netns needs root and huff0 a C library the user builds: they live in launch_scripts/."""
    import importlib.util

    for name in ("netns", "huff0"):
        assert importlib.util.find_spec(f"comm_codec.tools.{name}") is None, name
