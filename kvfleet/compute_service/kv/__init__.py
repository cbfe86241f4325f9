"""The KV room: the node's paged pool (its dtype, block-size rules, sizing, the preallocated tensors),
the per-sequence cache manager the scheduler calls, the lower tiers (host memory and disk: an index of
which block lives where, and the store that performs its copies) and KV snapshots (which blocks, the
file, the way back into the pool). Pure parts (``layout``, ``cache_dtype``, ``tier_index``,
``tier_flags``, ``snapshot``, ``block_usage``) import no torch; the ones that hold tensors say so."""
