"""The public door of the cluster: authentication, admission by priority, KV-aware routing, relay."""
