"""Capacity planning for ``kvfleet plan``: model shapes, devices, the KV-memory arithmetic the
engine uses, and a roofline for hardware sizing. Pure: neither torch nor grpc."""
