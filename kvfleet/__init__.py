"""kvfleet: the ground floor every service stands on — block hashing, wire conventions, ids, the
allocator contract, sampling parameters, tenants, errors, tracing, etcd membership and leader reads,
metrics plumbing and the generated protocol stubs. The command line lives in ``kvfleet_cli``.

Generated gRPC stubs live in ``kvfleet/v1/`` (git-ignored) and are built from ``protos/`` by
``make protos``.
"""

__version__ = "0.1.0"
