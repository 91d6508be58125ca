"""Shared pieces of the benchmarks: a real ``k3d start`` subprocess, timing, reporting.

Every benchmark starts its own daemon on a private ipc endpoint under /tmp,
measures its floor in the same run, and reports medians over repetitions as
ratios (absolute figures on a shared 2-core VM mean little).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -P`: a bench's k3d subprocesses import the k3d this Python has installed, as the
# bench itself does, not the checkout they start in (which `-m`/`-c` would put first on
# the path): a regular install's request path is compiled (k3d/compiled.py).
PY = [sys.executable, "-P"]
PAGE = 4096
SERVER_CPUS: set[int] | None = None     # a benchmark may pin the daemon (and its floor's server) here


def server_affinity() -> None:
    """``preexec_fn`` for server subprocesses: apply SERVER_CPUS, if set."""
    if SERVER_CPUS:
        os.sched_setaffinity(0, SERVER_CPUS)


class Daemon:
    """``k3d start`` as a subprocess; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, source: str, *args, readers: int | None = None, timeout: float = 60.0):
        """``readers`` None: the daemon's default (what users get)."""
        self.dir = tempfile.mkdtemp(prefix="k3d-b-", dir="/tmp")   # ipc paths must stay short
        self.endpoint = f"ipc://{self.dir}/k.sock"
        self.log_path = os.path.join(self.dir, "daemon.log")
        # --state-dir none: a bench daemon starts cold, whatever an earlier bench left in the
        # user's warm-restart directory (a pre-loaded hot set would change what it measures)
        cmd = [*PY, "-m", "k3d", "start", "--source", source, "--state-dir", "none",
               "--endpoint", self.endpoint, *(["--readers", str(readers)] if readers else []), *map(str, args)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     preexec_fn=server_affinity if SERVER_CPUS else None)
        deadline = time.monotonic() + timeout
        while "k3d: ready" not in self.log():     # not "arena ... ready in 1.0s"
            if self.proc.poll() is not None:
                raise RuntimeError(f"k3d start exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"k3d start not ready in {timeout:g}s:\n{self.log()}")
            time.sleep(0.02)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        rc = self.stop()
        if rc != 0 and exc[0] is None:
            raise RuntimeError(f"k3d exited {rc} after SIGTERM")


class EchoServer:
    """The floor of hit_path and throughput: a bare Python ROUTER echo
    (``hit_path.py --echo-server``) in its own process on a private ipc endpoint,
    answering every request with ``reply_size`` bytes; ``mode`` "loop" gives it
    k3d's loop shape.  A context manager: ``close`` kills it and removes its directory."""

    def __init__(self, reply_size: int, mode: str = "bare"):
        self.dir = tempfile.mkdtemp(prefix="k3d-echo-", dir="/tmp")
        self.endpoint = f"ipc://{self.dir}/echo.sock"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "bench", "hit_path.py"), "--echo-server", self.endpoint,
             str(reply_size), mode], stdout=subprocess.PIPE, text=True, preexec_fn=server_affinity)
        try:
            line = self.proc.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"the echo server said {line!r}, not ready")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def checkpoint(layers: int, experts: int, hidden: int, inter: int, seed: int = 0) -> str:
    """A synthetic MXFP4-shaped checkpoint in a fresh temp dir (caller removes it)."""
    from k3d.demo.synthetic import write_checkpoint

    path = tempfile.mkdtemp(prefix="k3d-bench-ckpt-", dir="/tmp")
    return write_checkpoint(path, layers=layers, experts=experts, hidden=hidden, inter=inter, seed=seed)


