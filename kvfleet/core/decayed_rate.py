"""A rate (amount per second) measured from observations and kept current: older observations count
less, by half every ``half_life`` units of amount observed since. Pure.

    observe(amount, seconds):  A ← A·f + amount,  S ← S·f + seconds,  f = 0.5 ** (amount / half_life)
    per_s = A / S

The decay goes by amount, not by count: a thousand small observations age what came before them
as much as one large observation of the same total does, so the rate is what the last
``half_life`` or so of work ran at, however it was cut up.
"""

from __future__ import annotations


class DecayedRate:
    def __init__(self, half_life: float) -> None:
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = half_life
        self._amount = 0.0
        self._seconds = 0.0
        self.observations = 0

    def observe(self, amount: float, seconds: float) -> None:
        """``amount`` done in ``seconds``; ignored unless both are positive."""
        if amount <= 0 or seconds <= 0:
            return
        keep = 0.5 ** (amount / self.half_life)
        self._amount = self._amount * keep + amount
        self._seconds = self._seconds * keep + seconds
        self.observations += 1

    @property
    def per_s(self) -> float | None:
        """The rate now; None before the first observation."""
        return self._amount / self._seconds if self._seconds > 0 else None
