"""A synthetic router that routes like a real MoE model, and a gate-ahead predictor.

No route is drawn from a table of "right answers": each token has a hidden state that
flows through the layers, each layer's router scores the experts from it, and the
top-k win.  The statistics of real routing come out of that mechanism:

- temporal reuse: a token's first hidden state is an AR(1) step from the previous
  token's (``rho``), so the same experts recur at a layer more often than chance
  (the shared Mixtral trace: ~1.4x chance);
- popularity: each layer's router has a bias (``skew``, standard deviation of the
  logit bias); the shared trace is nearly flat (busiest expert ~1.3x the mean), far
  flatter than Zipf(1.1);
- the residual stream drifts from layer to layer (``drift``), so a layer's choice
  says little about the next layer's (weak cross-layer transitions, as measured);
- ``predict``: gate-ahead, as real predictors do it (Pre-gated MoE, transformers'
  k3client.hf): layer l+1's router applied to layer l's hidden state.  It is right
  only as far as the hidden state did not move, never by construction.

The defaults (``rho`` 0.75, ``skew`` 0.5, ``drift`` 0.35) reproduce the shared trace's
statistics at its shape (8 experts, top-2): reuse 1.4x chance, top-2 share ~32 %,
gate-ahead recall ~80 %.  Chance reuse falls with more experts per pick, so the same
``rho`` gives more reuse than chance elsewhere: ``DEMO`` holds the values that give
the demo's shape (32 experts, top-4) the same 1.4x.

Pure numpy with an explicit seed: the same arguments give the same routes.
"""

from __future__ import annotations

import numpy as np

DEMO = {"rho": 0.2, "skew": 0.3}     # k3d demo's 8 x 32, top-4: reuse ~1.4x chance, busiest ~1.7x mean


class SyntheticRouter:
    def __init__(self, layers: int, experts: int, topk: int, seed: int = 0, rho: float = 0.75,
                 drift: float = 0.35, skew: float = 0.5, dim: int = 64, stream: int = 0):
        """``seed`` makes the model (routers, biases); ``stream`` the text (hidden states):
        several model processes of one model share ``seed`` and differ in ``stream``."""
        rng = np.random.default_rng(seed)
        self.layers, self.experts, self.topk = layers, experts, topk
        self.rho, self.drift = rho, drift
        self.w = rng.standard_normal((layers, experts, dim)) / np.sqrt(dim)
        self.bias = rng.standard_normal((layers, experts)) * skew
        self.scale = 3.0          # router temperature: logits spread like a trained gate's
        self.rng = np.random.default_rng([seed, stream, 1])
        self.dim = dim
        self.h = self.rng.standard_normal(dim)

    def _top(self, layer: int, h: np.ndarray) -> list[int]:
        logits = self.scale * (self.w[layer] @ h) + self.bias[layer]
        return [int(e) for e in np.argsort(-logits, kind="stable")[:self.topk]]

    def token(self) -> tuple[list[list[int]], list[list[int]]]:
        """(route, predicted): route[l] = the top-k experts of layer l; predicted[l] =
        the gate-ahead guess for layer l + 1 made at layer l (empty for the last)."""
        rng = self.rng
        self.h = self.rho * self.h + np.sqrt(1 - self.rho ** 2) * rng.standard_normal(self.dim)
        h = self.h
        route, predicted = [], []
        for layer in range(self.layers):
            route.append(self._top(layer, h))
            predicted.append(self._top(layer + 1, h) if layer + 1 < self.layers else [])
            h = (h + self.drift * rng.standard_normal(self.dim)) / np.sqrt(1 + self.drift ** 2)
        return route, predicted


def routes(n_tokens: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    """``n_tokens`` tokens: (route [T, L, k], predicted [T, L-1, k]) as int arrays."""
    r = SyntheticRouter(**kw)
    out, pred = [], []
    for _ in range(n_tokens):
        a, b = r.token()
        out.append(a)
        pred.append(b[:-1])
    return np.array(out), np.array(pred)


def statistics(route: np.ndarray, experts: int) -> dict:
    """The statistics the shared trace's README states, for a [T, L, k] route."""
    T, L, k = route.shape
    counts = np.zeros((L, experts))
    for layer in range(L):
        np.add.at(counts[layer], route[:, layer].ravel(), 1)
    share = counts / counts.sum(1, keepdims=True)
    top2 = np.sort(share, 1)[:, -2:].sum(1).mean()
    busiest = (share.max(1) * experts).mean()
    same = np.mean([len(set(route[t, l]) & set(route[t - 1, l])) / k
                    for t in range(1, T) for l in range(L)])
    chance = float((share ** 2).sum(1).mean() * experts / experts) * k
    chance = min(1.0, float(np.mean([(share[l] * (1 - (1 - share[l]) ** k)).sum() for l in range(L)])))
    return {"top2_share": float(top2), "busiest_vs_mean": float(busiest), "reuse": float(same),
            "reuse_chance": chance, "reuse_ratio": float(same / chance)}
