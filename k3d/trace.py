"""Route trace: one line per fetch, the exact access sequence for replaying policies.

Line format (space separated)::

    <µs since daemon start> L<layer> n=<keys> miss=<m> evict=<e> wait=<w> pf=<p> pfu=<u> <expert ids,...>

``pf`` counts keys of this fetch served by a prediction; ``pfu`` counts the
fetching client's predictions found unused at its last ``begin_token`` (since
its previous traced fetch).  The file is line-buffered and flushed per line, so a
killed daemon keeps every line it wrote.

Owned by the server thread (it writes a line as it plans each fetch; a SIGHUP
reload swaps the file there too); no lock.
"""

from __future__ import annotations


class RouteTrace:
    def __init__(self, path: str, t0: float):
        self.path = path
        self.t0 = t0
        self._f = open(path, "a", buffering=1, encoding="ascii")

    def fetch(self, now: float, layer: int, experts: list[int], miss: int, evict: int,
              wait: int, pf: int, pfu: int) -> None:
        us = int((now - self.t0) * 1e6)
        ids = ",".join(str(e) for e in experts)
        self._f.write(f"{us} L{layer} n={len(experts)} miss={miss} evict={evict} wait={wait} "
                      f"pf={pf} pfu={pfu} {ids}\n")

    def close(self) -> None:
        self._f.close()
