"""A small schema checker for the JSON indexes of untrusted files: check once, then trust.

An index read from a file can hold anything JSON can: a string where a number belongs, a
list nested a thousand deep, a 2^70 offset. Each format describes its index once with
the specs below; :func:`check` walks the value against it and raises
:class:`CheckpointError` naming the first field that does not fit (``tensors[3].kind:
expected a string, got 5``). Code after the check reads fields without guarding them.
Keys a spec does not name are allowed (and ignored), so a later writer may add fields.

Each spec checks twice over: ``ok`` answers whether a value fits, with no path kept
(a DCP or directory index holds thousands of values, and building each one's path cost
more than checking it), and only where it says no does ``check`` walk the value again to
name the first field that does not fit. ``ok`` never accepts what ``check`` rejects; it
may refuse what ``check`` accepts (an int subclass), which ``check`` then lets through.
"""

from __future__ import annotations

import math

from ..core.quoting import shown
from .errors import CheckpointError

__all__ = ["Int", "Num", "Str", "OneOf", "ListOf", "Row", "MapOf", "Record", "Nullable", "Anything", "check", "MAX_INT"]

MAX_INT = 1 << 62
# JSON's scalar types, the only ones OneOf can match (and hash: a list or dict cannot be).
_SCALARS = (str, int, float, bool, type(None))


