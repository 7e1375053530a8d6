"""RequestGuard: what an expert accepts from trainers, judged on the values sent.

Every trainer's gradients move weights that the whole swarm shares, so one faulty or
malicious trainer must not be able to wreck them. The guard sits between decoding and
the queue:

* inputs and gradients with NaN or infinity are refused (``Rejected``);
* each expert remembers the norms of the last ``window`` gradient rows it accepted
  (one row per sample). Once ``warmup`` rows are known, a row whose norm is above both
  ``median + max_deviations * 1.4826 * MAD`` and the 99th percentile of those norms
  is an outlier: it is scaled down to that
  threshold ("clip", the default) or the request is refused ("reject"). A request whose
  largest row is ``reject_ratio`` times the threshold is refused either way: it is no
  accident.

What was clipped or refused is counted per peer and reason. The guard runs on the event
loop on CPU tensors; its cost is a norm per row and a median of ``window`` floats.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Sequence

import torch

from volunteerd.config import GuardConfig
from volunteerd.errors import Rejected

__all__ = ["RequestGuard"]

logger = logging.getLogger(__name__)

# The MAD of a normal distribution times this is its standard deviation.
_MAD_TO_SIGMA = 1.4826


class RequestGuard:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self._norms: dict[str, deque[float]] = {}
        # (peer id, reason) -> count; reasons: non_finite_input, non_finite_gradient,
        # outlier_gradient (refused), clipped (accepted after scaling down)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.accepted = 0

    def check_inputs(self, uid: str, peer_id: str, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse inputs that are not all finite."""
        if not all(_finite(t) for t in tensors):
            self._refuse(uid, peer_id, "non_finite_input", "inputs are not all finite")

    def filter_gradients(
        self, uid: str, peer_id: str, grads: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The gradients to apply: refused (``Rejected``) or with outlier rows clipped."""
        if not all(_finite(g) for g in grads):
            self._refuse(uid, peer_id, "non_finite_gradient", "gradients are not all finite")
        norms = _row_norms(grads)
        history = self._norms.setdefault(uid, deque(maxlen=self.config.window))
        threshold = self.threshold(uid)
        out = list(grads)
        if threshold is not None and norms.numel() and float(norms.max()) > threshold:
            top = float(norms.max())
            if self.config.outliers == "reject" or top > self.config.reject_ratio * threshold:
                self._refuse(
                    uid,
                    peer_id,
                    "outlier_gradient",
                    f"gradient norm {top:.3g} is far above what this expert gets "
                    f"(threshold {threshold:.3g})",
                )
            scale = (threshold / norms.clamp_min(1e-30)).clamp(max=1.0)
            out = [(g.float() * scale.view(-1, *[1] * (g.dim() - 1))).to(g.dtype) for g in grads]
            norms = norms * scale
            self.counts[(peer_id, "clipped")] += 1
        history.extend(norms.tolist())
        self.accepted += 1
        return out

    def threshold(self, uid: str) -> float | None:
        """The largest row norm accepted as is, or None while warming up."""
        history = self._norms.get(uid)
        if history is None or len(history) < self.config.warmup:
            return None
        values = torch.tensor(history, dtype=torch.float64)
        median = float(values.median())
        mad = float((values - median).abs().median())
        spread = max(mad * _MAD_TO_SIGMA, 1e-3 * median, 1e-12)
        # Honest row norms are heavy-tailed (a token's gradient scales with its gate
        # weight, and many weights are tiny), so the median and MAD alone can sit far
        # below rows that are perfectly normal: never judge below the 99th percentile
        # of what was accepted.
        high = float(torch.quantile(values, 0.99))
        return max(median + self.config.max_deviations * spread, high)

    def by_peer(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (peer, reason), count in self.counts.items():
            out.setdefault(peer, {})[reason] = count
        return out

    def _refuse(self, uid: str, peer_id: str, reason: str, message: str) -> None:
        self.counts[(peer_id, reason)] += 1
        logger.info("refused a request for %s from …%s: %s", uid, peer_id[-8:], message)
        raise Rejected(f"{uid}: {message}")


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _row_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One norm per sample over all gradient tensors."""
    squares = [g.float().reshape(g.shape[0], -1).square().sum(dim=1) for g in grads if g.dim()]
    if not squares:
        return torch.zeros(0)
    return torch.stack(squares).sum(dim=0).sqrt()
