"""The world of the allocator accounting machine (``test_allocator_accounting_stateful.py``): its
sizes, its tenants and prompts, the fates of an RPC, and one request as its stream and the engine see
it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvfleet.core.block_hash import reusable_blocks

NODE, NUM_BLOCKS, BS, BPB = "n0", 24, 16, 1 << 18   # four blocks per MiB
TENANTS = {"gold": None, "small": 1.5}               # quota in MiB: "small" gets six blocks
PROMPTS = [40, 40, 20, 33, 32]                        # tokens; the 40s share their two full blocks, 32 fills
                                                      # two exactly (its first decoded token needs a third)
FATES = ["ok"] * 6 + ["lost", "unapplied"]            # an RPC's answer; lost: applied, answer never came


class Lost(Exception):
    """The answer of an RPC made inside the engine's ``_call`` never came: its ``wait_for`` timed
    out and cancelled the coroutine where it stood."""


def block_hash(seq_id: str, prompt: int, i: int) -> bytes:
    """A prompt's full blocks are shared by every prompt of its length; generated blocks are not."""
    key = f"prompt{prompt}/{i}" if (i + 1) * BS <= prompt else f"{seq_id}/{i}"
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


@dataclass(slots=True)
class Request:
    """One request as its stream and the engine see it."""

    seq_id: str
    tenant: str
    prompt: int
    stage: str = "started"      # started (its task not run yet) → asking (preallocate awaits) → woken → submitted → gone
    ended: bool = False         # the stream ended (release_unclaimed done)
    in_engine: bool = False     # the engine holds the request (added, not finished or aborted)
    block_table: list[int] = field(default_factory=list)  # what the engine was handed
    length: int = 0             # tokens the engine allocated for
    committed: int = 0          # blocks the engine committed (or got as prefix hits)

    def hashes(self, num_tokens: int) -> list[bytes]:
        return [block_hash(self.seq_id, self.prompt, i) for i in range(reusable_blocks(num_tokens, BS))]
