"""Values read from files, made safe to print: control characters escaped, lengths capped.

A name in a checkpoint or a field of a codebook file is written by whoever made the file.
Printed raw, ``"\\x1b[2J"`` clears the user's screen, an OSC sequence sets the terminal's
title, and ``"\\nverified ... ok"`` forges a second line of output; quoted whole, a field
of 3 M characters makes a 9 MB error line, and ``repr`` of a list nested a thousand deep
ends in RecursionError. Every message and table that shows such a value goes through
:func:`printable` (a name, shown as text) or :func:`shown` (a JSON value, shown as
Python would write it). Neither recurses, and both cut what they return.
"""

from __future__ import annotations

__all__ = ["printable", "shown"]

# Longest name a table or message shows; longer ones are cut, with "..." after them.
NAME_LIMIT = 200


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text, limit: int = NAME_LIMIT) -> str:
    """Return a name from a file with every unprintable character escaped (``\\x1b``), cut to ``limit``.

    Args:
        text: the name (anything else is shown with :func:`shown`).
        limit: the most characters of ``text`` shown; longer names end in "...".

    Returns:
        One line of printable text: control characters, line and paragraph separators,
        bidirectional overrides and other characters ``str.isprintable`` refuses are
        written as Python escapes.
    """
    if not isinstance(text, str):
        return shown(text, limit)
    cut = text[:limit]
    out = cut if cut.isprintable() else "".join(ch if ch.isprintable() else _escape(ch) for ch in cut)
    return out + ("..." if len(text) > limit else "")


def shown(value, limit: int = 60) -> str:
    """Return a JSON value as ``repr`` would write it, built without recursion and cut to ``limit``.

    Args:
        value: what ``json.loads`` returned (or any value: other types show their type).
        limit: the most characters returned before "...".

    Returns:
        The text, at most ``limit`` characters plus "...": strings quoted with their
        unprintable characters escaped, integers of more than 64 digits by their size.
    """
    parts: list[str] = []
    size = 0
    stack: list = [value]
    while stack and size <= limit:
        v = stack.pop()
        if isinstance(v, _Text):
            text = v.text
        elif isinstance(v, str):
            text = repr(v[: limit + 1])
        elif isinstance(v, bool) or v is None or isinstance(v, float):
            text = repr(v)
        elif isinstance(v, int):
            text = repr(v) if v.bit_length() <= 212 else f"<an integer of {v.bit_length()} bits>"
        elif isinstance(v, list):
            stack.append(_Text("]"))
            for i in range(min(len(v), limit) - 1, -1, -1):
                stack.append(v[i])
                if i:
                    stack.append(_Text(", "))
            text = "["
        elif isinstance(v, dict):
            stack.append(_Text("}"))
            items = list(v.items())[:limit]
            for i in range(len(items) - 1, -1, -1):
                stack.append(items[i][1])
                stack.append(_Text(": "))
                stack.append(items[i][0])
                if i:
                    stack.append(_Text(", "))
            text = "{"
        else:
            text = f"<{type(v).__name__}>"
        parts.append(text)
        size += len(text)
    text = "".join(parts)
    return text[:limit] + "..." if len(text) > limit or stack else text


class _Text:
    """A piece of punctuation on :func:`shown`'s stack (never a value to quote)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text
