"""sd_notify by hand: READY=1, STATUS=..., WATCHDOG=1, STOPPING=1.

The protocol is one datagram per message to the AF_UNIX socket named by
``NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace).  Without
``NOTIFY_SOCKET`` every call is a no-op, so the daemon behaves the same in a
terminal.  Failures to notify are logged once and otherwise ignored: systemd
being unreachable must never stop the cache from serving.

Used from the daemon's main thread only (start-up progress, then the server loop's
STATUS/WATCHDOG ticks); no lock.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("k3d.systemd")


class Notifier:
    def __init__(self, env):
        addr = env.get("NOTIFY_SOCKET")
        self.addr = ("\0" + addr[1:]) if addr and addr.startswith("@") else addr
        watchdog = env.get("WATCHDOG_USEC")
        # Ping at half the interval, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval = int(watchdog) / 2e6 if watchdog and watchdog.isdigit() else None
        self._sock = None
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.addr)

    def send(self, *lines: str) -> None:
        if not self.addr:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), self.addr)
        except OSError as e:
            if not self._warned:
                log.warning("cannot notify systemd at %s: %s", self.addr, e)
                self._warned = True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=draining")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
