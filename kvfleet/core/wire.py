"""Conventions of the wire shared by the router and the compute nodes (pure: no grpc import).

Proto3 cannot tell an unset number from zero, so the API's zero values mean "off": ``top_p`` 0 → 1
(disabled), ``seed`` 0 → no seed; ``max_tokens`` has no sensible "off" and must be at least 1.
"""

from __future__ import annotations

from kvfleet.core.sampling import SamplingParams


class InvalidRequest(ValueError):
    """A field of the request is wrong; the message says which and why."""


def sampling_from_proto(s) -> SamplingParams:
    """``kvfleet.v1.SamplingParams`` → ``SamplingParams`` (which validates); raises InvalidRequest."""
    try:
        return SamplingParams(
            max_tokens=int(s.max_tokens),
            temperature=float(s.temperature),
            top_p=float(s.top_p) if s.top_p != 0 else 1.0,
            top_k=int(s.top_k),
            seed=int(s.seed) if s.seed else None,
            stop=tuple(s.stop),
            ignore_eos=bool(s.ignore_eos),
        )
    except ValueError as e:
        raise InvalidRequest(f"sampling.{e}") from None


def sampling_to_proto(p: SamplingParams, message) -> None:
    """Fill the ``kvfleet.v1.SamplingParams`` ``message`` from ``p``."""
    message.max_tokens = p.max_tokens
    message.temperature = p.temperature
    message.top_p = p.top_p
    message.top_k = p.top_k
    message.seed = p.seed or 0
    message.stop[:] = list(p.stop)
    message.ignore_eos = p.ignore_eos
