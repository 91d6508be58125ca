"""Warm restart: the policy's statistics survive a restart; the hot set is pre-loaded.

File: ``<state_dir>/state-<id>.json``, ``id`` the start of the checkpoint's
``FINGERPRINT`` (below): one file per checkpoint, whatever endpoint serves it, so
restarting on a new endpoint finds the statistics and adds no file.  Daemons of one
checkpoint that share a state directory share its file (the last save wins; each
save is whole)::

    {"format": "k3d-policy-state", "version": 1, "model": FINGERPRINT, "policy": NAME,
     "source": PATH_OR_URL, "saved_unix": T,
     "hot": [[layer, expert], ...],                       # hottest first
     "policy_state": {...},                               # the policy's own export()
     "predictor_state": {...}}                            # the daemon's predictor's state(), if any

``FINGERPRINT`` names the checkpoint and its layout (source kind, path, keys, layout
names and sizes): a file written for another checkpoint or layout is *foreign*.

Writes are atomic (a temporary file in the same directory, fsynced, renamed over
the old one): a crash leaves the old file or the new one, never half of one.  The
server thread calls ``save`` at shutdown and every ``state_every_s`` seconds.

Each file names its checkpoint (``"source"``: the absolute path, or the URL, the
daemon was given).  At start the daemon logs where its file is and how to turn it
off, and ``prune`` deletes the state files of checkpoints that are gone (a local
``source`` path that no longer exists) and temporary files a crash left over an
hour ago.  It never deletes the file of a checkpoint that still exists, whichever
daemon wrote it, nor one it cannot judge (a URL, a file written before ``source``
was recorded, an unreadable file): those are the user's to delete.  The bound:
one file per checkpoint (path and layout) served with this directory whose path
still exists, each about 100 bytes per hot expert (a few MB for the largest models).

On start ``load`` returns the saved state, or None with one log line when the file
is missing, unreadable, corrupt, of another format or version, or foreign: a bad
state file never stops a start.  ``Warmup`` then queues BACKGROUND reads of the
hottest keys into free slots (behind every client's urgent read, never evicting)
and reports its progress for status.

With ``--predict auto`` the predictor's counts are kept too (``adopt``): a
restarted daemon predicts from its first token.

Owned by the server thread; no locking.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

from k3d import statefile

log = logging.getLogger("k3d")

FORMAT, VERSION = "k3d-policy-state", 1


STALE_TMP_S = 3600       # a temporary file older than this is a crashed save's, not one in flight


def state_path(state_dir: str, source_print: str) -> str:
    """The state file of the checkpoint whose ``fingerprint`` is ``source_print``."""
    return os.path.join(state_dir, f"state-{source_print[:16]}.json")


def source_of(spec: str) -> str:
    """What a state file records as its checkpoint: a local path made absolute (another
    daemon may run elsewhere), a URL as given."""
    return spec if "://" in spec else os.path.abspath(spec)


def checkpoint_gone(path: str) -> bool:
    """Whether the state file at ``path`` belongs to a checkpoint that no longer exists:
    only a recorded local path that is missing says so (anything else: not gone)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False                      # unreadable or mid-rename: not ours to judge
    src = doc.get("source") if isinstance(doc, dict) else None
    if not isinstance(src, str) or "://" in src or not os.path.isabs(src):
        return False
    return not os.path.lexists(src)


