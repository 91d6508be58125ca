"""Whether a remote source's origin answers, as its requests find it.

``went_down`` is called when a request fails after its retries (``OriginDown``),
or at start when the source opened from the headers kept in the disk tier;
``answered`` when a request gets an answer.  Transitions are logged once.
Status (``model.tiers.origin``) carries ``up`` and, while down, since when and
the last error.  While down the source gives each request one attempt (no
backoff): what the disk tier lacks fails at once, and the first request that
gets through marks the origin up again.

Thread-safety: reader threads call both methods; one lock guards the fields.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("k3d")


class OriginState:
    def __init__(self, url: str):
        self.url = url
        self._mu = threading.Lock()
        self.up = True
        self._since = time.monotonic()
        self._error = ""

    def went_down(self, error: str) -> None:
        with self._mu:
            was, self.up, self._error = self.up, False, error
            if was:
                self._since = time.monotonic()
        if was:
            log.warning("origin %s does not answer: %s; serving from the disk tier, retrying it on demand",
                        self.url, error)

    def answered(self) -> None:
        if self.up:                 # the common case, without the lock
            return
        with self._mu:
            was, self.up = self.up, True
            down_s = time.monotonic() - self._since
            self._since = time.monotonic()
        if not was:
            log.warning("origin %s answers again after %.1fs down", self.url, down_s)

    def status(self) -> dict:
        with self._mu:
            if self.up:
                return {"up": True}
            return {"up": False, "down_s": round(time.monotonic() - self._since, 3), "error": self._error}
