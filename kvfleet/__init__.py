"""kvfleet: shared pieces of the services (command line, block hashing, generated protocol stubs).

Generated gRPC stubs live in ``kvfleet/v1/`` (git-ignored) and are built from ``protos/`` by
``make protos``.
"""

__version__ = "0.1.0"
