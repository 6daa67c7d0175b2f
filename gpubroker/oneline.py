"""Text shown on one line: a reason, a name or a log message that came from
a user cannot forge other lines (of a log, a table, the audit log) or move
a terminal's cursor.

Pure: no I/O.
"""

from __future__ import annotations


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (newlines, tabs,
    terminal escapes, Unicode line separators: :meth:`str.isprintable`)
    written as its Python escape (``\\n``, ``\\x1b``, ``\\u2028``); other
    text, non-ASCII letters included, is kept."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)
