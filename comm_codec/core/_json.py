"""The one JSON reader for text read from a file or a peer: sized before it is parsed.

Every JSON the package parses comes from someone else (a checkpoint's index, a codebook
file, a DCP book table, a peer's settings), and ``json.loads`` builds whatever the text
describes. A few kB of zstd can hold 128 MiB of ``[{},{},...]`` (tens of millions of dicts)
or one string with a single astral character, which Python stores at 4 bytes per
character, twice (the decoded text and the value). :func:`loads` estimates, before
parsing, an upper bound on what the parse holds at its peak, refuses text over the
caller's ``limit``, and waits for room in a budget shared by every parse in flight in the
process, so that files parsed on several threads at once cannot add up.

The estimate, per parse (measured with tracemalloc on the worst shapes: one dict, list,
number or one-character astral string per separator, and a single long string):

* the text itself (the caller holds it), and the ``str`` that ``json.loads`` decodes it
  into: ``width`` bytes per character, where ``width`` is 4 when the text may hold a
  character beyond U+FFFF (a 4-byte UTF-8 lead byte or a ``\\uD8xx`` escape), 2 when it
  holds any other non-ASCII byte or ``\\u`` escape, else 1;
* every string of the result: at most as many characters as the text, at ``width``,
  plus one byte per character while a string is built (the parser starts a string at
  one byte per character and widens it when a wider character comes: ``"\\naaa...😀"``
  holds 9 bytes per character at the peak);
* every value, counted by the separators and brackets that delimit it: at most
  :data:`VALUE_COST` bytes (an empty dict 64, a list slot 8, a dict entry and its key ~80,
  a one-character astral string 80).

Nesting deeper than the parser's stack is a refusal too, never a ``RecursionError``.

Example::

    >>> from comm_codec.core._json import loads
    >>> loads(b'{"a": [1, 2]}', error=ValueError)
    {'a': [1, 2]}
"""

from __future__ import annotations

import json
import os
import re
import threading

from .errors import CommCodecError

__all__ = ["DEFAULT_LIMIT", "VALUE_COST", "JsonBudget", "budget", "estimate", "loads"]

# Bytes of Python objects one JSON value may cost beyond its characters (see the module doc).
VALUE_COST = 120
# The most one parse may hold unless the caller says otherwise.
DEFAULT_LIMIT = 512 << 20
# Every parse in flight in the process together (COMM_CODEC_JSON_BUDGET_MB overrides).
_BUDGET_DEFAULT = 512 << 20

_LEADS4 = (b"\xf0", b"\xf1", b"\xf2", b"\xf3", b"\xf4")  # UTF-8 lead bytes of characters beyond U+FFFF
_SURROGATE = re.compile(rb"\\u[dD][89abAB]")


def estimate(text: bytes) -> int:
    """Return an upper bound on the bytes a parse of ``text`` holds at its peak, text included.

    Args:
        text: UTF-8 JSON text.

    Returns:
        The estimate in bytes (see the module's doc for what it counts).
    """
    n = len(text)
    # Substring tests and isascii() run at memory speed; the regex only where an escape is.
    escapes = b"\\u" in text
    if any(lead in text for lead in _LEADS4) or (escapes and _SURROGATE.search(text)):
        width = 4
    else:
        width = 1 if text.isascii() and not escapes else 2
    values = text.count(b",") + text.count(b":") + text.count(b"[") + text.count(b"{") + 1
    return n + width * n + (width + 1) * n + values * VALUE_COST + 4096  # + the parser's own frames


class JsonBudget:
    """Bytes that parses in flight may hold together; a parse waits until its estimate fits.

    A parse larger than the whole budget never waits: it is refused (by :func:`loads`).
    """

    def __init__(self, total: int):
        self.total = int(total)
        self.used = 0
        self._cv = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit beside what other parses hold, then take them."""
        with self._cv:
            while self.used and self.used + nbytes > self.total:
                self._cv.wait()
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`acquire` took."""
        with self._cv:
            self.used -= nbytes
            self._cv.notify_all()

    def reset_after_fork(self) -> None:
        """A forked child has no parses in flight (and a fresh lock: another thread may have held it)."""
        self.used = 0
        self._cv = threading.Condition()


def _budget_total() -> int:
    raw = os.environ.get("COMM_CODEC_JSON_BUDGET_MB")
    try:
        return max(1, int(raw)) << 20 if raw else _BUDGET_DEFAULT
    except ValueError:
        return _BUDGET_DEFAULT


budget = JsonBudget(_budget_total())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=budget.reset_after_fork)


def loads(text, *, error, limit: int = DEFAULT_LIMIT, parse_int=None, parse_constant=None):
    """Parse JSON text from a file or a peer, refusing what could not fit in memory.

    Args:
        text: UTF-8 bytes (or a str, taken as its UTF-8 encoding).
        error: called with the reason (a phrase such as ``"bad JSON: Expecting value at
            line 1 column 2"`` or ``"nested too deeply"``), returns the exception to
            raise; the caller says what the text was and where it came from.
        limit: the most bytes this parse may hold (its :func:`estimate`); the
            process-wide :data:`budget` caps all parses in flight together as well.
        parse_int, parse_constant: as for ``json.loads``; a hook that raises a
            :class:`~comm_codec.CommCodecError` passes it through.

    Returns:
        The parsed value.

    Raises:
        The exception ``error`` returns: over ``limit`` or the budget, not UTF-8, not
        JSON, or nested too deeply.
    """
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    need = estimate(raw)
    cap = min(limit, budget.total)
    if need > cap:
        raise error(
            f"{len(raw)} bytes of JSON that could take {need >> 20} MiB of memory to parse, more than "
            f"the {cap >> 20} MiB allowed: corrupted or not written by comm_codec"
        )
    kwargs = {k: v for k, v in (("parse_int", parse_int), ("parse_constant", parse_constant)) if v is not None}
    budget.acquire(need)
    try:
        try:
            decoded = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise error(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        del raw, text  # this frame's references; the caller's bytes are already counted
        return json.loads(decoded, **kwargs)
    except CommCodecError:
        raise  # a parse hook's own refusal, or ours above
    except RecursionError:
        raise error("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise error(f"bad JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise error(f"bad JSON: {str(exc)[:120]}") from None
    finally:
        budget.release(need)
