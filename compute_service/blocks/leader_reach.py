"""Whether this node has not heard from block_service's leader long enough to say so. Pure.

    etcd names a leader ─────────────────────────────▶ heard from it now (it gets a whole threshold)
    a probe answered (any answer but UNAVAILABLE or
      DEADLINE_EXCEEDED, which are silence) ──────────▶ heard from it now
    nothing heard for ``threshold_s``, while at least
      ``PROBES_PER_THRESHOLD`` probes went out ───────▶ complain: "I cannot reach <leader>"
    etcd names another leader (or none) ─────────────▶ start over, about that one

Probes go out every threshold/3, each given the whole threshold to answer, so a complaint takes
three probes in a row that all went unanswered, not one slow or lost one: a lossy link that still
delivers is not a cut. A complaint is about one leader: it ends when that leader answers or etcd
names another, so it never outlives the term it was about. The threshold is half the leader's lease
TTL (at least ``MIN_THRESHOLD_S``): the step-down it may lead to (``block_service.step_down``) then
costs about one TTL, like a leader that died.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_THRESHOLD_S = 1.0
PROBES_PER_THRESHOLD = 3


def threshold_for(ttl_s: int) -> float:
    """How long a node waits without an answer from a leader whose lease has ``ttl_s``."""
    return max(ttl_s / 2, MIN_THRESHOLD_S)


@dataclass(slots=True)
class LeaderReach:
    threshold_s: float = MIN_THRESHOLD_S
    leader: str | None = None   # the leader's address as etcd names it; None: none leads
    heard_at: float = 0.0       # its last answer, or when etcd named it
    num_unanswered: int = 0     # probes sent since then

    def follow(self, leader: str | None, threshold_s: float, now: float) -> None:
        """etcd names ``leader`` (maybe the same as before): a new one starts with a clean slate."""
        if leader != self.leader:
            self.leader, self.heard_at, self.num_unanswered = leader, now, 0
        self.threshold_s = threshold_s

    def sent(self, leader: str) -> None:
        if leader == self.leader:
            self.num_unanswered += 1

    def answered(self, leader: str, now: float) -> None:
        if leader == self.leader:
            self.heard_at, self.num_unanswered = max(self.heard_at, now), 0

    def complaint(self, now: float) -> str | None:
        """The leader this node cannot reach now (its address), or None."""
        if self.leader is None or self.num_unanswered < PROBES_PER_THRESHOLD:
            return None
        return self.leader if now - self.heard_at >= self.threshold_s else None
