"""What the load generator sends: prompt lengths in tokens of the served model, drawn from a
length distribution (``--mix 0.2:8k,0.8:128k``), shrunk by ``--scale`` for small machines.

Prompts are token ids, not text, so that a prompt of n tokens is n tokens of the served model
exactly (no tokenizer round trip can change its length); the router reports its count back in each
request's usage, and the records keep both. Ids are drawn from the model's vocabulary (seeded), so
prompts share no prefix: every request pays its own prefill, the stress case.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SUFFIXES = {"k": 1024, "m": 1024 * 1024}


def parse_tokens(text: str) -> int:
    """``512`` → 512, ``8k`` → 8192, ``128K`` → 131072."""
    t = text.strip().lower()
    factor = SUFFIXES.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in SUFFIXES else t
    try:
        value = float(number) * factor
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (e.g. 512, 8k, 128k)") from None
    if value < 1 or value != int(value):
        raise ValueError(f"a token count must be a positive whole number, got {text!r}")
    return int(value)


@dataclass(slots=True, frozen=True)
class Mix:
    """Prompt lengths and their weights (normalised to sum 1)."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]

    def __post_init__(self):
        assert len(self.lengths) == len(self.weights) > 0
        assert all(n >= 1 for n in self.lengths) and abs(sum(self.weights) - 1) < 1e-9

    @classmethod
    def parse(cls, text: str) -> Mix:
        """``0.2:8k,0.8:128k`` (weight:length, comma-separated; weights need not sum to 1)."""
        pairs = []
        for part in text.split(","):
            weight, sep, length = part.partition(":")
            if not sep:
                raise ValueError(f"--mix takes weight:length pairs, e.g. 0.2:8k,0.8:128k; got {part!r}")
            try:
                w = float(weight)
            except ValueError:
                raise ValueError(f"not a weight: {weight!r} in --mix") from None
            if w <= 0:
                raise ValueError(f"weights in --mix must be positive, got {weight!r}")
            pairs.append((w, parse_tokens(length)))
        total = sum(w for w, _ in pairs)
        return cls(tuple(n for _, n in pairs), tuple(w / total for w, _ in pairs))

    @classmethod
    def single(cls, length: int) -> Mix:
        return cls((length,), (1.0,))

    def scaled(self, scale: float) -> Mix:
        """Every length times ``scale`` (at least one token)."""
        return Mix(tuple(max(1, round(n * scale)) for n in self.lengths), self.weights)

    def describe(self) -> str:
        return ",".join(f"{w:g}:{n}" for w, n in zip(self.weights, self.lengths))


@dataclass(slots=True, frozen=True)
class Shape:
    """One request: its prompt (token ids) and how many tokens to generate."""

    prompt: tuple[int, ...]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


class Workload:
    """An endless, seeded source of request shapes for one phase."""

    def __init__(self, mix: Mix, max_tokens: int, vocab_size: int, seed: int = 0):
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
        self.mix = mix
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def next(self) -> Shape:
        n = self._rng.choices(self.mix.lengths, self.mix.weights)[0]
        return Shape(tuple(self._rng.randrange(self.vocab_size) for _ in range(n)), self.max_tokens)
