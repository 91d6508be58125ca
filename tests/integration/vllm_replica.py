"""One vLLM replica for test_vllm_shared.py: ``python vllm_replica.py MODEL ENDPOINT|- OUT``.

Builds vLLM's ``LLM`` on MODEL (through the k3d daemon at ENDPOINT, or plain with
``-``), generates the shared prompts greedily and writes ``{"tokens": ..., "pid": ...}``
to ``OUT.json``.  Then it reads commands from stdin, one per line, until stdin closes:

- ``long TAG N``: generate the shared prompts, N tokens each, step by step; after the
  first decode steps write ``OUT.TAG.started`` (the number of tokens the first prompt
  has so far), at the end ``OUT.TAG.json`` (``{"tokens": ...}``).

Every file is written whole (a rename), so a reader never sees half of one.  The
replica stays alive between commands (its memory measurable from outside).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STARTED_AFTER = 3           # tokens of the first prompt before ``.started`` is written


def _write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.rename(path + ".tmp", path)


def _generate_stepwise(llm, prompts, max_tokens: int, started: str) -> list[list[int]]:
    """Greedy tokens per prompt through ``LLMEngine.step``, writing ``started`` once decoding runs."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    eng = llm.llm_engine
    ids = [f"{started}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    done, marked = {}, False
    while eng.has_unfinished_requests():
        for o in eng.step():
            n = len(o.outputs[0].token_ids)
            if not marked and o.request_id == ids[0] and n >= STARTED_AFTER:
                _write(started, n)
                marked = True
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[r] for r in ids]


def main() -> int:
    from vllm_common import PROMPTS, engine, generate

    model, endpoint, out = sys.argv[1:4]
    k3d = None if endpoint == "-" else {"endpoint": endpoint, "name": f"replica-{os.getpid()}"}
    with engine(model, k3d=k3d) as llm:
        _write(out + ".json", {"tokens": generate(llm), "pid": os.getpid()})
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "long":
                tag, n = cmd[1], int(cmd[2])
                tokens = _generate_stepwise(llm, PROMPTS, n, f"{out}.{tag}.started")
                _write(f"{out}.{tag}.json", {"tokens": tokens})
    return 0


if __name__ == "__main__":
    sys.exit(main())