def safetensors_experts(path: str, pattern: str = "model.layers.{layer}.mlp.experts.{expert}."):
    """{(layer, expert): (file_offset, nbytes)} of each expert's byte span, from the header
    (parsed here, independently of the daemon).  Each synthetic expert is one contiguous span."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    base = 8 + n
    spans: dict[tuple[int, int], list[int]] = {}
    for name, t in header.items():
        if name == "__metadata__" or ".mlp.experts." not in name:
            continue
        parts = name.split(".")
        key = (int(parts[2]), int(parts[5]))
        b, e = t["data_offsets"]
        lo, hi = spans.get(key, (1 << 62, 0))
        spans[key] = [min(lo, base + b), max(hi, base + e)]
    return {k: (lo, hi - lo) for k, (lo, hi) in spans.items()}


def warm_page_cache(path: str) -> float:
    """Read the whole file once (so it is page-cache resident); returns seconds."""
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def pct(samples, q: float) -> float:
    """q-th percentile (0..100), nearest-rank."""
    s = sorted(samples)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[i]


def median(xs) -> float:
    return statistics.median(xs)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


_SHOWN: list[str] = []


def banner(name: str, text: str) -> None:
    """``[name] text``; the first one also says which build of k3d runs (k3d.compiled)."""
    if not _SHOWN:
        _SHOWN.append(name)
        print(f"[{name}] k3d {build()}", flush=True)
    print(f"[{name}] {text}", flush=True)


def build() -> str:
    """``compiled (16 modules, mypyc)`` or ``interpreted``: the k3d this bench imports."""
    from k3d.compiled import status
    return status()


def scale_shape(ap) -> None:
    """The options of ``scale.py``'s probe that ``fetch_cpu.py`` and ``store_path.py``
    share: the model's counts, the arena's share of its experts, the decoding clients."""
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.3, help="arena slots as a share of all experts")
    ap.add_argument("--clients", type=int, default=2)


def drop_page_cache(path: str) -> None:
    """Evict ``path`` from the page cache (fsync first: dirty pages are not dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def compact_memory() -> bool:
    """Ask the kernel to compact free memory (root only); True when it ran.  Pages allocated
    afterwards are physically contiguous far more often, for whoever allocates them."""
    try:
        with open("/proc/sys/vm/compact_memory", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def hugepages_reserved(pages: int):
    """Grow the hugetlb pool (``vm.nr_hugepages``, root only) by ``pages`` for the block;
    restores it afterwards.  SystemExit with the reason when it cannot."""
    path = "/proc/sys/vm/nr_hugepages"
    try:
        with open(path) as f:
            old = int(f.read())
        compact_memory()
        with open(path, "w") as f:
            f.write(str(old + pages))
    except OSError as e:
        raise SystemExit(f"--hugepages: cannot reserve huge pages ({path}: {e.strerror}; run as root)") from None
    try:
        with open(path) as f:
            if int(f.read()) < old + pages:
                raise SystemExit(f"--hugepages: the kernel found fewer than {pages} free huge pages")
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(old))


def address(buf) -> int:
    """Virtual address of a writable buffer (a memoryview of an mmap)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def physical_runs(pid: int, addr: int, length: int) -> int | None:
    """Runs of physically contiguous pages backing [addr, addr + length) in ``pid``
    (from /proc/PID/pagemap; None where frame numbers are hidden: not root)."""
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek(addr // PAGE * 8)
            data = f.read(-(-length // PAGE) * 8)
    except OSError:
        return None
    pfns = [e & ((1 << 55) - 1) for e in struct.unpack(f"<{len(data) // 8}Q", data)]
    if not pfns or not all(pfns):
        return None
    return 1 + sum(b != a + 1 for a, b in zip(pfns, pfns[1:]))


def arena_physical_runs(pid: int, slot_bytes: int, slots: int) -> list[int | None]:
    """``physical_runs`` of each slot of the k3d arena mapped by ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        line = next((ln for ln in f if "k3d-arena" in ln), None)
    if line is None:
        return [None] * slots
    base = int(line.split("-", 1)[0], 16)
    return [physical_runs(pid, base + i * slot_bytes, slot_bytes) for i in range(slots)]


def timed_threads(target, threads: int) -> float:
    """Run ``target(i)`` on ``threads`` threads at once; seconds until all return."""
    ts = [threading.Thread(target=target, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0
