"""``k3d demo``: the embedded default, end to end on this machine.

1. Writes a small synthetic MXFP4-shaped checkpoint with the safetensors library
   (8 layers x 32 experts, two shards) and digests every expert from it.
2. Starts a real daemon (``k3d start``) with an arena that holds ~40% of the
   experts, so the LRU, predictions and evictions all matter.
3. Runs ``clients`` model processes (``k3d.demo.worker``) that share it over many
   tokens with realistic routing and gate-ahead predictions; each verifies every
   byte it reads.
4. Prints hit rate, waits, prefetch use, bytes read and per-process RSS/PSS,
   then stops the daemon with SIGTERM and checks it exited 0 and left nothing.

The daemon and the workers are ``k3d.demo.children``: a Ctrl-C stops them and
removes the checkpoint; the CLI prints one line and exits 130.

Runs in the CLI's main thread; the daemon and the workers are child processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from safetensors import safe_open

import k3client
from k3client.layout import build_layout

from .children import PYTHON, Children
from .synthetic import NAME, write_checkpoint

LAYERS, EXPERTS = 8, 32


def digest_checkpoint(path: str, layers: int, experts: int) -> dict[str, str]:
    """blake2b of each expert laid out as in a slot, read with the reference library."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    handles = {shard: safe_open(os.path.join(path, shard), "np") for shard in set(weight_map.values())}
    out = {}
    layout = None
    for layer in range(layers):
        for e in range(experts):
            prefix = NAME.format(layer=layer, expert=e, name="")
            names = sorted(n[len(prefix):] for n in weight_map if n.startswith(prefix))
            tensors = {n: handles[weight_map[prefix + n]].get_tensor(prefix + n) for n in names}
            if layout is None:
                layout = build_layout([(n, "U8", t.shape, t.nbytes) for n, t in tensors.items()])
            span = max(s.offset + s.nbytes for s in layout)
            buf = bytearray(span)
            for s in layout:
                buf[s.offset:s.offset + s.nbytes] = tensors[s.name].tobytes()
            out[f"{layer}/{e}"] = hashlib.blake2b(buf, digest_size=16).hexdigest()
    return out


def _shm_entries() -> set[str]:
    """k3d's entries in /dev/shm (there should be none: its memory is memfds); other
    programs' come and go meanwhile and say nothing about the daemon."""
    return {n for n in os.listdir("/dev/shm") if "k3d" in n} if os.path.isdir("/dev/shm") else set()


