"""Traffic statistics shared by the DDP hook, the collectives, the DeepSpeed plugin and FSDP2.

Every call counts, coded or plain. ``bytes_in`` is what the uncompressed collectives
would have put on the wire from this rank over the run (a ring all-reduce sends
``2 (W-1)/W`` of the buffer; the two-phase compressed one sends the same shards, coded),
``bytes_out`` what was sent: a plain call (warmup, ``mode="never"``, auto's plain steps,
buckets too small to pay) adds its wire bytes to both, a coded one its frames, padding
and size exchanges to ``bytes_out``. So ``ratio = bytes_in / bytes_out`` is the wire
saving of the whole run; the coded calls alone are under ``coded_bytes_in``,
``coded_bytes_out`` and ``coded_ratio``.

What users read is typed: :class:`CollectiveStats` is one collective's traffic, and
:class:`TrafficStats` -- what every state's ``stats()`` returns, for the DDP hook, FSDP2
and DeepSpeed alike -- adds the run's step count, books and coding decision, with one
:class:`CollectiveStats` per collective the adapter runs. Both are frozen dataclasses
that also read as mappings (``stats()["bytes_in"]``) and turn into plain dicts with
``as_dict()`` (for JSON and loggers).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping

__all__ = ["CommStats", "CollectiveStats", "TrafficStats", "LOGGED", "traffic_line"]

# The fields every integration logs (the periodic traffic line, trainer logs, monitors).
LOGGED = ("ratio", "coded_ratio", "bytes_saved", "bytes_in", "bytes_out", "calls", "raw_calls", "codec_seconds")


class _Record(Mapping):
    """A frozen dataclass that reads like the dict it replaces: ``record["bytes_in"]``, ``in``, ``keys()``."""

    def __getitem__(self, key):
        if key in self._keys():
            value = getattr(self, key)
            return value.as_dict() if isinstance(value, _Record) else value
        raise KeyError(key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    def _keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))

    def as_dict(self) -> dict:
        """Return the record as a plain dict (nested records as dicts)."""
        return {key: self[key] for key in self}


@dataclasses.dataclass(frozen=True, eq=True)
class CollectiveStats(_Record):
    """One collective's traffic on this rank over the run.

    Attributes:
        bytes_in: what plain collectives would have sent (coded and plain calls).
        bytes_out: what was sent.
        ratio: ``bytes_in / bytes_out`` (1.0 before any call).
        bytes_saved: ``bytes_in - bytes_out``.
        coded_bytes_in, coded_bytes_out, coded_ratio: the coded calls alone.
        plain_bytes: what the plain calls sent.
        calls: coded calls; raw_calls: plain calls.
        encode_seconds, decode_seconds, codec_seconds: time in the codec.
        comm_seconds: wall time of the coded collectives (codec included).
    """

    bytes_in: int = 0
    bytes_out: int = 0
    ratio: float = 1.0
    bytes_saved: int = 0
    coded_bytes_in: int = 0
    coded_bytes_out: int = 0
    coded_ratio: float = 1.0
    plain_bytes: int = 0
    calls: int = 0
    raw_calls: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    codec_seconds: float = 0.0
    comm_seconds: float = 0.0

    @classmethod
    def of(cls, counts: dict) -> CollectiveStats:
        """Make the record from :class:`CommStats` counters (the totals and ratios derived)."""
        d = CommStats._derived({name: counts[name] for name in CommStats._FIELDS})
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(CollectiveStats)})


@dataclasses.dataclass(frozen=True, eq=True)
class TrafficStats(CollectiveStats):
    """What a state's ``stats()`` returns: the traffic of all its collectives, the steps, books and decision.

    The same fields for every integration (DDP, FSDP2, DeepSpeed; a DeepSpeed section
    with ``"enabled": false`` has ``enabled`` False and everything else zero).

    Attributes:
        (traffic): the fields of :class:`CollectiveStats`, summed over the collectives.
        steps: training steps counted.
        enabled: whether the codec is installed.
        warming_up: whether the books are still being profiled.
        books: the books' digest (None while none exist).
        drift: the last measured loss of the books against optimal codes (None: not measured).
        refreshes: book refreshes so far.
        mode: "auto", "always" or "never".
        coding: whether the current step codes.
        decision: auto's last decision (None before the first measurement; else coded,
            step, plain_ms, coded_ms, per_rank_ms, reason).
        switches: changes of auto's decision; probes: its measurements started.
        collectives: one :class:`CollectiveStats` per collective the adapter runs, by
            name ("all_reduce"; "reduce_scatter" and "all_gather"). Where there are
            several, each also reads under its name: ``stats()["all_gather"]["calls"]``.
    """

    steps: int = 0
    enabled: bool = True
    warming_up: bool = False
    books: str | None = None
    drift: float | None = None
    refreshes: int = 0
    mode: str = "never"
    coding: bool = False
    decision: dict | None = None
    switches: int = 0
    probes: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)

    def _keys(self) -> tuple[str, ...]:
        own = tuple(f.name for f in dataclasses.fields(self) if f.name != "collectives")
        return own + (tuple(self.collectives) if len(self.collectives) > 1 else ())

    def __getitem__(self, key):
        if key in self.collectives and len(self.collectives) > 1:
            return self.collectives[key].as_dict()
        return super().__getitem__(key)

    def __hash__(self):
        return id(self)


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
    """

    _FIELDS = (
        "coded_bytes_in",
        "coded_bytes_out",
        "plain_bytes",
        "encode_seconds",
        "decode_seconds",
        "comm_seconds",
        "calls",
        "raw_calls",
    )
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

    def timer(self, field: str) -> CommStats._Timer:
        """Return a context manager that adds its elapsed seconds to ``field``."""
        return CommStats._Timer(self, field)

    def as_dict(self) -> dict:
        """Return the counters plus the run's totals and ratios (see the module's docstring)."""
        return self.record().as_dict()

    def record(self) -> CollectiveStats:
        """Return the counters as a typed, frozen :class:`CollectiveStats`."""
        with self._lock:
            d = {name: getattr(self, name) for name in self._FIELDS}
        return CollectiveStats.of(d)

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
    def sum(records) -> CollectiveStats:
        """Add up several :class:`CollectiveStats` (one per collective) into one, ratios recomputed."""
        total = {name: 0 for name in CommStats._FIELDS}
        for d in records:
            for name in CommStats._FIELDS:
                total[name] += d[name]
        return CollectiveStats.of(total)

    def __getstate__(self):
        return {name: getattr(self, name) for name in self._FIELDS}

    def __setstate__(self, state):
        self._lock = threading.Lock()
        for name in self._FIELDS:
            setattr(self, name, state.get(name, 0))

    def __repr__(self) -> str:
        d = self.as_dict()
        return f"CommStats(ratio={d['ratio']:.3f}, bytes_in={d['bytes_in']}, bytes_out={d['bytes_out']})"


def traffic_line(stats) -> str:
    """Return the fields of :data:`LOGGED` as one line, the same for every integration's log."""
    return (
        f"ratio={stats['ratio']:.3f} coded_ratio={stats['coded_ratio']:.3f} "
        f"bytes_saved={stats['bytes_saved']} bytes_in={stats['bytes_in']} bytes_out={stats['bytes_out']} "
        f"calls={stats['calls']} raw_calls={stats['raw_calls']} codec_seconds={stats['codec_seconds']:.2f}"
    )
