"""compute_service: loads a Hugging Face-format model and serves it with continuous batching over a
paged KV pool. Rooms: ``engine`` (``engine.llm_engine.LLMEngine`` is the in-process entry point),
``kv`` (the pool, its tiers and snapshots), ``model`` (loading and the decoder), ``blocks`` (the link to
block_service's page table) and ``node`` (``kvfleet compute``: the process, its gRPC service, metrics)."""
