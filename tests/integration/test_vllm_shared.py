"""Two vLLM processes on one daemon: plain vLLM's tokens, and one copy of the experts between them.

Two replicas (``vllm_replica.py``: vLLM's ``LLM``, engine core in a child process)
run at once through one ``k3d start``; then two plain vLLM replicas run at once.
While a pair is alive its PSS is read from outside (psutil, each replica's whole
process tree).  The k3d pair's sum must be below the plain pair's by at least the
routed experts' bytes as vLLM holds them (float32 here: twice the bf16 file).  The
KV cache has a fixed size (``vllm_common.KV_BYTES``): sized as a share of RAM, vLLM
would give the saved memory to the k3d replicas' cache.
``k3ctl status`` lists both k3d replicas as clients while they run.
"""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from vllm_common import _vllm_ipc_files, checkpoint  # noqa: F401 -- the autouse fixture

from conftest import spawn_daemon
from helpers import k3ctl, poll_for
from k3d.demo.hf_models import expert_bytes

pytestmark = pytest.mark.vllm
HERE = os.path.dirname(os.path.abspath(__file__))


def _pss_tree(pid: int) -> int:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_full_info().pss for p in procs)


def _pair(path: str, endpoint: str, tmp, tag: str, during=None):
    """Start two replicas at once; when both have generated: (tokens, PSS sum, what ``during()`` returned)."""
    outs = [str(tmp / f"{tag}-{i}.json") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_replica.py"), path, endpoint, o],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for o in outs]
    try:
        def ready():
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"replica exited {p.returncode}: {p.stderr.read().decode()[-3000:]}")
            return all(os.path.exists(o) for o in outs)

        poll_for(ready, 400, f"two {tag} replicas generating", interval=0.5)
        time.sleep(1.0)          # the replicas are idle now: let their memory settle
        pss = sum(_pss_tree(p.pid) for p in procs)
        seen = during() if during else None
        tokens = [json.load(open(o))["tokens"] for o in outs]
        return tokens, pss, seen
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_two_vllm_replicas_share_one_copy_of_the_experts(tmp_path):
    path = checkpoint("qwen3_moe", hidden=512, inter=1024, layers=4)   # 96 MiB of bf16 experts
    held = 2 * expert_bytes(path)                                      # float32 in each plain replica
    d = spawn_daemon(path, "--arena", "128MiB")
    try:
        def clients():
            r = k3ctl("status", "--endpoint", d.endpoint, "--json")
            return [c.get("name", "") for c in json.loads(r.stdout).get("clients", [])]

        k_tokens, k_pss, names = _pair(path, d.endpoint, tmp_path, "k3d", during=clients)
    finally:
        d.stop()
    p_tokens, p_pss, _ = _pair(path, "-", tmp_path, "plain")
    assert k_tokens[0] == k_tokens[1] == p_tokens[0] == p_tokens[1]
    assert sum(n.startswith("replica-") for n in names) == 2, names
    saved = p_pss - k_pss
    print(f"PSS of the pair: k3d {k_pss / 2**20:.0f} MiB, plain {p_pss / 2**20:.0f} MiB, "
          f"saved {saved / 2**20:.0f} MiB; "
          f"experts as one replica holds them {held / 2**20:.0f} MiB")
    assert saved >= held, f"PSS saved {saved / 2**20:.0f} MiB < expert bytes held {held / 2**20:.0f} MiB"
