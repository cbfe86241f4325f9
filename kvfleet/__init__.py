"""kvfleet: serve long-context LLMs from a fleet whose KV cache is managed as one.

Everything kvfleet ships imports under this one name, a floor a package (tests/test_floors.py):

    kvfleet.cli              the ``kvfleet`` command line, the local cluster, the demo    (top)
    kvfleet.router           the public doors: tenants, the priority queue, KV-aware routing
    kvfleet.compute_service  the engine and the node
    kvfleet.kernels          paged attention kernels (torch reference, native CPU, Triton)
    kvfleet.block_service    the page table and its service
    kvfleet.core             the ground every part stands on
    kvfleet.v1               the generated gRPC stubs (git-ignored; ``make protos``, or setup.py in a wheel)
"""

__version__ = "0.1.0"
