"""Model families: which tensors of a checkpoint are routed experts, and how expert (layer, e) is cut out.

Pure (no I/O): the safetensors source, the remote sources (through the same
parser on a header image) and ``k3d inspect`` call it with what they read.

A family is recognised from ``config.json`` (``model_type``; the expert count and
``num_experts_per_tok``, also under ``text_config`` / ``ffn_config``), else from
the tensor names; ``--pattern`` overrides both.  One table, ``FAMILIES``, maps
each transformers ``model_type`` to a storage rule in ``RULES``.  The family name
reported (``model.family``) is that ``model_type`` (``llama4_text`` and
``qwen3_5_moe_text`` fold into ``llama4`` / ``qwen3_5_moe``); a checkpoint matched
by its names alone reports the rule's id.  Rule ids and layout names are stable
(``k3client.hf`` keys on them)::

    rule id                        tensors (ROOT = model. | model.language_model. | language_model.model.)
    experts.mlp                    ROOT layers.{L}.mlp.experts.{E}.{name}              per expert
    experts.block_sparse_moe       ROOT layers.{L}.block_sparse_moe.experts.{E}.{name} per expert
    experts.feed_forward           ROOT layers.{L}.feed_forward.experts.{E}.{name}     per expert
    experts.ffn                    ROOT layers.{L}.ffn.experts.{E}.{name}              per expert
    stacked.mlp                    ROOT layers.{L}.mlp.experts.{gate_up_proj|down_proj...}    [E, ...]
    stacked.feed_forward           ROOT layers.{L}.feed_forward.experts.{gate_up_proj|...}    [E, ...]
    stacked.block_sparse_moe       ROOT layers.{L}.block_sparse_moe.{input|output}_linear.weight [E, ...]
    stacked.mlp_linear             ROOT layers.{L}.mlp.{input|output}_linear.weight   [E, ...]
    stacked.dbrx                   transformer.blocks.{L}.ffn.experts.mlp.{w1|v1|w2}   [E*I, H]

Stacked tensors hold the expert index outermost, so expert e of one is the
contiguous slice [e]: ``nbytes / E`` bytes at ``begin + e * nbytes / E``, read
straight into the slot.  Its layout name is what follows the experts prefix
(``gate_up_proj``, ``down_proj_blocks``, ``input_linear.weight``); its shape is
the per-expert shape (``shape[1:]``; DBRX's 2-D ``[E*I, H]`` gives ``[I, H]``).

Only routed experts are served: shared experts, routers, ``e_score_correction_bias``
and dense layers match no rule.  A layer's experts must all have that layer's
tensors; layers may differ (mixed precision), see ``k3d.sources.base``.

Errors (``FamilyError``, a SourceError subclass, one line naming tensor and
numbers): a stacked tensor whose first dimension is not the expert count (for
DBRX: does not divide by it); a config.json whose model_type or expert count
disagrees with the tensors; two rules matching one checkpoint; nothing matching
(the message lists the first tensor names and a suggested ``--pattern``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from .base import SourceError

_ROOT = r"(?:model\.|model\.language_model\.|language_model\.model\.)layers\.(?P<layer>\d+)\."
_STACKED_NAME = r"(?P<name>(?:gate_up_proj|gate_proj|up_proj|down_proj)(?:_[a-z0-9_]+)?)"


class FamilyError(SourceError):
    """The checkpoint's family cannot be settled, or its tensors contradict it."""


@dataclass(frozen=True)
class Rule:
    """How one storage layout names its expert tensors."""

    id: str
    template: str           # human form, as a --pattern would spell it
    regex: re.Pattern       # groups: layer, name, and expert for per-expert rules
    stacked: bool
    flat: bool = False      # DBRX: [E*I, H], expert e = rows [e*I, (e+1)*I)


def _rule(id_, template, rx, stacked=False, flat=False) -> Rule:
    return Rule(id_, template, re.compile(rx + r"\Z"), stacked, flat)


