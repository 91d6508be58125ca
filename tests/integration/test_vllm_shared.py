"""Two vLLM processes on one daemon: plain vLLM's tokens, one copy of the experts, and one
replica SIGKILLed mid-generation while the other goes on.

Two replicas (``vllm_replica.py``: vLLM's ``LLM``, engine core in a child process)
run at once through one ``k3d start``; then two plain vLLM replicas run at once.
While a pair is alive its PSS is read from outside (psutil, each replica's whole
process tree).  The k3d pair's sum must be below the plain pair's by at least the
routed experts' bytes as vLLM holds them (float32 here: twice the bf16 file).  The
KV cache has a fixed size (``vllm_common.KV_BYTES``): sized as a share of RAM, vLLM
would give the saved memory to the k3d replicas' cache.
``k3ctl status`` lists both k3d replicas as clients while they run.

Then the daemon restarts with an arena of half the experts, so the replicas' pins
contend, and both start a long batched generation.  Once the victim has decoded a
few tokens its whole process tree gets SIGKILL (its engine core holds its pins).
The survivor, which was generating at that moment, finishes with plain vLLM's
tokens; the daemon drops the dead client; a second long generation of the
survivor gives plain vLLM's tokens again.
"""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from test_hf_arena import _slot_arena
from vllm_common import _vllm_ipc_files, checkpoint  # noqa: F401 -- the autouse fixture

import k3client
from conftest import spawn_daemon
from helpers import k3ctl, poll_for
from k3d.demo.hf_models import expert_bytes

pytestmark = pytest.mark.vllm
HERE = os.path.dirname(os.path.abspath(__file__))
LONG = 96                   # tokens per prompt of the generation the kill interrupts
SLOTS = 16                  # of 32 experts: the kill phase's arena, where pins matter


class Replica:
    """A ``vllm_replica.py`` process; its files are ``{out}.json`` and ``{out}.{tag}.*``."""

    def __init__(self, path: str, endpoint: str, out: str):
        self.out = out
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_replica.py"), path, endpoint, out],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)

    def _read(self, name: str):
        if self.proc.poll() is not None and self.proc.returncode != -signal.SIGKILL:
            raise AssertionError(f"replica exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
        try:
            with open(name) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def result(self, tag: str | None = None):
        return self._read(f"{self.out}.{tag}.json" if tag else f"{self.out}.json")

    def started(self, tag: str):
        return self._read(f"{self.out}.{tag}.started")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def tree(self) -> list[psutil.Process]:
        p = psutil.Process(self.proc.pid)
        return [p, *p.children(recursive=True)]

    def pss(self) -> int:
        return sum(p.memory_full_info().pss for p in self.tree())

    def kill(self) -> set[int]:
        """SIGKILL every process of the replica at once; their pids."""
        procs = self.tree()
        for p in procs:
            p.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        return {p.pid for p in procs}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def _pair(path: str, endpoint: str, tmp, tag: str) -> list[Replica]:
    """Two replicas started at once; returns once both have generated the short prompts."""
    reps = [Replica(path, endpoint, str(tmp / f"{tag}-{i}")) for i in range(2)]
    try:
        poll_for(lambda: all(r.result() for r in reps), 400, f"two {tag} replicas generating", interval=0.5)
    except BaseException:
        for r in reps:
            r.close()
        raise
    time.sleep(1.0)          # the replicas are idle now: let their memory settle
    return reps


def _kill_one_mid_generation(path: str, daemons: list, reps: list[Replica]):
    """Restart the daemon with SLOTS slots (appended to ``daemons``); SIGKILL reps[0]
    mid-generation.  Returns the survivor's two long generations."""
    assert daemons[-1].stop() == 0
    d = spawn_daemon(path, "--arena", str(_slot_arena(path, "qwen3_moe", SLOTS)), endpoint=daemons[-1].endpoint)
    daemons.append(d)
    victim, survivor = reps
    for r in reps:
        r.send(f"long a {LONG}")
    poll_for(lambda: victim.started("a"), 300, "the victim's first decode steps", interval=0.05)
    gone = victim.kill()
    assert victim.result("a") is None and survivor.result("a") is None, \
        "a generation ended before the kill: make LONG longer"
    first = poll_for(lambda: survivor.result("a"), 300, "the survivor's generation", interval=0.2)["tokens"]
    with k3client.connect(d.endpoint) as c:
        poll_for(lambda: not any(cl["pid"] in gone for cl in c.status()["clients"]), 60,
                 lambda: f"the killed replica to be dropped: {c.status()['clients']}", interval=0.2)
    survivor.send(f"long b {LONG}")
    second = poll_for(lambda: survivor.result("b"), 300, "the survivor's next generation", interval=0.2)["tokens"]
    assert d.proc.poll() is None
    return first, second


def test_two_vllm_replicas_share_the_experts_and_outlive_a_killed_one(tmp_path):
    path = checkpoint("qwen3_moe", hidden=512, inter=1024, layers=4)   # 96 MiB of bf16 experts
    held = 2 * expert_bytes(path)                                      # float32 in each plain replica
    d = spawn_daemon(path, "--arena", "128MiB")
    daemons, reps = [d], []
    try:
        reps = _pair(path, d.endpoint, tmp_path, "k3d")
        k_pss = sum(r.pss() for r in reps)
        r = k3ctl("status", "--endpoint", d.endpoint, "--json")
        names = [c.get("name", "") for c in json.loads(r.stdout).get("clients", [])]
        k_tokens = [r.result()["tokens"] for r in reps]
        after_kill, next_gen = _kill_one_mid_generation(path, daemons, reps)
    finally:
        for r in reps:
            r.close()
        for x in daemons:
            x.stop()
    reps = _pair(path, "-", tmp_path, "plain")
    try:
        p_pss = sum(r.pss() for r in reps)
        p_tokens = [r.result()["tokens"] for r in reps]
        reps[0].send(f"long a {LONG}")
        p_long = poll_for(lambda: reps[0].result("a"), 300, "plain vLLM's long generation", interval=0.2)["tokens"]
    finally:
        for r in reps:
            r.close()
    assert k_tokens[0] == k_tokens[1] == p_tokens[0] == p_tokens[1]
    assert sum(n.startswith("replica-") for n in names) == 2, names
    assert after_kill == p_long, "the survivor's tokens differ from plain vLLM's after the kill"
    assert next_gen == p_long
    saved = p_pss - k_pss
    print(f"PSS of the pair: k3d {k_pss / 2**20:.0f} MiB, plain {p_pss / 2**20:.0f} MiB, "
          f"saved {saved / 2**20:.0f} MiB; "
          f"experts as one replica holds them {held / 2**20:.0f} MiB")
    assert saved >= held, f"PSS saved {saved / 2**20:.0f} MiB < expert bytes held {held / 2**20:.0f} MiB"
