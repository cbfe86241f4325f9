"""Whether this node has not heard from block_service's leader long enough to say so. Pure.

    etcd names a leader ─────────────────────────────▶ heard from it now (it gets a whole threshold)
    a probe answered (any answer but UNAVAILABLE or
      DEADLINE_EXCEEDED) ───────────────────────────▶ heard from it now; the probes before it are moot
    a probe failed: its whole threshold went by
      unanswered (DEADLINE_EXCEEDED), waiting for the
      channel to (re)connect too ──────────────────▶ evidence
    a probe cut short (UNAVAILABLE: its connection
      broke under it) ─────────────────────────────▶ no evidence either way
    nothing heard for ``threshold_s``, and
      ``FAILED_PROBES`` probes sent since the last
      answer failed ───────────────────────────────▶ complain: "I cannot reach <leader>"
    etcd names another leader (or none) ─────────────▶ start over, about that one

Probes go out every threshold/``PROBES_PER_THRESHOLD``, each given the whole threshold to answer
and waiting for the channel meanwhile (gRPC's wait-for-ready): a complaint takes two probes in a
row, a third of a threshold apart, that each went a whole threshold unanswered, so the link gave
nothing back for 4/3 of the threshold. A lossy link that still delivers is not a cut, and neither is
one reconnect across it: the probes its broken connection cut short say nothing, and those after
wait for the new connection (over the lossy soak's link, a connection reset at its onset used to
read as a cut: the short probes counted as silence and every node complained at once). The price:
a cut is complained of when the second failure lands, 5/3 of a threshold after the last answer
(2.5 s at TTL 3; it was 1-4/3 of a threshold), weighed as soon as a probe fails, not at the next
tick. A complaint is about one leader: it ends when that leader answers or etcd names another, so
it never outlives the term it was about. The threshold is half the leader's lease TTL (at least
``MIN_THRESHOLD_S``): the step-down it may lead to (``kvfleet.block_service.step_down``) then costs about
one TTL, like a leader that died.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_THRESHOLD_S = 1.0
PROBES_PER_THRESHOLD = 3
FAILED_PROBES = 2  # probes in a row, since the last answer, that each went a whole threshold unanswered


def threshold_for(ttl_s: int) -> float:
    """How long a node waits without an answer from a leader whose lease has ``ttl_s``."""
    return max(ttl_s / 2, MIN_THRESHOLD_S)


@dataclass(slots=True)
class LeaderReach:
    threshold_s: float = MIN_THRESHOLD_S
    leader: str | None = None   # the leader's address as etcd names it; None: none leads
    heard_at: float = 0.0       # its last answer, or when etcd named it
    num_sent: int = 0           # probes sent (of any leader): each probe's number
    answered_upto: int = 0      # the probes up to this number say nothing more (answered, or of an earlier leader)
    failed: set[int] = field(default_factory=set)  # probes after that one that went their whole time unanswered

    def follow(self, leader: str | None, threshold_s: float, now: float) -> None:
        """etcd names ``leader`` (maybe the same as before): a new one starts with a clean slate."""
        if leader != self.leader:
            self.leader, self.heard_at, self.answered_upto = leader, now, self.num_sent
            self.failed.clear()
        self.threshold_s = threshold_s

    def sent(self, leader: str) -> int:
        """A probe of ``leader`` goes out now: its number, for ``answered`` or ``failed``."""
        self.num_sent += 1
        return self.num_sent

    def answered(self, leader: str, probe: int, now: float) -> None:
        if leader == self.leader:
            self.heard_at = max(self.heard_at, now)
            self.answered_upto = max(self.answered_upto, probe)
            self.failed = {p for p in self.failed if p > self.answered_upto}

    def expired(self, leader: str, probe: int) -> None:
        """Probe ``probe`` of ``leader`` went its whole time without an answer."""
        if leader == self.leader and probe > self.answered_upto:
            self.failed.add(probe)

    def complaint(self, now: float) -> str | None:
        """The leader this node cannot reach now (its address), or None."""
        if self.leader is None or len(self.failed) < FAILED_PROBES:
            return None
        return self.leader if now - self.heard_at >= self.threshold_s else None