RULES: dict[str, Rule] = {r.id: r for r in (
    _rule("experts.mlp", "model.layers.{layer}.mlp.experts.{expert}.{name}",
          _ROOT + r"mlp\.experts\.(?P<expert>\d+)\.(?P<name>.+)"),
    _rule("experts.block_sparse_moe", "model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}",
          _ROOT + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<name>.+)"),
    _rule("experts.feed_forward", "model.layers.{layer}.feed_forward.experts.{expert}.{name}",
          _ROOT + r"feed_forward\.experts\.(?P<expert>\d+)\.(?P<name>.+)"),
    _rule("experts.ffn", "model.layers.{layer}.ffn.experts.{expert}.{name}",
          _ROOT + r"ffn\.experts\.(?P<expert>\d+)\.(?P<name>.+)"),
    _rule("stacked.mlp", "model.layers.{layer}.mlp.experts.{name} [E, ...]",
          _ROOT + r"mlp\.experts\." + _STACKED_NAME, stacked=True),
    _rule("stacked.feed_forward", "model.layers.{layer}.feed_forward.experts.{name} [E, ...]",
          _ROOT + r"feed_forward\.experts\." + _STACKED_NAME, stacked=True),
    _rule("stacked.block_sparse_moe", "model.layers.{layer}.block_sparse_moe.{input,output}_linear.weight [E, ...]",
          _ROOT + r"block_sparse_moe\.(?P<name>(?:input|output)_linear\.weight)", stacked=True),
    _rule("stacked.mlp_linear", "model.layers.{layer}.mlp.{input,output}_linear.weight [E, ...]",
          _ROOT + r"mlp\.(?P<name>(?:input|output)_linear\.weight)", stacked=True),
    _rule("stacked.dbrx", "transformer.blocks.{layer}.ffn.experts.mlp.{w1,v1,w2} [E*I, H]",
          r"transformer\.blocks\.(?P<layer>\d+)\.ffn\.experts\.mlp\.(?P<name>w1|v1|w2)", stacked=True, flat=True),
)}

# transformers model_type -> rule id.  Each was checked against transformers 5.24's
# save_pretrained output (tests/integration/test_families.py writes every one).
FAMILIES: dict[str, str] = {
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "olmoe", "flex_olmo",
                     "deepseek_v2", "deepseek_v3", "glm4_moe", "dots1", "ernie4_5_moe", "hunyuan_v1_moe",
                     "afmoe", "exaone_moe", "cohere2_moe"), "experts.mlp"),
    **dict.fromkeys(("mixtral", "phimoe", "minimax", "minimax_m2"), "experts.block_sparse_moe"),
    **dict.fromkeys(("jamba", "lfm2_moe"), "experts.feed_forward"),
    "deepseek_v4": "experts.ffn",
    **dict.fromkeys(("gpt_oss", "qwen3_vl_moe"), "stacked.mlp"),
    "llama4": "stacked.feed_forward",
    **dict.fromkeys(("granitemoe", "granitemoeshared"), "stacked.block_sparse_moe"),
    "jetmoe": "stacked.mlp_linear",
    "dbrx": "stacked.dbrx",
}
_ALIASES = {"llama4_text": "llama4", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_vl_moe_text": "qwen3_vl_moe"}
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "moe_top_k")


@dataclass(frozen=True)
class ModelConfig:
    """What config.json says about the experts (None where it says nothing)."""

    model_type: str | None
    experts: int | None
    top_k: int | None
    experts_key: str | None = None


def _lookup(cfg: dict, keys) -> tuple[int | None, str | None]:
    for where in (cfg, cfg.get("text_config"), cfg.get("ffn_config")):
        if not isinstance(where, dict):
            continue
        prefix = "" if where is cfg else ("text_config." if where is cfg.get("text_config") else "ffn_config.")
        for k in keys:
            v = where.get(k)
            if isinstance(v, list) and v and all(type(x) is int for x in v):
                v = max(v)                      # per-layer values (HunYuan's moe_topk)
            if type(v) is int and v > 0:
                return v, prefix + k
    return None, None


def read_config(cfg) -> ModelConfig:
    """The model type, expert count and top-k of a parsed config.json (anything else: all None)."""
    if not isinstance(cfg, dict):
        return ModelConfig(None, None, None)
    mt = cfg.get("model_type")
    mt = _ALIASES.get(mt, mt) if isinstance(mt, str) else None
    experts, key = _lookup(cfg, _EXPERT_KEYS)
    top_k, _ = _lookup(cfg, _TOPK_KEYS)
    return ModelConfig(mt, experts, top_k, key)


@dataclass(frozen=True)
class Family:
    """The settled family of one checkpoint."""

    name: str               # model_type, or the rule id when matched by names, or "pattern"
    rule: Rule
    how: str                # "config.json model_type 'mixtral'", "tensor names", "--pattern"
    experts: int | None     # from config.json
    top_k: int | None