def prune(state_dir: str, own: str, now: float | None = None) -> list[tuple[str, str]]:
    """Delete the state files of checkpoints that are gone (never ``own``) and stale
    temporary files; returns ``(path, why)`` for each deleted.  OSError is the caller's to log."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(state_dir)
    except FileNotFoundError:
        return []
    gone = []
    for name in names:
        path = os.path.join(state_dir, name)
        if name.startswith("state-") and name.endswith(".json"):
            if path != own and checkpoint_gone(path):
                gone.append((path, "its checkpoint is gone"))
        elif name.startswith(".state-") and name.endswith(".tmp"):
            try:
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:     # another daemon's rename got there first
                continue
            if now - mtime > STALE_TMP_S:
                gone.append((path, "a crashed save's temporary file"))
    for path, _ in gone:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return gone


def fingerprint(source) -> str:
    """What makes saved keys mean the same experts: checkpoint, keys and layout."""
    desc = source.describe()
    layout = [(t.name, t.nbytes) for t in source.layout]
    text = json.dumps([desc.get("kind"), desc.get("path"), sorted(source.keys), layout], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def save(path: str, source_print: str, policy_name: str, hot: list, policy_state: dict,
         predictor_state: dict | None = None, source: str | None = None) -> None:
    """Write the state atomically (tmp + fsync + rename); OSError is the caller's to log.
    ``source``: the checkpoint (``source_of``), by which ``prune`` tells whether it is gone."""
    doc = {"format": FORMAT, "version": VERSION, "model": source_print, "policy": policy_name,
           "source": source, "saved_unix": round(time.time(), 3), "hot": [list(k) for k in hot],
           "policy_state": policy_state}
    if predictor_state is not None:
        doc["predictor_state"] = predictor_state
    statefile.write_json(path, doc, prefix=".state-", durable=True)


def load(path: str, source_print: str, known_keys) -> dict | None:
    """The saved state if it is ours and sound; else None, with one log line saying why."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        log.info("warm restart: no state file %s; starting cold", path)
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        log.warning("warm restart: ignoring unreadable or corrupt state file %s (%s); starting cold", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        log.warning("warm restart: ignoring %s: not a k3d policy state of version %d; starting cold", path, VERSION)
        return None
    if doc.get("model") != source_print:
        log.warning("warm restart: ignoring %s: written for another checkpoint or layout; starting cold", path)
        return None
    hot = doc.get("hot")
    try:
        keys = [(int(l), int(e)) for l, e in hot]
    except (TypeError, ValueError):
        log.warning("warm restart: ignoring %s: its hot set is malformed; starting cold", path)
        return None
    doc["hot"] = [k for k in keys if k in known_keys]
    if not isinstance(doc.get("policy_state"), dict):
        doc["policy_state"] = {}
    return doc


class Warmup:
    """Pre-loading of the saved hot set; ``planned`` (slot, key) pairs, progress on demand."""

    def __init__(self, planned: list[tuple[int, tuple]], saved: int):
        self.planned = planned
        self.saved = saved

    def progress(self, store) -> dict:
        ready = loading = 0
        for s, key in self.planned:
            if store.slot_key[s] == key:
                if s in store.loads:
                    loading += 1
                else:
                    ready += 1
        done = len(self.planned) - loading
        return {"saved": self.saved, "planned": len(self.planned), "ready": ready, "loading": loading,
                "done": loading == 0, "percent": round(100 * done / len(self.planned), 1) if self.planned else 100.0}


class WarmState:
    """The server's handle: restore at start, pre-load plan, periodic and final saves.

    ``state_dir == ""`` turns it all off.  Every failure is a log line, never an
    exception out of here (a full disk must not stop a serving daemon)."""

    def __init__(self, cfg, source, store, now: float):
        self.enabled = bool(cfg.state_dir)
        self.print = fingerprint(source) if self.enabled else ""
        self.path = state_path(cfg.state_dir, self.print) if self.enabled else ""
        self.source = source_of(source.path)
        self.every = cfg.state_every_s
        self.next_save = now + self.every
        self.policy_name = cfg.policy
        self.share = cfg.warm_slots
        if self.enabled:
            log.info("warm restart: statistics of this checkpoint in %s (--state-dir none turns this off)",
                     self.path)
            try:
                for path, why in prune(cfg.state_dir, self.path):
                    log.info("warm restart: removed %s (%s)", path, why)
            except OSError as e:
                log.warning("warm restart: cannot prune %s: %s", cfg.state_dir, e)
        self.warmup: Warmup | None = None
        self.predictor = None                 # the daemon's predictor (adopt), saved beside the policy
        self._doc = load(self.path, self.print, source.keys) if self.enabled else None
        if self._doc is not None and self._doc.get("policy") == cfg.policy:
            try:
                store.policy.restore(self._doc["policy_state"])
            except ValueError as e:
                log.warning("warm restart: ignoring the saved %s statistics in %s: %s", cfg.policy, self.path, e)

    def adopt(self, predictor) -> None:
        """Save ``predictor``'s state from now on, and restore the saved one (before ``preload``)."""
        self.predictor = predictor
        saved = self._doc.get("predictor_state") if self._doc is not None else None
        if isinstance(saved, dict):
            try:
                predictor.restore(saved)
            except ValueError as e:
                log.warning("warm restart: ignoring the saved predictor state in %s: %s", self.path, e)

    def preload(self, store) -> list[int]:
        """Slots to read BACKGROUND now: the saved hot set, into free slots only."""
        if self._doc is None:
            return []
        hot = self._doc["hot"][:int(self.share * store.slots)]
        slots = store.preload(hot)
        self.warmup = Warmup([(s, store.slot_key[s]) for s in slots], len(self._doc["hot"]))
        log.info("warm restart: pre-loading %d of %d saved hot experts from %s in the background",
                 len(slots), len(self._doc["hot"]), self.path)
        self._doc = None
        return slots

    def tick(self, store, now: float) -> None:
        if self.enabled and now >= self.next_save:
            self.next_save = now + self.every
            self.save(store)

    def save(self, store) -> None:
        if not self.enabled:
            return
        try:
            save(self.path, self.print, self.policy_name, store.ranking()[:store.slots], store.policy.export(),
                 None if self.predictor is None else self.predictor.state(), self.source)
        except OSError as e:
            log.error("warm restart: cannot write %s: %s", self.path, e)

    def status(self, store) -> dict:
        d = {"state_file": self.path or None}
        if self.warmup is not None:
            d.update(self.warmup.progress(store))
        return d