class _Spec:
    def check(self, value, where: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def ok(self, value) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


# Where a value lies: a string, or (where of its container, item index or ".field" /
# " key" suffix), spelled out only for a message: formatting the path of every value of
# an index that fits would take most of the time of checking it.
def _where(where) -> str:
    parts = []
    while isinstance(where, tuple):
        where, suffix = where
        parts.append(f"[{suffix}]" if isinstance(suffix, int) else suffix)
    return where + "".join(reversed(parts))


def _bad(where, expected: str, value) -> CheckpointError:
    # shown(), not repr(): a value may nest deeper than repr can recurse, or be megabytes long
    return CheckpointError(f"{_where(where)}: expected {expected}, got {shown(value)}")


class Int(_Spec):
    """An integer (not a bool) from lo to hi."""

    def __init__(self, lo: int = 0, hi: int = MAX_INT):
        self.lo, self.hi = lo, hi

    def ok(self, value):
        return type(value) is int and self.lo <= value <= self.hi

    def check(self, value, where):
        if not (isinstance(value, int) and not isinstance(value, bool) and self.lo <= value <= self.hi):
            raise _bad(where, f"an integer from {self.lo} to {self.hi}", value)


class Num(_Spec):
    """A number (int or float, not a bool); finite unless ``finite=False``."""

    def __init__(self, finite: bool = True, lo: float = -math.inf):
        self.finite, self.lo = finite, lo

    def ok(self, value):
        if type(value) is not int and type(value) is not float:
            return False
        return not self.finite or (math.isfinite(value) and value >= self.lo)

    def check(self, value, where):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and self.finite:
            ok = math.isfinite(value) and value >= self.lo
        if not ok:
            raise _bad(where, "a finite number" if self.finite else "a number", value)


class Str(_Spec):
    """A string of at most ``max_len`` characters (exactly ``length`` if given)."""

    def __init__(self, max_len: int = 4096, length: int | None = None):
        self.max_len, self.length = max_len, length

    def ok(self, value):
        return type(value) is str and len(value) <= self.max_len and (self.length is None or len(value) == self.length)

    def check(self, value, where):
        if (
            not isinstance(value, str)
            or len(value) > self.max_len
            or (self.length is not None and len(value) != self.length)
        ):
            expected = f"a string of {self.length} characters" if self.length else "a string"
            raise _bad(where, expected, value)


class OneOf(_Spec):
    """One of the given JSON values."""

    def __init__(self, *values):
        self.values = values
        self._keys = frozenset((type(v), v) for v in values)

    def ok(self, value):
        return type(value) in _SCALARS and (type(value), value) in self._keys

    def check(self, value, where):
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise _bad(where, "one of " + ", ".join(map(repr, self.values)), value)


class ListOf(_Spec):
    """A list of items that each fit ``item``, at most ``max_len`` of them."""

    def __init__(self, item: _Spec, max_len: int = 1 << 24):
        self.item, self.max_len = item, max_len

    def ok(self, value):
        return type(value) is list and len(value) <= self.max_len and all(map(self.item.ok, value))

    def check(self, value, where):
        if not isinstance(value, list) or len(value) > self.max_len:
            raise _bad(where, f"a list of at most {self.max_len} items", value)
        item = self.item
        for i, v in enumerate(value):
            item.check(v, (where, i))


class Row(_Spec):
    """A list of fixed length whose items fit the given specs in order."""

    def __init__(self, *items: _Spec):
        self.items = items
        self._oks = tuple(spec.ok for spec in items)

    def ok(self, value):
        if type(value) is not list or len(value) != len(self._oks):
            return False
        for fits, v in zip(self._oks, value):
            if not fits(v):
                return False
        return True

    def check(self, value, where):
        if not isinstance(value, list) or len(value) != len(self.items):
            raise _bad(where, f"a list of {len(self.items)} items", value)
        for i, (spec, v) in enumerate(zip(self.items, value)):
            spec.check(v, (where, i))


class MapOf(_Spec):
    """A JSON object whose keys fit ``key`` (a string spec) and values fit ``value``."""

    def __init__(self, key: _Spec, value: _Spec, max_len: int = 1 << 20):
        self.key, self.value, self.max_len = key, value, max_len

    def ok(self, value):
        if type(value) is not dict or len(value) > self.max_len:
            return False
        key_ok, value_ok = self.key.ok, self.value.ok
        for k, v in value.items():
            if not (key_ok(k) and value_ok(v)):
                return False
        return True

    def check(self, value, where):
        if not isinstance(value, dict) or len(value) > self.max_len:
            raise _bad(where, "an object", value)
        for k, v in value.items():
            self.key.check(k, (where, " key"))
            self.value.check(v, (where, f"[{k!r}]"))


class Record(_Spec):
    """A JSON object with these fields (each required unless listed in ``optional``)."""

    def __init__(self, fields: dict, optional: tuple = ()):
        self.fields, self.optional = fields, set(optional)
        self._oks = tuple((name, spec.ok, name in self.optional) for name, spec in fields.items())

    def ok(self, value):
        if type(value) is not dict:
            return False
        for name, fits, optional in self._oks:
            if name in value:
                if not fits(value[name]):
                    return False
            elif not optional:
                return False
        return True

    def check(self, value, where):
        if not isinstance(value, dict):
            raise _bad(where, "an object", value)
        for name, spec in self.fields.items():
            if name not in value:
                if name in self.optional:
                    continue
                raise CheckpointError(f"{_where(where)}: field {name!r} is missing")
            spec.check(value[name], (where, "." + name))


class Nullable(_Spec):
    """null, or a value that fits ``spec``."""

    def __init__(self, spec: _Spec):
        self.spec = spec

    def ok(self, value):
        return value is None or self.spec.ok(value)

    def check(self, value, where):
        if value is not None:
            self.spec.check(value, where)


class Anything(_Spec):
    """Any value of the given Python type (checked in depth elsewhere, e.g. a codebook)."""

    def __init__(self, kind: type = object):
        self.kind = kind

    def ok(self, value):
        return isinstance(value, self.kind)

    def check(self, value, where):
        if not isinstance(value, self.kind):
            raise _bad(where, f"a JSON {self.kind.__name__}", value)


def check(value, spec: _Spec, path, what: str = "index") -> None:
    """Check a decoded JSON value against a spec.

    Args:
        value: what ``json.loads`` returned.
        spec: the format's spec.
        path: the file, for the message.
        what: the value's name in the message.

    Raises:
        CheckpointError: ``"<path>: <what>.<field>: expected ..., got ..."``.
    """
    if spec.ok(value):
        return
    try:
        spec.check(value, what)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
