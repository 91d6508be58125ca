"""Predictors: pure, deterministic learners of the access stream that propose keys to read ahead.

``PREDICTORS`` maps the names ``k3d replay --predictor`` accepts to their classes;
``make`` builds one for a model of ``layers`` x ``experts``.  ``AutoPrefetch``
(``prefetch``) drives one through the store, for the daemon and for replay alike.

A predictor's API (the only caller is ``AutoPrefetch``)::

    observe(client, keys)                     client fetched keys (request order)
    propose(client, layer, budget, resident, floor, room)
                                              -> [(key, confidence)], best first (resident: keys to skip;
                                                 floor: none is taken unless the best reaches it;
                                                 room(): a bound on budget, asked only when needed)
    end_pass(client)                          the client's token ended
    next_layer(client) / first_layer(client)  the layer to propose after a fetch / at a token's start
    remaining(client) / fetch_size(client)    keys its token still needs / keys in its last fetch
    forget(client)                            the client left
    state() / restore(state)                  what a warm restart keeps (JSON-able)
"""

from k3d.cache.predict.coact import CoPredictor
from k3d.cache.predict.prefetch import AutoPrefetch, auto_id

PREDICTORS = {"coact": CoPredictor}
DEFAULT = "coact"


class UnknownPredictor(ValueError):
    pass


def make(name: str, layers: int = 1, experts: int = 1):
    cls = PREDICTORS.get(name)
    if cls is None:
        raise UnknownPredictor(f"unknown predictor {name!r}; known predictors: {', '.join(sorted(PREDICTORS))}")
    return cls(layers=layers, experts=experts)


__all__ = ["DEFAULT", "PREDICTORS", "AutoPrefetch", "CoPredictor", "UnknownPredictor", "auto_id", "make"]
