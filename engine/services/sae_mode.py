"""Which SAE hand-off a config asks for, and how it retries: read by the hand-off
(:mod:`engine.services.sae_handoff`) and by the Ray topology, which must know without loading
torch or an SAE whether SAE workers are to be started."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.config import SAEConfig
from engine.errors import ConfigError

__all__ = ["HandoffMode", "RetryPolicy", "handoff_mode"]

HandoffMode = Literal["inline", "thread", "ray-workers"]


def handoff_mode(sae: SAEConfig, *, ray: bool) -> HandoffMode:
    """The transport ``sae`` asks for: ``inline`` encodes in the loop wherever it runs; nearline is
    a background thread in one process, SAE worker actors on Ray (``ray``)."""
    if sae.mode == "inline":
        return "inline"
    return "ray-workers" if ray else "thread"


@dataclass(frozen=True)
class RetryPolicy:
    """How often a block is tried (``attempts`` in all, ≥ 1) and how long the hand-off waits before
    each retry (``backoff_s``, doubling per failure: a dying worker gets time to be replaced)."""

    attempts: int = 3
    backoff_s: float = 0.05

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"`attempts` must be >= 1, got {self.attempts!r}; set sae.retry_attempts",
                              parameter="attempts", value=self.attempts)
        if not self.backoff_s >= 0:
            raise ConfigError(f"`backoff_s` must be >= 0, got {self.backoff_s!r}; set sae.retry_backoff_s",
                              parameter="backoff_s", value=self.backoff_s)

    @classmethod
    def from_config(cls, sae: SAEConfig) -> "RetryPolicy":
        return cls(attempts=sae.retry_attempts, backoff_s=sae.retry_backoff_s)

    def delay_s(self, failures: int) -> float:
        """The wait before the retry that follows the ``failures``-th failed attempt."""
        return self.backoff_s * 2 ** (failures - 1)
