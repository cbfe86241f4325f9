"""The engine room: ``llm_engine.LLMEngine`` serves a model in-process with continuous batching. The
scheduler (pure) decides which sequences run each step and how many tokens each; the model runner packs
them into one forward pass over the paged pool; the sampler picks the next tokens; ``AsyncEngine`` runs
the step loop in one thread for asyncio callers. The P99 batch controller, the thread governor and the
swap-or-recompute rule are the engine's own policies, each pure with a thin torch or timing probe beside
it. The engine reaches the KV pool only through ``kvfleet.compute_service.kv`` and block_service only through the
``kvfleet.core.allocator`` contract."""
