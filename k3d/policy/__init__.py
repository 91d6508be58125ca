"""Cache policies: pure, deterministic choosers of eviction victims (see ``lru``)."""

from .lru import LruPolicy

__all__ = ["LruPolicy"]
