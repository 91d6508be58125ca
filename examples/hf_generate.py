"""N transformers processes generating with one k3d daemon (see k3d/demo/hf.py).

    python examples/hf_generate.py --clients 3 --tokens 16

Writes a tiny random Qwen3-MoE with ``save_pretrained``, starts ``k3d start`` on it,
runs N processes that ``k3client.hf.load_model`` it and generate, then N plain
transformers processes, and prints tokens/s, hit rate, prediction precision and
per-process PSS/RSS, checking that the routed experts count once on the host.
The per-process code is ``k3d.demo.hf.worker``: ``load_model(path, endpoint=...)``
then ``model.generate(...)``, as in any transformers program.
"""

import sys

from k3d.demo.hf import main

if __name__ == "__main__":
    sys.exit(main())
