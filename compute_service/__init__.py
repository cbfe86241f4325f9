"""compute_service: loads a Hugging Face-format model and serves it with continuous batching over a
paged KV pool. ``engine.LLMEngine`` is the in-process entry point."""
