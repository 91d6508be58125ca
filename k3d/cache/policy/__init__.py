"""Cache policies: pure, deterministic choosers of eviction victims (see ``base``).

``POLICIES`` maps the names ``k3d start --policy`` and ``k3d replay --policy``
accept to their classes; ``make`` builds one by name.  The default is
``k3d.config.Config.policy``.
"""

from k3d.cache.policy.base import PinTable
from k3d.cache.policy.cycle import CyclePolicy
from k3d.cache.policy.lru import LruPolicy
from k3d.config import POLICY_NAMES

POLICIES = {"cycle": CyclePolicy, "lru": LruPolicy}
if sorted(POLICIES) != sorted(POLICY_NAMES):
    raise ImportError(f"k3d.config.POLICY_NAMES {POLICY_NAMES} and POLICIES {sorted(POLICIES)} disagree")


class UnknownPolicy(ValueError):
    pass


def make(name: str, layers: int = 0):
    """A fresh policy called ``name``; UnknownPolicy lists the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    return cls(layers=layers)


__all__ = ["POLICIES", "CyclePolicy", "LruPolicy", "PinTable", "UnknownPolicy", "make"]
