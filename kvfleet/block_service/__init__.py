"""block_service: the fleet's page table (pure core), its durable log, and the gRPC service around it.

``page_table.PageTable`` is the core (no torch, no grpc); ``local_allocator.LocalBlockAllocator``
serves one node of it to an in-process engine through ``allocator.BlockAllocator``. Import the
modules directly; this package imports nothing on purpose.
"""
