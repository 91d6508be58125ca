"""``k3ctl verify MODEL_DIR [--tokens N]``: does the daemon serve exactly this checkpoint?

The one command a user runs before trusting a deployment.  Two checks, in order:

1. **Bytes.**  Every expert ``MODEL_DIR`` holds is fetched from the daemon (a plain
   ``k3client.connect``, a few experts per token so any arena fits) and each of its
   tensors is compared, byte for byte, with the same tensor read from ``MODEL_DIR``
   in this process (``k3d.sources.open_source``: the same format and family rules
   the daemon uses, so the tensor names line up; the bytes come from this
   process's own reads of the files).  Layers run in order, experts in order, so
   the first difference named is the lowest layer's lowest expert: on a fine-tune
   of the served model (same config, other values) that is where it differs.  The
   layouts are compared first (a checkpoint of another shape is named as such).
   This needs no model class and no ``load_model``: a checkpoint the daemon does
   not serve is still compared (and named), never refused before the comparison.
2. **Logits** (when the bytes agree and ``MODEL_DIR`` is a transformers model:
   ``config.json`` and the ``hf`` extra installed): ``N`` tokens (``--tokens``,
   default 8; fixed ids from a seeded generator) run through the model twice, once
   with the experts from the daemon (``k3client.hf.load_model``) and once from the
   checkpoint directly (plain ``from_pretrained``, eager experts), in the
   checkpoint's dtype; the largest absolute logit difference is printed.  k3d's
   promise is bit-equal logits, so any difference fails (``--tolerance`` accepts
   one, e.g. across devices).  GGUF and packed files are checked by bytes only.

Exit status: 0 with one ``verified: ...`` line when both agree; 1 on a mismatch
(a ``mismatch: ...`` line naming the first layer, expert and tensor that differ,
or the logit difference); 2 when it cannot verify (no daemon, an unreadable
``MODEL_DIR``), with the reason in one line.

vLLM is not run: building a vLLM engine takes tens of seconds even for a tiny
model on CPU, and the vLLM loader reads its experts through the same client calls
the bytes check covers.

A short-lived process of its own, one thread; it holds at most a few experts'
pins at a time and closes its client before the logits run opens another.
"""

from __future__ import annotations

import os

import numpy as np

EXIT_OK, EXIT_MISMATCH, EXIT_CANNOT = 0, 1, 2


class Mismatch(Exception):
    """What differs, in one line."""


