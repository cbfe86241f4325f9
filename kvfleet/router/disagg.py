"""Prefill and decode on separate nodes: which nodes a request's next attempt may go to, and whether
its prompt is prefilled on a prefill node and then handed over. Pure.

    a request arrives ─▶ prefill nodes READY, a node to decode on READY, nothing sent yet, more
                         than one token wanted, and its uncached part ≥ min_uncached_tokens?
        yes ─▶ a prefill node (KV-aware among them) computes the prompt and the first token, which
               goes to the client at once ─▶ hand-over: a decode-capable node (KV-aware: the most
               of the prompt, then the least load) continues from prompt + first token, fetching
               the prompt's KV from the prefill node (``kv_source_node_id``) ─▶ the rest streams
        no  ─▶ it runs where it lands among the decode and mixed nodes, as without prefill nodes

A prompt mostly cached somewhere gains nothing from a prefill node (the KV to move costs more than
the little prefill left), so the uncached part decides, measured against the best decode-capable
node. Prefill nodes take nothing but prefills; when no decode-capable node is READY they serve
whole requests rather than none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.core.roles import PREFILL
from kvfleet.core.settings import check, setting


@dataclass(slots=True, frozen=True)
class DisaggConfig:
    """disaggregation: prefill nodes (``--role prefill``) compute long prompts, decode nodes continue"""

    disagg_min_uncached_tokens: int = setting(
        512, "a prompt whose part cached on no decode-capable node is at least this many tokens is prefilled on a "
             "prefill node and handed over (shorter ones run where they land: moving their KV costs more than it "
             "saves)", at_least=1, metavar="TOKENS")

    def __post_init__(self) -> None:
        check(self)


def serving_nodes(nodes: Sequence) -> list:
    """The nodes a whole request (or a hand-over) goes to: all but the prefill nodes (when none is
    left, the caller lets the prefill nodes serve whole requests rather than none)."""
    return [n for n in nodes if n.info.role != PREFILL]


def prefill_nodes(nodes: Sequence) -> list:
    return [n for n in nodes if n.info.role == PREFILL]


def hand_over(config: DisaggConfig, num_prompt_tokens: int, best_cached_tokens: int, num_prefill_nodes: int,
              num_serving_nodes: int, tokens_sent: int, max_tokens: int, handed_over: bool) -> bool:
    """Whether this attempt prefills on a prefill node and hands the sequence over after its first
    token: only a fresh request (nothing sent, not handed over yet) that wants more than one token,
    with prefill and decode-capable nodes READY, and enough of its prompt uncached everywhere it
    could decode."""
    if handed_over or tokens_sent or max_tokens <= 1 or not num_prefill_nodes or not num_serving_nodes:
        return False
    return num_prompt_tokens - best_cached_tokens >= config.disagg_min_uncached_tokens
