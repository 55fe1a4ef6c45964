"""Traffic statistics shared by the DDP hook, the collectives, the DeepSpeed plugin and FSDP2.

``bytes_in`` counts what the uncompressed collective would have put on the wire from this
rank (a ring all-reduce sends ``2 (W-1)/W`` of the buffer; the two-phase compressed one
sends the same shards, coded), ``bytes_out`` what the compressed one did send, padding
and size exchanges included. Their quotient is the wire saving. :func:`state_stats` is
what every owner's ``stats()`` reports beside the traffic, under the same keys.
"""

from __future__ import annotations

import threading
import time

__all__ = ["CommStats", "state_stats"]


class CommStats:
    """Thread-safe counters of one rank's compressed traffic.

    Attributes:
        bytes_in: uncompressed bytes the same collectives would have sent.
        bytes_out: bytes actually sent (frames, padding, size exchanges).
        encode_seconds, decode_seconds: time spent in the codec.
        comm_seconds: wall time of whole compressed collectives (codec included).
        calls: compressed collectives run.
        raw_calls: uncompressed collectives run (warmup, or too small to pay).
        steps: training steps counted by the owner (the DDP hook counts one per
            backward pass).
    """

    _FIELDS = ("bytes_in", "bytes_out", "encode_seconds", "decode_seconds", "comm_seconds",
               "calls", "raw_calls", "steps")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            for name in self._FIELDS:
                setattr(self, name, 0 if name in ("bytes_in", "bytes_out", "calls", "raw_calls", "steps") else 0.0)

    def add(self, **deltas) -> None:
        """Add to counters by name (unknown names raise AttributeError)."""
        with self._lock:
            for name, value in deltas.items():
                if name not in self._FIELDS:
                    raise AttributeError(f"CommStats has no counter {name!r}")
                setattr(self, name, getattr(self, name) + value)

    class _Timer:
        __slots__ = ("stats", "field", "start")

        def __init__(self, stats, field):
            self.stats, self.field = stats, field

        def __enter__(self):
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            self.stats.add(**{self.field: time.perf_counter() - self.start})

    def timer(self, field: str) -> "CommStats._Timer":
        """Return a context manager that adds its elapsed seconds to ``field``."""
        return CommStats._Timer(self, field)

    def as_dict(self) -> dict:
        """Return the counters plus ``ratio`` and ``bytes_saved``."""
        with self._lock:
            d = {name: getattr(self, name) for name in self._FIELDS}
        d["ratio"] = d["bytes_in"] / d["bytes_out"] if d["bytes_out"] else 1.0
        d["bytes_saved"] = d["bytes_in"] - d["bytes_out"]
        return d

    @staticmethod
    def sum(records) -> dict:
        """Add up several :meth:`as_dict` results (one per collective) into one, ratio recomputed."""
        total = {name: 0 for name in CommStats._FIELDS}
        for d in records:
            for name in CommStats._FIELDS:
                total[name] += d[name]
        total["ratio"] = total["bytes_in"] / total["bytes_out"] if total["bytes_out"] else 1.0
        total["bytes_saved"] = total["bytes_in"] - total["bytes_out"]
        return total

    def __getstate__(self):
        return {name: getattr(self, name) for name in self._FIELDS}

    def __setstate__(self, state):
        self._lock = threading.Lock()
        for name in self._FIELDS:
            setattr(self, name, state.get(name, 0))

    def __repr__(self) -> str:
        d = self.as_dict()
        return f"CommStats(ratio={d['ratio']:.3f}, bytes_in={d['bytes_in']}, bytes_out={d['bytes_out']})"


def state_stats(*, warming_up: bool, codebooks, refresh, switch, coding: bool) -> dict:
    """Return the keys beside the traffic that every owner's ``stats()`` reports.

    The DDP hook (and so DeepSpeed) and FSDP2 report the same: ``warming_up``, ``books``
    (the books' digest, None while none exist), ``drift`` and ``refreshes`` (of a
    :class:`~comm_codec.comm.refresh.BookRefresh`), ``mode``, ``decision``, ``switches``,
    ``probes`` (:meth:`~comm_codec.comm.autoswitch.AutoSwitch.stats`) and ``coding``
    (whether the current step codes).
    """
    return {"warming_up": warming_up, "books": codebooks.digest if codebooks is not None else None,
            "drift": refresh.drift, "refreshes": refresh.refreshes, **switch.stats(), "coding": coding}
