"""Start-up you can see: the endpoint answers from the moment the daemon holds its lock.

``k3d start`` binds its ROUTER socket right after ``claim_endpoint`` and hands
it to a ``StartupResponder`` thread while the main thread opens the source
and collapses and reserves the arena (seconds for a large one).
The responder answers:

- ``status`` -> ``{"state": "starting", "phase", "done", "total", "eta_s",
  "pid", "version", "endpoint", "uptime_s"}`` (``k3ctl status`` prints
  ``starting: reserving the arena 1.2/4.0 GiB (30 %), ~8 s left`` and exits 3);
- ``heartbeat`` -> nothing (a client of the previous daemon, retrying);
- anything else -> the ``starting`` error with the same progress line
  (``k3client.connect(wait=SECONDS)`` retries it until ready).

Progress on stderr (``ProgressPrinter``): on a terminal one line that redraws
in place; to a log or journal a line at every ~10 %, so a 4 GiB start is ~10
lines, not 32.

Threads: the main thread calls ``progress`` (a dict swapped under a lock);
the responder thread alone uses the socket until ``hand_over``, which stops
it, joins it (a full memory barrier: ZeroMQ sockets may move between
threads that way) and returns the socket to the caller, the server loop.

``StartupError`` is every refusal of the start-up (``claim``, ``daemon``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import zmq

from k3client.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, pack, unpack
from k3d import __version__

POLL_MS = 50


class StartupError(Exception):
    """A start that cannot go on: ``k3d start`` prints the message in one line and exits 1."""


def percent(done: int, total: int) -> int:
    """Rounded, but 100 only when done."""
    return 100 if done >= total else min(99, round(100 * done / total))


def describe(p: dict) -> str:
    """``reserving the arena 1.2/4.0 GiB (30 %), ~8 s left`` (the phase alone before progress is known)."""
    line = p["phase"]
    if p.get("total"):
        unit, scale = ("GiB", 2**30) if p["total"] >= 2**30 else ("MiB", 2**20)
        line += (f" {p['done'] / scale:.1f}/{p['total'] / scale:.1f} {unit} "
                 f"({percent(p['done'], p['total'])} %)")
    if p.get("eta_s") is not None:
        line += f", ~{p['eta_s']:.0f} s left"
    return line


class Progress:
    """Phase, bytes and ETA of the start-up; ``update`` from the main thread, ``snapshot`` from any."""

    def __init__(self):
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._p = {"phase": "opening the source", "done": 0, "total": 0, "eta_s": None}
        self._phase_t0 = self._last = self._t0

    def update(self, phase: str, done: int, total: int) -> dict:
        now = time.monotonic()
        with self._lock:
            if phase != self._p["phase"]:
                self._phase_t0 = self._last       # the new phase began when the last one's last step ended
            self._last = now
            spent = now - self._phase_t0
            eta = (total - done) * spent / done if done and spent > 0.05 else None
            self._p = {"phase": phase, "done": done, "total": total,
                       "eta_s": None if eta is None else round(eta, 1)}
            return dict(self._p)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._p, uptime_s=round(time.monotonic() - self._t0, 3))


class ProgressPrinter:
    """stderr progress: one redrawing line on a terminal, a line per ~10 % elsewhere."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._phase, self._tenth = None, -1

    def show(self, p: dict) -> None:
        tenth = 10 * p["done"] // p["total"] if p["total"] else 0
        line = f"k3d: {describe(p)}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if p["done"] >= p["total"] else ""))
        elif p["phase"] != self._phase or tenth > self._tenth:
            self.stream.write(line + "\n")
        self._phase, self._tenth = p["phase"], tenth
        self.stream.flush()


class StartupResponder:
    """Owns the endpoint's socket until ``hand_over``; answers as described above."""

    def __init__(self, sock: zmq.Socket, endpoint: str, progress: Progress):
        self.sock, self.endpoint, self.progress = sock, endpoint, progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3d-starting", daemon=True)
        self._thread.start()

    def status(self) -> dict:
        p = self.progress.snapshot()
        return {"state": "starting", "version": __version__, "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                "endpoint": self.endpoint, **p}

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(POLL_MS):
                continue
            try:
                routing, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            self._answer(routing, frames)

    def _answer(self, routing: bytes, frames) -> None:
        try:
            msg = unpack(frames[0]) if len(frames) == 1 and len(frames[0]) <= MAX_MESSAGE_BYTES else None
        except Exception:   # garbage: the server would answer bad_request; here it is not worth a reply
            return
        if not isinstance(msg, dict) or msg.get("op") == "heartbeat":
            return
        rid = msg.get("id") if type(msg.get("id")) is int else None
        if msg.get("op") == "status":
            reply = {"id": rid, "ok": True, "gen": 0, "status": self.status()}
        else:
            reply = {"id": rid, "ok": False, "gen": 0, "error": {
                "code": "starting",
                "message": f"k3d at {self.endpoint} is starting ({describe(self.progress.snapshot())}); "
                           "retry when it is ready, or connect(wait=SECONDS)"}}
        try:
            self.sock.send_multipart([routing, pack(reply)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass     # the peer left

    def hand_over(self) -> zmq.Socket:
        """Stop answering; the caller (the server loop) owns the socket from here."""
        self._stop.set()
        self._thread.join()
        return self.sock
