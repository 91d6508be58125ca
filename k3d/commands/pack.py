"""``k3d pack SRC OUT``: convert a checkpoint into a packed file (``.k3pack``).

Opens SRC with ``open_source`` (any local or remote kind but a pack), writes
OUT with ``sources.packwrite.write_pack`` (atomic: OUT appears only when
complete) and prints a summary.  Exit codes: 0 written; 1 refused or failed
(one line on stderr: OUT exists without ``--force``, SRC unusable or already
packed, a read or write error); 130 interrupted (nothing written).

Lives outside ``k3d.sources`` because it names ``open_source`` (the package's
face): a module inside the package that imported it back would close an
import circle.  Thread: the CLI's main thread.
"""

from __future__ import annotations

import os
import sys

from k3d.sources import SourceError, open_source
from k3d.sources.packed import PackedSource
from k3d.sources.packwrite import write_pack


def pack_main(src_spec: str, out: str, pattern: str, force: bool = False, progress: bool = True) -> int:
    """``k3d pack SRC OUT``: returns the exit code; every failure is one line on stderr."""
    if os.path.exists(out) and not force:
        print(f"k3d: error: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1
    try:
        src = open_source(src_spec, pattern)
    except SourceError as e:
        print(f"k3d: error: {e}", file=sys.stderr)
        return 1
    try:
        if isinstance(src, PackedSource):
            print(f"k3d: error: {src_spec} is already a packed file", file=sys.stderr)
            return 1
        s = write_pack(src, out, progress=progress)
    except (SourceError, OSError) as e:
        print(f"k3d: error: pack failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nk3d: pack interrupted; {out} not written", file=sys.stderr)
        return 130
    finally:
        src.close()
    print(f"k3d: packed {s['experts']} experts ({s['span']} bytes each, stride {s['stride']}) "
          f"into {out}: {s['bytes'] / 1e6:.1f} MB in {s['seconds']:.1f}s", file=sys.stderr)
    return 0