def _chunk(client) -> int:
    """Experts fetched per token: a quarter of the arena, 8 at most (any arena fits)."""
    return max(1, min(8, client.slots // 4))


def _layout_text(specs) -> str:
    return ", ".join(f"{s.name} {s.dtype}{list(s.shape)}" for s in specs)


def compare_bytes(client, source, out) -> tuple[int, int]:
    """Every expert of ``source`` against what ``client``'s daemon serves; raises Mismatch at
    the first difference.  Returns (experts, bytes) compared."""
    from k3client.errors import CacheFull, QuotaExceeded, UnknownExpert

    served = client.model
    by_layer: dict[int, list[int]] = {}
    for layer, expert in sorted(source.keys):
        by_layer.setdefault(layer, []).append(expert)
    if set(served.get("layers", [])) != set(by_layer):
        raise Mismatch(f"the daemon serves layers {served.get('layers')}, MODEL_DIR has {sorted(by_layer)}")
    if served.get("count") != len(source.keys):
        raise Mismatch(f"the daemon serves {served.get('count')} experts, MODEL_DIR has {len(source.keys)}")
    buf = bytearray(-(-source.expert_bytes // 4096) * 4096)
    view = memoryview(buf)
    experts = nbytes = 0
    chunk = _chunk(client)
    for layer, want_experts in by_layer.items():
        local, remote = source.layout_of(layer), client.layout_of(layer)
        if [(s.name, s.dtype, tuple(s.shape)) for s in local] != [(s.name, s.dtype, tuple(s.shape)) for s in remote]:
            raise Mismatch(f"layer {layer}: the daemon serves experts of {_layout_text(remote)}; "
                           f"MODEL_DIR has {_layout_text(local)}")
        i = 0
        while i < len(want_experts):
            batch = want_experts[i:i + chunk]
            try:
                fetched = client.fetch(layer, batch)
            except UnknownExpert as e:
                raise Mismatch(f"the daemon does not serve an expert MODEL_DIR has: {e}") from None
            except (QuotaExceeded, CacheFull):
                if chunk == 1:
                    raise
                chunk //= 2                       # a pin quota or a busy arena: fewer at a time
                client.begin_token()
                continue
            i += len(batch)
            at = {s.name: s.offset for s in remote}
            for ex in fetched:
                source.read(source.keys[(layer, ex.expert)], view)
                mem = ex.memory()
                for spec in local:
                    want = np.frombuffer(buf, np.uint8, spec.nbytes, spec.offset)
                    got = np.frombuffer(mem, np.uint8, spec.nbytes, at[spec.name])
                    if not np.array_equal(got, want):
                        diff = int(np.count_nonzero(got != want))
                        raise Mismatch(f"layer {layer}, expert {ex.expert}, tensor {spec.name!r}: "
                                       f"{diff} of {spec.nbytes} bytes differ")
                    nbytes += spec.nbytes
                experts += 1
            client.begin_token()                  # its pins go: the next batch has the arena
        out(f"layer {layer}: {len(want_experts)} experts equal")
    return experts, nbytes


def _is_transformers_model(model_dir: str) -> bool:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return False
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def logits_difference(model_dir: str, endpoint: str, tokens: int) -> tuple[float, str]:
    """Largest |logit| difference between daemon experts and the checkpoint's own, and the dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from k3client.hf import load_model

    hf_logging.disable_progress_bar()         # two loads' bars would bury the result lines

    config = AutoConfig.from_pretrained(model_dir)
    kw = {}
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config
        kw["quantization_config"] = Mxfp4Config(dequantize=True)    # as load_model does
    ref = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager", dtype="auto", **kw)
    vocab = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    model = load_model(model_dir, endpoint=endpoint, name=f"k3ctl-verify-{os.getpid()}",
                       dtype=ref.dtype, **kw)
    try:
        with torch.no_grad():
            a, b = ref(ids).logits, model(ids).logits
    finally:
        model.k3d.client.close()
    return float((a.float() - b.float()).abs().max().item()), str(a.dtype).removeprefix("torch.")


def _say(line: str) -> None:
    print(line, flush=True)


def run(model_dir: str, endpoint: str, tokens: int = 8, tolerance: float = 0.0, out=_say,
        timeout: float = 30.0) -> int:
    """The command; returns the exit status (lines go to ``out``)."""
    import k3client
    from k3client.errors import K3Error
    from k3d.sources import SourceError, open_source

    try:
        source = open_source(model_dir, None)
    except (SourceError, OSError) as e:
        out(f"cannot verify: {e}")
        return EXIT_CANNOT
    try:
        try:
            client = k3client.connect(endpoint, name=f"k3ctl-verify-{os.getpid()}", timeout=timeout)
        except K3Error as e:
            out(f"cannot verify: {e}")
            return EXIT_CANNOT
        with client:
            out(f"the daemon at {endpoint} serves {client.model.get('path')}; comparing with {model_dir}")
            try:
                experts, nbytes = compare_bytes(client, source, out)
            except Mismatch as e:
                out(f"mismatch: {e}; the daemon at {endpoint} does not serve {model_dir}")
                return EXIT_MISMATCH
            except K3Error as e:
                out(f"cannot verify: {e}")
                return EXIT_CANNOT
    finally:
        source.close()
    summary = f"{experts} experts ({nbytes / 2**20:.1f} MiB) byte for byte"
    if not _is_transformers_model(model_dir):
        out(f"verified: {model_dir} matches the daemon at {endpoint}: {summary} (no transformers model "
            "there, or no hf extra: logits not compared)")
        return EXIT_OK
    diff, dtype = logits_difference(model_dir, endpoint, tokens)
    out(f"logits: largest |daemon - checkpoint| difference {diff:g} over {tokens} tokens ({dtype})")
    if diff > tolerance:
        out(f"mismatch: logits differ by {diff:g} (more than {tolerance:g}) although every expert's bytes "
            "are equal: the daemon's compute path, not its bytes, differs")
        return EXIT_MISMATCH
    out(f"verified: {model_dir} matches the daemon at {endpoint}: {summary}, logits "
        f"{'equal' if diff == 0 else f'within {tolerance:g}'} over {tokens} tokens")
    return EXIT_OK
