"""Prefill tokens per second on this engine, measured on its own steps and kept current (the cost
models that weigh a prefill against a copy read it: a peer fetch, kv_fetch's admission). Pure.

A step's time is its prefill's when the step is mostly prefill: at least ``min_tokens`` prompt
tokens and at least ``tokens_per_decode`` of them per decoding sequence batched with them (a
decode adds one token's work, so at 16 prompt tokens per decode the decodes are a few percent of
the step). The warm-up's prefills are the first observations, so the rate is known before READY.
"""

from __future__ import annotations

from kvfleet.core.decayed_rate import DecayedRate

HALF_LIFE_TOKENS = 32_768


class PrefillRate:
    def __init__(self, min_tokens: int = 32, tokens_per_decode: int = 16) -> None:
        self.min_tokens = min_tokens
        self.tokens_per_decode = tokens_per_decode
        self.rate = DecayedRate(HALF_LIFE_TOKENS)

    def observe(self, prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        """One step: ``prefill_tokens`` prompt tokens computed beside ``num_decodes`` decodes in ``seconds``."""
        if prefill_tokens >= self.min_tokens and prefill_tokens >= self.tokens_per_decode * num_decodes:
            self.rate.observe(prefill_tokens, seconds)

    @property
    def tokens_per_s(self) -> float | None:
        return self.rate.per_s
