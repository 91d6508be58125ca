"""Why the store refuses a fetch or a repin: the checks, and the one line a person acts on.

The store (``k3d.cache.store``) runs these before it changes anything, so that a
refused fetch changes nothing (its invariant); they read what they are given and
change nothing themselves.  ``room`` returns the refusal (None: the fetch fits)
for the store to count and raise; the quota checks raise.

- ``SlotsBusy``: enough slots would do, but some still wait until other clients'
  views of them end (deferred reuse, ``k3d.cache.reuse``): the client retries.
- ``CacheFull``: not even the waiting slots would do: pins hold the rest.
- ``QuotaExceeded``: the client would pin more slots in one token than the pin
  quota allows (claims of late reports counting toward it).

Thread: the server thread, as the store.
"""

from __future__ import annotations

from k3client.errors import CacheFull, QuotaExceeded, SlotsBusy


def room(need: int, free: int, evictable: int, reuse, policy, slots: int) -> SlotsBusy | CacheFull | None:
    """A fetch needs ``need`` new slots; ``free`` are free and ``evictable`` could be
    evicted (unpinned, not loading, not the fetch's own).  Evicted slots are usable now
    only when ``reuse`` (``Reuse``) says no client is reading; ``policy`` words
    ``CacheFull`` (how many slots are pinned) of ``slots``."""
    available = free + (evictable if reuse.could_reuse_now() else 0)
    if need <= available:
        return None
    if need <= free + evictable + reuse.coming():
        return SlotsBusy(
            f"this fetch needs {need} new slots; {free} are free and "
            f"{len(reuse.limbo)} wait until other clients' views of them end; retry")
    return CacheFull(
        f"cache full: {policy.pinned_count()} of {slots} slots pinned, "
        f"{len(reuse.limbo)} waiting for reuse; "
        f"this fetch needs {need} new slots and only {available} can be freed; "
        "call begin_token() to release earlier pins, fetch fewer experts, "
        "or start k3d with a larger --arena")


def fetch_quota(after: int, quota: int) -> None:
    """Raise when a fetch would leave its client pinning ``after`` slots, over ``quota``."""
    if after > quota:
        raise QuotaExceeded(
            f"pin quota exceeded: this fetch would pin {after} slots, the quota is {quota} per client "
            "per token; call begin_token() more often or fetch fewer experts")


def repin_quota(after: int, quota: int) -> None:
    """As ``fetch_quota``, for a fetch answered after its client began a new token."""
    if after > quota:
        raise QuotaExceeded(
            f"pin quota exceeded: this fetch, answered after begin_token, would pin {after} slots "
            f"in the new token, the quota is {quota} per client per token; fetch it again")
