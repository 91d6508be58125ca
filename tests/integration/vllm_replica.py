"""One vLLM replica for test_vllm_shared.py: ``python vllm_replica.py MODEL ENDPOINT|- OUT.json``.

Builds vLLM's ``LLM`` on MODEL (through the k3d daemon at ENDPOINT, or plain with
``-``), generates the shared prompts greedily, writes ``{"tokens": ..., "pid": ...}``
to OUT.json, then stays alive (its memory measurable from outside) until its
stdin closes.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from vllm_common import engine, generate

    model, endpoint, out = sys.argv[1:4]
    k3d = None if endpoint == "-" else {"endpoint": endpoint, "name": f"replica-{os.getpid()}"}
    with engine(model, k3d=k3d) as llm:
        tokens = generate(llm)
        with open(out + ".tmp", "w") as f:
            json.dump({"tokens": tokens, "pid": os.getpid()}, f)
        os.rename(out + ".tmp", out)
        sys.stdin.read()            # until the test closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
