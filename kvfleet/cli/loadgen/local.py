"""A local cluster for the bench and the tune: ``LocalCluster`` with one tenant whose limits are out
of the way (no concurrency cap, a quota larger than any pool), so that what the load meets is the
cluster's own capacity, not the demo tenants' fences."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.cli.local_nodes import LOCAL_NODE_DEFAULTS
from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError

BENCH_KEY = "sk-bench"
BENCH_TENANTS = f"""\
tenants:
  - name: bench
    api_key: {BENCH_KEY}
    quota_mib: 1048576
    paid_level: 0
    max_concurrent: 0
"""


@dataclass(slots=True, frozen=True)
class ClusterShape:
    """What ``kvfleet up`` would be given: the flags the tune varies and writes out."""

    model: str
    nodes: int = 1
    block_size: int = LOCAL_NODE_DEFAULTS["block_size"]
    kv_cache_memory: int = LOCAL_NODE_DEFAULTS["kv_cache_memory"]
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        if self.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {self.nodes}")
        # the node settings' own rules, in their words (SettingError is a ValueError)
        EngineConfig(block_size=self.block_size, kv_cache_memory=self.kv_cache_memory,
                     kv_cache_dtype=self.kv_cache_dtype)


@dataclass(slots=True, frozen=True)
class ModelLimits:
    vocab_size: int
    max_positions: int


def model_limits(model_dir: str | Path) -> ModelLimits:
    """The served model's vocabulary and context length; ``ValueError`` with one line when the
    directory is not a model the engine loads."""
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model directory (no config.json)")
    try:
        config = ModelConfig.from_dir(model_dir)
    except ModelLoadError as err:
        raise ValueError(f"{model_dir}: {err}") from None
    return ModelLimits(config.vocab_size, config.max_context_len)


@contextlib.contextmanager
def running_cluster(shape: ClusterShape, start_timeout_s: float = 600.0,
                    log_level: str = "WARNING") -> Iterator[LocalCluster]:
    """A started cluster serving the bench tenant, stopped at the end of the block (its state goes,
    its logs stay in its temporary work directory)."""
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-tenants-") as tmp:
        tenants = Path(tmp) / "tenants.yaml"
        tenants.write_text(BENCH_TENANTS)
        cluster = LocalCluster(shape.model, shape.nodes, tenants, None, shape.block_size, shape.kv_cache_memory,
                               kv_cache_dtype=shape.kv_cache_dtype, log_level=log_level, http=False)
        cluster.start(start_timeout_s)  # this process samples block_service as its admin
        try:
            yield cluster
        finally:
            cluster.stop()


def process_ids(cluster: LocalCluster) -> dict[str, int]:
    """Name → pid of every process of the cluster now (etcd included), and this client's."""
    pids = {c.name: c.process.pid for c in cluster.children() if c.alive()}
    if cluster.etcd is not None and cluster.etcd.process is not None:
        pids["etcd"] = cluster.etcd.process.pid
    pids["bench client"] = os.getpid()
    return pids
