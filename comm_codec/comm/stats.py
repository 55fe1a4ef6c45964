"""Traffic statistics shared by the DDP hook, the collectives, the DeepSpeed plugin and FSDP2.

Every call counts, coded or plain. ``bytes_in`` is what the uncompressed collectives
would have put on the wire from this rank over the run (a ring all-reduce sends
``2 (W-1)/W`` of the buffer; the two-phase compressed one sends the same shards, coded),
``bytes_out`` what was sent: a plain call (warmup, ``mode="never"``, auto's plain steps,
buckets too small to pay) adds its wire bytes to both, a coded one its frames, padding
and size exchanges to ``bytes_out``. So ``ratio = bytes_in / bytes_out`` is the wire
saving of the whole run; the coded calls alone are under ``coded_bytes_in``,
``coded_bytes_out`` and ``coded_ratio``. :func:`state_stats` is what every owner's
``stats()`` reports beside the traffic, under the same keys.
"""

from __future__ import annotations

import threading
import time

__all__ = ["CommStats", "state_stats"]


class CommStats:
    """Thread-safe counters of one rank's traffic, coded and plain.

    Attributes:
        coded_bytes_in: uncompressed bytes the coded calls would have sent plainly.
        coded_bytes_out: bytes the coded calls sent (frames, padding, size exchanges).
        plain_bytes: bytes the plain calls sent.
        encode_seconds, decode_seconds: time spent in the codec.
        comm_seconds: wall time of whole compressed collectives (codec included).
        calls: compressed collectives run.
        raw_calls: uncompressed collectives run (warmup, mode "never", auto's plain steps,
            tensors too small to pay).
        steps: training steps counted by the owner.
    """

    _FIELDS = ("coded_bytes_in", "coded_bytes_out", "plain_bytes", "encode_seconds", "decode_seconds",
               "comm_seconds", "calls", "raw_calls", "steps")
    _FLOATS = ("encode_seconds", "decode_seconds", "comm_seconds")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            for name in self._FIELDS:
                setattr(self, name, 0.0 if name in self._FLOATS else 0)

    def add(self, **deltas) -> None:
        """Add to counters by name (unknown names raise AttributeError)."""
        with self._lock:
            for name, value in deltas.items():
                if name not in self._FIELDS:
                    raise AttributeError(f"CommStats has no counter {name!r}")
                setattr(self, name, getattr(self, name) + value)

    def add_plain(self, wire_bytes: int) -> None:
        """Count one plain call that put ``wire_bytes`` on the wire (ratio 1)."""
        self.add(plain_bytes=int(wire_bytes), raw_calls=1)

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
        """Return the counters plus the run's totals and ratios (see the module's docstring)."""
        with self._lock:
            d = {name: getattr(self, name) for name in self._FIELDS}
        return CommStats._derived(d)

    @staticmethod
    def _derived(d: dict) -> dict:
        d["bytes_in"] = d["coded_bytes_in"] + d["plain_bytes"]
        d["bytes_out"] = d["coded_bytes_out"] + d["plain_bytes"]
        d["ratio"] = d["bytes_in"] / d["bytes_out"] if d["bytes_out"] else 1.0
        d["bytes_saved"] = d["bytes_in"] - d["bytes_out"]
        d["coded_ratio"] = d["coded_bytes_in"] / d["coded_bytes_out"] if d["coded_bytes_out"] else 1.0
        d["codec_seconds"] = d["encode_seconds"] + d["decode_seconds"]
        return d

    @staticmethod
    def sum(records) -> dict:
        """Add up several :meth:`as_dict` results (one per collective) into one, ratios recomputed."""
        total = {name: 0 for name in CommStats._FIELDS}
        for d in records:
            for name in CommStats._FIELDS:
                total[name] += d[name]
        return CommStats._derived(total)

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