def pattern_rule(pattern: str) -> Rule:
    """A per-expert rule from a user's ``--pattern`` (``{layer}``, ``{expert}``, ``{name}`` once each)."""
    for field in ("{layer}", "{expert}", "{name}"):
        if pattern.count(field) != 1:
            raise SourceError(f"pattern {pattern!r} must contain {field} exactly once")
    rx = re.escape(pattern)
    rx = rx.replace(re.escape("{layer}"), r"(?P<layer>\d+)")
    rx = rx.replace(re.escape("{expert}"), r"(?P<expert>\d+)")
    rx = rx.replace(re.escape("{name}"), r"(?P<name>.+)")
    return Rule("pattern", pattern, re.compile(rx + r"\Z"), False)


def _matching(names) -> dict[str, list[str]]:
    """rule id -> the tensor names it matches (rules matching nothing left out)."""
    hits: dict[str, list[str]] = {}
    for n in names:
        for r in RULES.values():
            if r.regex.match(n):
                hits.setdefault(r.id, []).append(n)
    return hits


def settle(where: str, config, names, pattern: str | None = None) -> Family:
    """The family of a checkpoint: ``--pattern`` if given, else config.json's model_type, else the names."""
    mc = read_config(config)
    if pattern:
        return Family("pattern", pattern_rule(pattern), f"--pattern {pattern}", mc.experts, mc.top_k)
    names = list(names)
    hits = _matching(names)
    if mc.model_type in FAMILIES:
        rule = RULES[FAMILIES[mc.model_type]]
        if rule.id not in hits:
            other = next(iter(sorted(hits)), None)
            found = (f"; its tensors match rule {other} ({hits[other][0]!r}): fix config.json or pass --pattern"
                     if other else "; " + no_match_hint(names))
            raise FamilyError(f"{where}: config.json says model_type {mc.model_type!r} (expert tensors "
                              f"{rule.template}), but no tensor is named so{found}")
        return Family(mc.model_type, rule, f"config.json model_type {mc.model_type!r}", mc.experts, mc.top_k)
    if len(hits) > 1:
        a, b = sorted(hits)[:2]
        raise FamilyError(f"{where}: two families match this checkpoint: {a} ({hits[a][0]!r}) and {b} "
                          f"({hits[b][0]!r}); pass --pattern to choose, or add config.json")
    if not hits:
        why = f"config.json model_type {mc.model_type!r} is not a known MoE family and n" if mc.model_type else "N"
        raise FamilyError(f"{where}: {why}o tensor matches a known expert layout; {no_match_hint(names)}")
    (rid,) = hits
    return Family(rid, RULES[rid], "tensor names", mc.experts, mc.top_k)


# -- cutting experts out of the tensors ------------------------------------------------------
# A tensor as the sources describe it: (dtype, shape, file index, absolute offset, nbytes).
# A piece of an expert: (dtype, per-expert shape, file index, offset, nbytes, source tensor name).


def expert_pieces(where: str, fam: Family, tensors: dict, itemsize, files=None,
                  dup_hint: str = "") -> dict[tuple[int, int], dict[str, tuple]]:
    """{(layer, expert): {layout name: piece}} for every routed expert of the checkpoint.

    ``tensors``: name -> (dtype, shape, file, offset, nbytes), or such (name, tensor) pairs (a
    name twice: two copies, refused if it is an expert tensor); ``itemsize(dtype)`` gives bytes
    per element; ``files`` (names by file index) and ``dup_hint`` word the error for two
    tensors taken as one.  Raises FamilyError on a stacked tensor that is not [E, ...] (DBRX: whose
    rows do not divide by E), or on a layer whose experts disagree with config.json's count."""
    def named(tname, fi):
        return f"{tname!r} ({files[fi]})" if files else repr(tname)

    rule = fam.rule
    experts: dict[tuple[int, int], dict[str, tuple]] = {}
    by_layer: dict[int, dict[str, tuple]] = {}
    for tname, t in (tensors.items() if isinstance(tensors, dict) else tensors):
        m = rule.regex.match(tname)
        if not m:
            continue
        layer, name = int(m["layer"]), m["name"]
        if rule.stacked:
            per = by_layer.setdefault(layer, {})
            if name in per:
                raise FamilyError(f"{where}: tensors {named(per[name][0], per[name][1][2])} and "
                                  f"{named(tname, t[2])} are both layer {layer}'s {name!r}; remove one{dup_hint}")
            per[name] = (tname, t)
            continue
        key = (layer, int(m["expert"]))
        have = experts.setdefault(key, {})
        if name in have:
            raise FamilyError(f"{where}: tensors {named(have[name][5], have[name][2])} and {named(tname, t[2])} "
                              f"are both tensor {name!r} of expert (layer {key[0]}, expert {key[1]}); "
                              f"remove one{dup_hint}")
        dtype, shape, fi, off, nbytes = t
        have[name] = (dtype, tuple(shape), fi, off, nbytes, tname)
    if rule.stacked:
        count = fam.experts or _stacked_count(where, rule, by_layer)
        for layer, per in by_layer.items():
            for name, (tname, t) in per.items():
                for e, piece in enumerate(_slices(where, rule, tname, t, count, fam.experts is not None, itemsize)):
                    experts.setdefault((layer, e), {})[name] = piece
    elif fam.experts is not None:
        _check_count(where, fam, experts)
    return experts


