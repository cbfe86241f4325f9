"""Per-request outcomes of each group, for ``kvfleet canary report``'s bootstrap. Pure.

Prometheus histograms hold bucket counts, not samples: a bootstrap needs the requests themselves
(resampled whole, so a request's inter-token gaps stay together). So the router keeps each group's
last ``capacity`` outcomes in a ring buffer and serves them as JSON next to its metrics
(``/canary/samples`` on the metrics port); the report merges every router replica's.

    Outcome: group, started_at / ended_at (unix s), ttft_s (None: no token), up to MAX_GAPS
             inter-token gaps, prompt / cached / completion tokens, error (a status name, "" when
             it finished)

``OutcomeTimer`` watches one request's chunks (the relay's ``GenerateChunk``s) and makes its Outcome.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_GAPS = 256       # inter-token gaps kept per request (the first ones: a long answer's tail adds little)
DEFAULT_CAPACITY = 4096


@dataclass(slots=True, frozen=True)
class Outcome:
    group: str
    started_at: float
    ended_at: float
    ttft_s: float | None
    # float32, 4 bytes a gap: a full ring of floats as objects (~32 bytes each) held ~33 MB per group
    gaps_s: array = field(default_factory=lambda: array("f"))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    def to_dict(self) -> dict:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields["gaps_s"] = [round(g, 6) for g in self.gaps_s]
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> Outcome:
        return cls(**{**{k: fields[k] for k in fields if k in cls.__dataclass_fields__},
                      "gaps_s": array("f", fields.get("gaps_s", ()))})


@dataclass(slots=True)
class GroupSamples:
    """The last ``capacity`` outcomes of each group."""

    capacity: int = DEFAULT_CAPACITY
    by_group: dict[str, deque[Outcome]] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        ring = self.by_group.get(outcome.group)
        if ring is None:
            ring = self.by_group[outcome.group] = deque(maxlen=self.capacity)
        ring.append(outcome)

    def clear(self) -> None:
        """Forget every outcome (a new split starts a new comparison)."""
        self.by_group.clear()

    def to_json(self, **extra) -> dict:
        return {**extra, "groups": {g: [o.to_dict() for o in ring] for g, ring in self.by_group.items()}}


class OutcomeTimer:
    """One request's outcome, from its chunks as they pass (``chunk(...)``) and its end (``done``)."""

    def __init__(self, group: str, clock: Callable[[], float] = time.time):
        self.group, self.clock = group, clock
        self.started_at = clock()
        self._last: float | None = None
        self._ttft: float | None = None
        self._gaps: list[float] = []
        self._usage = (0, 0, 0)

    def chunk(self, num_tokens: int, usage: tuple[int, int, int] | None = None) -> None:
        """A chunk with ``num_tokens`` new tokens; ``usage`` (prompt, cached, completion) on the last."""
        now = self.clock()
        if num_tokens:
            if self._ttft is None:
                self._ttft = now - self.started_at
            elif len(self._gaps) < MAX_GAPS:
                # a chunk of k tokens after a gap g: k tokens at g / k each (stream_interval > 1)
                self._gaps.extend([(now - self._last) / num_tokens] * min(num_tokens, MAX_GAPS - len(self._gaps)))
            self._last = now
        if usage is not None:
            self._usage = usage

    def done(self, error: str = "") -> Outcome:
        prompt, cached, completion = self._usage
        return Outcome(self.group, self.started_at, self.clock(), self._ttft, array("f", self._gaps), prompt, cached,
                       completion, error)
