"""What this CPU can compute fast: the facts the plugins' kernel choices depend on, in one place.

Hosts differ: an AMD EPYC has AVX-512 (with its bf16 dot products) and no AMX; an
Intel Xeon from Sapphire Rapids on has AMX tiles (``amx_tile``, ``amx_bf16``,
``amx_int8``), which oneDNN's bf16 matmuls and vLLM's own CPU kernels use.  vLLM
picks its AMX code (the ``AMX_MLA`` attention backend, ``CPUExpertsMxfp4``, its AMX
unquantized MoE) by asking torch (``torch.cpu._is_amx_tile_supported()``), which also
checks that the OS lets the process use the tiles; ``facts()`` asks torch the same
questions where torch is importable, so the plugin and vLLM decide alike, and reads
``/proc/cpuinfo``'s flags for the rest (and for all of it without torch).

``from_flags`` builds ``CpuFacts`` from a flags line or set alone: the unit tests
give it both kinds of CPU.  Pure functions except ``facts()``, which reads once per
process (cached) and may be called from any thread.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class CpuFacts:
    """The instruction sets the expert kernels care about (True: present and usable)."""

    avx512: bool = False          # avx512f: native.rowmm's 16-wide fp32 FMAs
    avx512_bf16: bool = False     # avx512_bf16: bf16 dot products (vdpbf16ps)
    amx_tile: bool = False        # AMX tiles, usable by this process
    amx_bf16: bool = False        # AMX bf16 tile multiplies (oneDNN's bf16 matmul)
    amx_int8: bool = False        # AMX int8 tile multiplies
    source: str = "flags"         # where the facts came from: "torch" (and flags) or "flags"

    @property
    def amx(self) -> bool:
        """bf16 matmuls run on AMX tiles (oneDNN's, and vLLM's CPU AMX kernels)."""
        return self.amx_tile and self.amx_bf16

    def describe(self) -> str:
        """One line for logs and skip messages, e.g. ``AVX-512 (bf16), no AMX``."""
        if not self.avx512:
            vec = "no AVX-512"
        else:
            vec = "AVX-512 (bf16)" if self.avx512_bf16 else "AVX-512"
        if self.amx:
            kinds = [k for k, on in (("bf16", self.amx_bf16), ("int8", self.amx_int8)) if on]
            return f"{vec}, AMX ({', '.join(kinds)})"
        return f"{vec}, no AMX"


def parse_flags(text: str) -> set[str]:
    """The flags of a ``/proc/cpuinfo`` text (its first ``flags`` line; x86 lists them per CPU,
    alike), or of a bare space-separated flags line."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set() if ":" in text else set(text.split())


def from_flags(flags) -> CpuFacts:
    """``CpuFacts`` from a flags line (``"flags : fpu ... amx_tile"``) or a set of flag names."""
    f = parse_flags(flags) if isinstance(flags, str) else set(flags)
    tile = "amx_tile" in f
    return CpuFacts(avx512="avx512f" in f, avx512_bf16="avx512_bf16" in f, amx_tile=tile,
                    amx_bf16=tile and "amx_bf16" in f, amx_int8=tile and "amx_int8" in f, source="flags")


def model_name(path: str = CPUINFO) -> str:
    """The CPU's model name (``/proc/cpuinfo``), for benchmark output; "?" where unreadable."""
    try:
        with open(path) as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return "?"


def _read_flags(path: str = CPUINFO) -> set[str]:
    try:
        with open(path) as fh:
            return parse_flags(fh.read())
    except OSError:                  # not Linux, or /proc not mounted: torch answers alone
        return set()


@functools.cache
def facts() -> CpuFacts:
    """This process's CPU: torch's answers where torch is importable (vLLM asks torch the same),
    ``/proc/cpuinfo`` flags for what torch does not say."""
    flags = _read_flags()
    base = from_flags(flags)
    try:
        import torch
        cpu = torch.cpu
        avx512, bf16, tile = (cpu._is_avx512_supported(), cpu._is_avx512_bf16_supported(),
                              cpu._is_amx_tile_supported())
    except (ImportError, AttributeError):    # no torch, or a torch without these queries
        return base
    # torch says whether tiles are usable; the kinds of tile multiply are flags (every AMX CPU has
    # bf16 so far: assumed where /proc/cpuinfo cannot be read)
    return CpuFacts(avx512=avx512, avx512_bf16=bf16, amx_tile=tile,
                    amx_bf16=tile and ("amx_bf16" in flags or not flags),
                    amx_int8=tile and "amx_int8" in flags, source="torch")
