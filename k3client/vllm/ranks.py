"""What one rank of a multi-rank vLLM engine computes of each routed expert: its TP shard, its EP experts.

Tensor parallelism (``Shard``): vLLM splits each expert's intermediate dimension
``I`` evenly over the ``n`` ranks of its MoE group (``RoutedExperts._load_w13`` /
``_load_w2``: ``I % n == 0`` is asserted by vLLM; rank ``r`` narrows to
``[r*I/n, (r+1)*I/n)``).  Rank ``r`` holds

- the rows ``[a, b)`` of the gate and of the up projection (``[I, H]`` each; a
  fused ``gate_up [2I, H]``: rows ``[a, b)`` and ``[I+a, I+b)``);
- the columns ``[a, b)`` of the down projection ``[H, I]``: a strided view (row
  stride ``I``), which ``native.rowmm`` and torch read without a copy;
- gpt-oss (``GptOssRoutedExperts._load_unquantized_expert``/``_load_expert_bias``):
  the columns ``[2a, 2b)`` of the interleaved ``gate_up_proj [H, 2I]`` and of its
  bias (gate/up pairs stay together), the rows ``[a, b)`` of ``down_proj [I, H]``,
  and ``down_proj_bias`` on rank 0 only (vLLM loads zeros on the others, so the
  all-reduce adds it once).

Each rank's output is its partial sum; vLLM's MoE runner all-reduces it across the
group once (``_maybe_reduce_final_output``: the k3d method has no modular kernel
that reduces, so the runner does), exactly as for its own experts.

Expert parallelism (``owned``): vLLM's ``expert_map`` (global id -> local id, -1
where another rank owns the expert) decides which experts a rank computes (``Layer.mine``); the
runtime skips the pairs routed to other ranks' experts, and the all-reduce sums the
ranks' outputs.  ``expert_map`` mirrors vLLM's "linear" and "round_robin" placements
for the tests.

Pure functions of integers and (for the slicing) views; any thread.  Slicing
never copies: every result is a view of the arena view it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM 0.32's CPU worker dies (SIGSEGV) with enable_expert_parallel: a CPU engine with EP is refused
EP_CPU_REFUSAL = ("vLLM 0.32's CPU build cannot run expert parallelism (its worker crashes); "
                  "drop enable_expert_parallel (tensor parallelism alone is served)")


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of a tensor-parallel MoE group of ``size`` ranks."""

    rank: int
    size: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    def span(self, n: int) -> tuple[int, int]:
        """``[a, b)`` of this rank's share of a dimension of ``n`` (vLLM's even split)."""
        if n % self.size:
            raise ValueError(f"an intermediate size of {n} does not split over {self.size} tensor-parallel "
                             "ranks (vLLM requires a multiple)")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def of(self, views):
        """This rank's shard of one expert's views as ``k3client.runtime.views`` makes them: gpt-oss's
        dict (``gpt_oss``) or a gated family's tuple (``gated``)."""
        return self.gpt_oss(views) if isinstance(views, dict) else self.gated(views)

    def gated(self, views: tuple) -> tuple:
        """``(gate, up, down)`` of this rank from ``(gate_up, down)`` or ``(gate, up, down)``."""
        down = views[-1]
        a, b = self.span(down.shape[1])
        if len(views) == 2:
            i = down.shape[1]
            gate_up = views[0]
            return gate_up[a:b], gate_up[i + a:i + b], down[:, a:b]
        return views[0][a:b], views[1][a:b], down[:, a:b]

    def gpt_oss(self, views: dict) -> dict:
        """gpt-oss's ``{name: view}`` of this rank; no ``down_proj_bias`` off rank 0."""
        a, b = self.span(views["down_proj"].shape[0])
        out = {"gate_up_proj": views["gate_up_proj"][:, 2 * a:2 * b],
               "gate_up_proj_bias": views["gate_up_proj_bias"][2 * a:2 * b],
               "down_proj": views["down_proj"][a:b]}
        if self.rank == 0:
            out["down_proj_bias"] = views["down_proj_bias"]
        return out


def owned(emap) -> frozenset[int]:
    """The global expert ids a rank computes, from vLLM's ``expert_map`` (a sequence: -1 = elsewhere)."""
    return frozenset(g for g, local in enumerate(emap) if local >= 0)


def expert_map(num_experts: int, ep_size: int, ep_rank: int, strategy: str = "linear") -> list[int]:
    """vLLM's placement (``determine_expert_map``): rank ``r`` owns ``num_experts // ep_size``
    experts, the first ``num_experts % ep_size`` ranks one more; "linear": a run of them,
    "round_robin": every ``ep_size``-th from ``r``.  Global id -> local id, -1 elsewhere."""
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"expert-parallel rank {ep_rank} outside [0, {ep_size})")
    base, extra = divmod(num_experts, ep_size)
    if strategy == "linear":
        local = base + (ep_rank < extra)
        start = ep_rank * base + min(ep_rank, extra)
        mine = range(start, start + local)
    elif strategy == "round_robin":
        mine = range(ep_rank, num_experts, ep_size)
    else:
        raise ValueError(f"expert placement {strategy!r}: vLLM has 'linear' and 'round_robin'")
    out = [-1] * num_experts
    for local_id, g in enumerate(mine):
        out[g] = local_id
    return out


def ep_refusal(device_type: str, use_ep: bool) -> str | None:
    """The one-line refusal of an engine running EP where vLLM itself cannot (its CPU build), or None."""
    return EP_CPU_REFUSAL if use_ep and device_type == "cpu" else None
