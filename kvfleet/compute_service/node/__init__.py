"""The node room: ``kvfleet compute`` (``main``) and a node's life in its event loop (``lifecycle``:
etcd membership, the block_service link, model load, warm start, serve, drain), the internal ``Compute``
gRPC service with its per-router streams and per-request state, Prometheus metrics, and the memory
probe. Only this room speaks gRPC to routers; it builds the engine from ``kvfleet.compute_service.engine``."""
