"""Cache policies: pure, deterministic choosers of eviction victims (see ``base``).

``POLICIES`` maps the names ``k3d start --policy`` and ``k3d replay --policy``
accept to their classes; ``make`` builds one by name.  The default is
``k3d.config.Config.policy``.
"""

from .base import PinTable
from .cycle import CyclePolicy
from .lru import LruPolicy

POLICIES = {"cycle": CyclePolicy, "lru": LruPolicy}


class UnknownPolicy(ValueError):
    pass


def make(name: str, layers: int = 0):
    """A fresh policy called ``name``; UnknownPolicy lists the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))}")
    return cls(layers=layers)


__all__ = ["POLICIES", "CyclePolicy", "LruPolicy", "PinTable", "UnknownPolicy", "make"]
