"""A client's name as every log line, status and ``k3ctl status`` shows it: one line, nothing a terminal acts on.

``printable`` escapes every character that is not printable, so a newline or a
terminal escape in a name can neither forge a log line nor redraw a terminal.  The
daemon applies it when it admits a name (``k3d.serve.access.admit``); ``k3ctl status``
applies it again to whatever a daemon sends, which changes nothing for an escaped name.

A module of its own, with no imports, so that ``k3ctl status`` (a short-lived process)
can load the rule without the daemon's access checks (logging, sockets).  Pure; any thread.
"""


def printable(name: str) -> str:
    """``name`` with every character that is not printable (newlines, carriage returns,
    ESC and the other controls, Unicode line separators) written as its Python escape
    (``\\n``, ``\\x1b``, ``\\u2028``): one line, nothing a terminal acts on.  Idempotent, so
    ``k3ctl`` applies it again to what any daemon sends."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
