"""``FakeCuda``: a stand-in for ``k3client.gpu.cuda.CudaApi`` with the driver's rules.

It keeps what the driver keeps: registered ranges (a range overlapping a live one
fails with cudaErrorHostMemoryAlreadyRegistered, 712, as the driver answers; a
registration outlives ``munmap`` until unregistered), and, as the runtime does, a
failed call's error *pending* until ``last_error`` drains it (``launch`` is the
next, unrelated kernel launch: it raises a pending error).  Chosen calls fail with
chosen codes (``fail``), and every call is recorded in ``calls`` in order, with
whether the address was still mapped (``/proc/self/maps``) when unregistered.
"""

from __future__ import annotations

SENTENCES = {2: "out of memory", 712: "part or all of the requested memory range is already mapped",
             713: "pointer does not correspond to a registered memory region", 801: "operation not supported"}


def mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


class FakeCuda:
    def __init__(self, without_read_only=()):
        self.live: dict[int, int] = {}      # address -> bytes
        self.calls: list[tuple] = []
        self.fail: dict[int, int] = {}      # index of a register call (0-based) -> error code
        self.pending = 0
        self.without_read_only = set(without_read_only)     # device indices lacking attribute 113
        self.on_sync = None                 # callable(device) -> recorded with the sync
        self._registers = 0

    def register(self, addr, size, flags):
        i, self._registers = self._registers, self._registers + 1
        err = self.fail.get(i, 0)
        if not err and any(a < addr + size and addr < a + n for a, n in self.live.items()):
            err = 712
        self.calls.append(("register", addr, size, flags, err))
        if err:
            self.pending = err
            return err
        self.live[addr] = size
        return 0

    def unregister(self, addr):
        err = 0 if addr in self.live else 713
        self.calls.append(("unregister", addr, self.live.get(addr), mapped(addr), err))
        if err:
            self.pending = err
            return err
        del self.live[addr]
        return 0

    def last_error(self):
        err, self.pending = self.pending, 0
        return err

    def launch(self):
        if self.pending:
            err, self.pending = self.pending, 0
            raise RuntimeError(f"CUDA error {err} raised by an unrelated kernel launch")

    def error_text(self, code):
        from k3client.gpu.cuda import describe

        return describe(code, SENTENCES.get(code))

    def read_only_supported(self, device):
        self.calls.append(("attribute 113", device))
        return device not in self.without_read_only

    def synchronize(self, device):
        self.calls.append(("synchronize", str(device), self.on_sync(device) if self.on_sync else None))

    def of(self, kind):
        return [c for c in self.calls if c[0] == kind]
