"""The ground floor every service stands on: block hashing, wire conventions, ids, the allocator
contract, sampling parameters, tenants, errors, tracing, etcd membership and leader reads, metrics
plumbing. The generated protocol stubs beside it are ``kvfleet.v1``."""
