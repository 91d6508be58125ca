"""One rule for the views a family's math reads from a fetched expert.

The only place an expert's views are made (an adapter that shards them, e.g. one
tensor-parallel rank's rows of gate/up and columns of down, slices them here):

- gated families (``families.Standard``): a tuple, ``(gate_up, down)`` where one view
  covers both halves (a fused tensor on disk, or gate and up back to back in the slot,
  ``Layer.fused``: ``Expert.stacked``), else ``(gate, up, down)``;
- gpt-oss: ``{name: view}`` of the layer's layout names (bf16, or MXFP4 blocks/scales);
- a tensor-parallel rank's shard (``Layer.shard``): the same kinds, sliced (still views).

Every view is zero-copy and cached per slot by the client; read only between the fetch
that answered it and the next ``begin_token`` (the pin rule, ``epochs``).  Any thread
that owns the client.
"""

from __future__ import annotations

from .families import GptOss


def views(ml, ex):
    """The views of ``ex`` (a fetched ``Expert``) for ``ml``'s family (module docstring); on a
    tensor-parallel rank (``Layer.shard``) its shard of them, cached per slot like the views."""
    if ml.shard is None:
        return whole(ml, ex)
    cache, key = ex._at.views, ("shard", *ex._key(""))
    v = cache.get(key)
    if v is None:
        v = cache[key] = ml.shard.of(whole(ml, ex))
    else:
        ex._mapping()                  # a cached slice: only while its mapping is the live one
    return v


def whole(ml, ex):
    """The whole expert's views (module docstring)."""
    f = ml.family
    if isinstance(f, GptOss):
        return {n: ex.tensor(n) for n in ml.names}
    if f.gate_up is not None:
        return ex.tensor(f.gate_up), ex.tensor(f.down)
    if ml.fused:
        both = ex.stacked((f.gate, f.up))      # cached per slot, like every view
        if both is not None:
            return both, ex.tensor(f.down)
    return ex.tensor(f.gate), ex.tensor(f.up), ex.tensor(f.down)