def _stacked_count(where: str, rule: Rule, by_layer) -> int:
    """Without config.json, the expert count is the stacked tensors' first dimension (all must agree)."""
    if rule.flat:
        tname = next(t for per in by_layer.values() for t, _ in per.values())
        raise FamilyError(f"{where}: {tname!r} stacks experts as [E*I, H]; the expert count E comes from "
                          "config.json (ffn_config.moe_num_experts), which is missing")
    firsts: dict[int, str] = {}
    for per in by_layer.values():
        for tname, t in per.values():
            if not t[1]:
                raise FamilyError(f"{where}: stacked expert tensor {tname!r} is a scalar, not [E, ...]")
            firsts.setdefault(t[1][0], tname)
    if len(firsts) > 1:
        (a, ta), (b, tb) = sorted(firsts.items())[:2]
        raise FamilyError(f"{where}: stacked expert tensors disagree on the expert count: {ta!r} has first "
                          f"dimension {a}, {tb!r} has {b}")
    return next(iter(firsts))


def _slices(where, rule, tname, t, count, from_config, itemsize):
    dtype, shape, fi, off, nbytes = t
    said = " config.json's" if from_config else ""
    if rule.flat:
        if len(shape) != 2 or shape[0] % count:
            raise FamilyError(f"{where}: tensor {tname!r} is {list(shape)}: its first dimension does not divide "
                              f"by the{said} {count} experts (expected 2-D [E*I, H])")
        inner = (shape[0] // count,) + tuple(shape[1:])
    else:
        if not shape or shape[0] != count:
            raise FamilyError(f"{where}: stacked expert tensor {tname!r} is {list(shape)}: its first dimension "
                              f"is not the{said} {count} experts")
        inner = tuple(shape[1:])
    size = math.prod(inner) * itemsize(dtype)
    if size * count != nbytes:          # the parsers checked nbytes against the shape already
        raise FamilyError(f"{where}: tensor {tname!r} spans {nbytes} bytes, not {count} x {size}")
    return [(dtype, inner, fi, off + e * size, size, tname) for e in range(count)]


def _check_count(where: str, fam: Family, experts) -> None:
    per_layer: dict[int, list[int]] = {}
    for layer, e in experts:
        per_layer.setdefault(layer, []).append(e)
    for layer in sorted(per_layer):
        got = sorted(per_layer[layer])
        if got != list(range(fam.experts)):
            extra = [e for e in got if e >= fam.experts]
            detail = (f"expert {extra[0]} is past the end" if extra
                      else f"it has {len(got)} experts ({got[0]}-{got[-1]})")
            raise FamilyError(f"{where}: config.json says {fam.experts} experts per layer, but in layer {layer} "
                              f"{detail}; fix config.json or the checkpoint")


# -- when nothing matches -------------------------------------------------------------------
_NUM = re.compile(r"\.(\d+)\.")


def suggest_pattern(names) -> str | None:
    """A ``--pattern`` for names like ``a.{layer}.b.{expert}.c``: the most common shape among names
    with two numeric components (the first taken as the layer, the second as the expert)."""
    votes: Counter = Counter()
    for n in names:
        nums = list(_NUM.finditer(n))
        if len(nums) < 2:
            continue
        a, b = nums[0], nums[1]
        votes[n[:a.start()] + ".{layer}." + n[a.end():b.start()] + ".{expert}.{name}"] += 1
    if not votes:
        return None
    return votes.most_common(1)[0][0]


def no_match_hint(names, first: int = 5) -> str:
    """One line: the first tensor names seen and a suggested ``--pattern``."""
    names = sorted(names)
    shown = ", ".join(names[:first]) + (f" ... ({len(names)} tensors)" if len(names) > first else "")
    guess = suggest_pattern(names)
    tip = (f"try --pattern '{guess}'" if guess
           else "pass --pattern with {layer}, {expert} and {name} "
                "(e.g. model.layers.{layer}.mlp.experts.{expert}.{name})")
    return f"first tensors: {shown or '(none)'}; {tip}"