def run_demo(tokens: int = 200, clients: int = 3, seed: int = 1234) -> int:
    t_start = time.monotonic()
    shm_before = _shm_entries()
    with tempfile.TemporaryDirectory(prefix="k3d-demo-") as tmp:
        ckpt = write_checkpoint(os.path.join(tmp, "ckpt"), layers=LAYERS, experts=EXPERTS,
                                hidden=512, inter=256, shards=2, seed=seed)
        digests = digest_checkpoint(ckpt, LAYERS, EXPERTS)
        dpath = os.path.join(tmp, "digests.json")
        with open(dpath, "w") as f:
            json.dump(digests, f)
        endpoint = f"ipc://{tmp}/k3d.sock"
        slots = int(LAYERS * EXPERTS * 0.4)
        print(f"demo: checkpoint {ckpt}: {LAYERS} layers x {EXPERTS} experts; arena {slots} slots "
              f"(~40 % of the experts: smaller than the model, as in real use, so the cache must choose); "
              f"{clients} model processes x {tokens} tokens; seed {seed}", flush=True)
        log_path = os.path.join(tmp, "daemon.log")
        # the demo is the embedded default: the caller's K3D_* settings (a pin quota, hugepages,
        # a config file) are for their own daemon, not this one
        env = {k: v for k, v in os.environ.items() if not k.startswith("K3D_")}
        with Children() as children:
            with open(log_path, "w") as log:
                daemon = children.start([*PYTHON, "-m", "k3d", "start", "--source", ckpt,
                                         "--endpoint", endpoint, "--slots", str(slots),
                                         "--state-dir", "none"],    # a throw-away daemon: nothing to keep
                                        stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + 60
            while "k3d: ready" not in open(log_path).read():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    print(open(log_path).read(), file=sys.stderr)
                    print("demo: the daemon did not start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            workers = [children.start(
                [*PYTHON, "-m", "k3d.demo.worker", "--endpoint", endpoint, "--name", f"model-{i}",
                 "--digests", dpath, "--layers", str(LAYERS), "--experts", str(EXPERTS),
                 "--tokens", str(tokens), "--seed", str(seed + i + 1), "--route-seed", str(seed)],
                stdout=subprocess.PIPE, text=True, env=env) for i in range(clients)]
            results = []
            for w in workers:
                out, _ = w.communicate(timeout=300)
                results.append(json.loads(out.strip().splitlines()[-1]) if out.strip() else None)
            with k3client.connect(endpoint, name="demo-status") as c:
                status = c.status()
            daemon.terminate()
            rc = daemon.wait(30)
        st, arena = status["stats"], status["arena"]
        total = st["hits"] + st["misses"]
        print("\nprocess      fetches  experts checked  wrong  fetch p50   p99      RSS MiB  PSS MiB")
        ok = True
        for r in results:
            if r is None:
                print("  a model process failed")
                ok = False
                continue
            ok &= r["wrong"] == 0
            print(f"{r['name']:<12} {r['fetches']:>7}  {r['checked']:>15}  {r['wrong']:>5}  "
                  f"{r['p50_us']:7.0f}us {r['p99_us']:7.0f}us  {r['rss'] / 2**20:7.1f}  {r['pss'] / 2**20:7.1f}")
        print(f"\ncache: hit rate {100 * st['hits'] / max(total, 1):.1f}% ({st['hits']} hits / {st['misses']} misses), "
              f"{st['waited']} waited on a read in flight, {st['evictions']} evictions")
        pq = status.get("prediction", {}).get("total", {})
        prec = pq.get("precision")
        print(f"predictions (gate-ahead, not right by construction): {st['prefetched']} prefetched, "
              f"{st['prefetch_hits']} used, {st['prefetch_unused']} unused"
              + (f", precision {100 * prec:.1f}%" if prec is not None else "")
              + (f"; fetched keys ready {pq['ready']}, waited {pq['waited']}, missed {pq['missed']}" if pq else ""))
        model_bytes = len(digests) * arena["expert_bytes"]
        print(f"reads: {st['bytes_read'] / 2**20:.1f} MiB read from the checkpoint, "
              f"{st['bytes_read'] / model_bytes:.1f}x its {model_bytes / 2**20:.1f} MiB of experts; "
              f"{st['errors']} errors")
        print(f"why: the arena holds {arena['slots']} of the {len(digests)} experts "
              f"({100 * arena['slots'] / len(digests):.0f} %, on purpose: real arenas are smaller than the model), so "
              "experts are evicted and read again when routing returns to them; every process shares each read")
        print(f"arena: {arena['bytes'] / 2**20:.1f} MiB shared by {len(results)} processes "
              f"(sum of their PSS {sum(r['pss'] for r in results if r) / 2**20:.1f} MiB; "
              f"a private cache of the same size in each would take {len(results)} x "
              f"{arena['bytes'] / 2**20:.1f} MiB and read each expert {len(results)} times)")
        leftover = _shm_entries() - shm_before
        print(f"daemon: SIGTERM exit code {rc}; left in /dev/shm: {sorted(leftover) or 'nothing'}")
        ok &= rc == 0 and not leftover and all(results)
        print(f"demo: {'OK' if ok else 'FAILED'}: every byte verified against safetensors "
              f"in {time.monotonic() - t_start:.1f}s" if ok else "demo: FAILED")
        return 0 if ok else 1
