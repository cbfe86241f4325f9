"""Per-request sampling parameters, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_SEED = 2**64 - 1


@dataclass(slots=True, frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0         # 1 = disabled
    top_k: int = 0             # 0 = disabled
    seed: int | None = None    # reproducible sampling when set
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            raise ValueError("stop must be a list of strings, not a single string")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"each stop string must be a non-empty string of at most "
                                 f"{MAX_STOP_LENGTH} characters, got {s!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
