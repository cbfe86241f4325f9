"""The node's side of the central page table: ``RemoteBlockAllocator`` serves the engine's
``kvfleet.core.allocator`` contract from block_service over gRPC, off the engine's critical path. The policy
(what to tell block_service and when, ``allocator_policy``), the link state, the resync and
reconciliation loops, the commits log and the tier-move queue are pure; registration and the RPCs are
the glue."""
