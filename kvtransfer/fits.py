"""Linear models fitted online: least squares over the most recent observations, starting from a prior. The
cost model's prefill, pull and contention fits are these (`kvtransfer/cost_model.py`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


class OnlineLinearFit:
    """Non-negative least squares over a sliding window of (features, y) samples."""

    def __init__(self, names: Sequence[str], prior: Sequence[float], window: int = 64) -> None:
        self.names = tuple(names)
        self.coef = np.asarray(prior, dtype=float)
        self.samples: deque[tuple[np.ndarray, float]] = deque(maxlen=window)

    def observe(self, features: Sequence[float], y: float) -> None:
        self.samples.append((np.asarray(features, dtype=float), float(y)))
        if len(self.samples) >= len(self.names):
            self._refit()

    @property
    def coef(self) -> np.ndarray:
        return self._coef

    @coef.setter
    def coef(self, value: Sequence[float]) -> None:
        self._coef = np.asarray(value, dtype=float)
        self._terms = self._coef.tolist()

    def predict(self, features: Sequence[float]) -> float:
        # Over Python floats, in numpy's order: the planner predicts per option, and numpy's dot of three features
        # costs twice this loop.
        y = 0.0
        for c, f in zip(self._terms, features, strict=True):
            y += c * f
        return y

    def _refit(self) -> None:
        x = np.stack([f for f, _ in self.samples])
        y = np.array([v for _, v in self.samples])
        active = list(range(len(self.names)))
        # Drop features whose coefficient comes out negative (a negative per-token cost is noise).
        while active:
            coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (coef >= 0).all():
                full = np.zeros(len(self.names))
                full[active] = coef
                self.coef = full
                return
            active.pop(int(np.argmin(coef)))

    def as_dict(self) -> dict[str, float]:
        return {n: float(c) for n, c in zip(self.names, self.coef, strict=True)} | {"samples": len(self.samples)}
