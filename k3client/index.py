"""The shared index: where each expert lies in the arena, read by clients without a message.

Memory layout (one sealed memfd the daemon writes and every client maps
PROT_READ; all words little-endian uint64, 8-byte aligned)::

    header  [0] MAGIC   [1] VERSION   [2] layers   [3] width (experts per layer row)
            [4] retired (count of unpublished entries, ever; clients read it only as
                a hint: while it is unchanged no entry was cleared, ``LocalHits.layer_resident``)
            [5] closed (1: the daemon stopped)
            [6..7] reserved
    entry of key (l, e), at word 8 + 2 * (l * width + e):
            [0] seq     even: stable; odd: the daemon is changing this entry
            [1] word    0: not resident; else slot << 2 | state (LOADING 1, READY 2)

Writer (the daemon's server thread, ``k3d.memory.index``): to change an entry it
stores ``seq + 1`` (odd), then ``word``, then ``seq + 2`` (even); to unpublish
it clears ``word`` that way, then stores ``retired + 1``.

Reader (``lookup``): per entry, loads ``seq``, ``word``, ``seq``; an entry whose
two seqs differ or are odd is "unknown" (asked of the daemon, never guessed).

What it relies on, and why a torn or stale read cannot yield another key's bytes:
- x86-64 (TSO): stores become visible to other cores in program order, loads are
  not reordered with older loads, and aligned 8-byte accesses are atomic.  So a
  reader that sees the same even ``seq`` before and after its ``word`` load saw a
  ``word`` the writer stored whole, between two of its changes (the seqlock).
  Python emits no fences and promises no order; but each item read of the
  memoryview is a separate C load, made in program order, and the CPU keeps load
  order.  On other
  architectures (aarch64 reorders loads) this does not hold without barriers, so
  ``supported()`` is False there and clients ask the daemon for every fetch.
- An entry only ever names a slot for its own key: a stale entry (one the daemon
  has since cleared) names a slot that held this key.  The daemon does not
  reuse a cleared slot until no client can still read it (``k3d.cache.reuse``):
  that is what keeps a stale read from meaning another key's bytes.
- A message through the kernel orders: every store the daemon made before it sent
  a reply is visible to the client's loads after it received that reply (the
  socket path takes locks, full barriers on x86-64).  Reclamation relies on it.

Thread: an ``IndexReader`` belongs to its client's thread.
"""

from __future__ import annotations

import mmap
import platform

MAGIC = 0x6B3364_696E6478     # "k3d" "indx"
VERSION = 1
HEADER_WORDS = 8
RETIRED = 4                   # header word: entries unpublished so far
CLOSED = 5                    # header word: 1 once the daemon has stopped serving
LOADING, READY = 1, 2


def supported() -> tuple[bool, str]:
    """(whether this CPU gives the ordering the lock-free read needs, why not)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return True, ""
    return False, f"{machine} may reorder loads; numpy emits no barriers"


def index_bytes(layers: int, width: int) -> int:
    words = HEADER_WORDS + 2 * layers * width
    return -(-words * 8 // 4096) * 4096


class IndexReader:
    """Read-only view of the daemon's index.

    Reads go through a memoryview of 8-byte words: each item read is one aligned
    8-byte load, in program order (no numpy on the hit path: for the handful of
    keys of one fetch its per-call overhead is most of the cost)."""

    def __init__(self, fd: int, size: int):
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        words = memoryview(self._mm).cast("Q")
        if words[0] != MAGIC or words[1] != VERSION:
            words.release()
            raise ValueError(f"not a k3d index of version {VERSION}")
        self._words = words
        self.layers, self.width = words[2], words[3]

    def retired(self) -> int:
        """How many entries the daemon has unpublished so far (it counts each after clearing it)."""
        return self._words[RETIRED]

    def closed(self) -> bool:
        """The daemon stopped (a killed one cannot say so: the client's pidfd tells)."""
        return bool(self._words[CLOSED])

    def lookup(self, layer: int, experts) -> list[int]:
        """Per expert of ``layer``: its slot << 2 | state, 0 when not resident, -1 when
        unknown (being changed, or outside the index): ask the daemon."""
        w, width = self._words, self.width
        if not 0 <= layer < self.layers:
            return [-1] * len(experts)
        base = HEADER_WORDS + 2 * layer * width
        out = []
        for e in experts:
            if not 0 <= e < width:
                out.append(-1)
                continue
            i = base + 2 * e
            s1 = w[i]                    # seq, word, seq: three loads in this order
            word = w[i + 1]
            out.append(word if s1 == w[i] and not s1 & 1 else -1)
        return out

    def ready_slots(self, layer: int, experts) -> list[int] | None:
        """The slots of ``experts`` of ``layer`` if every one is READY, else None (any not
        resident, being read, being changed, or outside the index): ``lookup``'s loads,
        in its order, stopping at the first entry that is not, with no list of words
        built (every fetch a client answers itself runs this)."""
        w, width = self._words, self.width
        if w is None or w[CLOSED] or not 0 <= layer < self.layers:
            return None
        base = HEADER_WORDS + 2 * layer * width
        slots = []
        for e in experts:
            if not 0 <= e < width:
                return None
            i = base + 2 * e
            s1 = w[i]                    # seq, word, seq: three loads in this order
            word = w[i + 1]
            if s1 != w[i] or s1 & 1 or word & 3 != READY:
                return None
            slots.append(word >> 2)
        return slots

    @property
    def closed_here(self) -> bool:
        """This reader was closed (its client detached)."""
        return self._words is None

    def close(self) -> None:
        if self._words is not None:
            self._words.release()
            self._words = None
        try:
            self._mm.close()
        except BufferError:
            pass
