"""A compute node's settings, each declared once (``kvfleet.core.settings``): ``kvfleet compute``'s flags,
``kvfleet up``'s node flags, a config file's keys and the local cluster's argv for its nodes are all
generated from these classes.

    NodeCommand            one ``kvfleet compute`` command line: where the node is, whom it talks to
      settings: NodeSettings    what every node of a cluster takes alike (``kvfleet up`` passes them on)
        engine: EngineConfig        the engine's (``kvfleet.compute_service.engine.config``)
        warm_start: WarmStartSettings
        kv_fetch: KvFetchSettings   KV from peers (``node/fetch_policy.py``)

Pure: no torch, no grpc, so a bad value is refused before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.node.fetch_policy import KvFetchSettings
from kvfleet.core.groups import STABLE, check_group
from kvfleet.core.metrics_server import metrics_port_setting
from kvfleet.core.roles import MIXED, ROLES
from kvfleet.core.settings import SettingError, check, setting
from kvfleet.core.tls_settings import InternalTls, health_port_setting

DEFAULT_SNAPSHOT_BLOCKS = 128
WARMUP_PROMPTS = 4
WARMUPS = ("minimal", "random")


@dataclass(slots=True)
class WarmStartSettings:
    """warm start: KV snapshots and the warm-up before READY"""

    kv_snapshot_dir: str | None = setting(
        None, "directory of this node's KV snapshot (kv-snapshot-<node id>.safetensors): its most reused blocks, "
              "written on drain and every --kv-snapshot-interval-s, restored at start when model, dtypes, block "
              "size and hash seed match", unset="off", metavar="DIR")
    kv_snapshot_interval_s: float = setting(300.0, "seconds between snapshots while serving (0: only on drain)",
                                            at_least=0, metavar="S")
    kv_snapshot_blocks: int = setting(DEFAULT_SNAPSHOT_BLOCKS, "the most blocks a snapshot holds", at_least=1,
                                      metavar="N")
    warmup: str = setting("minimal", "minimal: touch every kernel path before READY; random: then also prefill "
                          f"{WARMUP_PROMPTS} random prompts of --warmup-tokens tokens together", choices=WARMUPS)
    warmup_tokens: int = setting(1024, "tokens per random warm-up prompt (at most max_model_len - 8)", at_least=1,
                                 metavar="N")

    def __post_init__(self) -> None:
        check(self)


@dataclass(slots=True)
class NodeSettings:
    """the node: streaming, batching control, drain, reconciliation (every node of a cluster takes the same)"""

    engine: EngineConfig = field(default_factory=EngineConfig)
    stream_interval: int = setting(1, "tokens per streamed chunk (1: every token as soon as it exists)", at_least=1,
                                   metavar="TOKENS")
    batch_wait_ms: float = setting(5.0, "an idle node holds its first step while requests keep arriving less than "
                                   "this many ms apart (at most 10 times it), so a burst is scheduled as one batch "
                                   "(a burst's requests reach a busy router's node up to ~5 ms apart); 0: off",
                                   at_least=0, metavar="MS")
    p99_itl_target_ms: float | None = setting(
        None, "hold the p99 inter-token latency near MS: every --control-interval-s the live cap on running "
              "sequences moves x0.9 when over, x1.1 (up to --max-num-seqs) when well under, and each step's token "
              "budget with it in proportion; requests above it wait, and the router sees the reduced capacity",
        unset="off", above=0, metavar="MS")
    control_interval_s: float = setting(2.0, "seconds between the P99 controller's decisions (its window is 10 of "
                                        "them)", above=0, metavar="S")
    drain_timeout: float = setting(60.0, "seconds to let requests finish on SIGTERM", at_least=0, metavar="S")
    reconcile_interval: float = setting(30.0, "seconds between reconciliations of this node's blocks with "
                                        "block_service (block_service releases what the node no longer holds)",
                                        above=0, metavar="S")
    warm_start: WarmStartSettings = field(default_factory=WarmStartSettings)
    kv_fetch: KvFetchSettings = field(default_factory=KvFetchSettings)

    def __post_init__(self) -> None:
        check(self)


@dataclass(slots=True)
class NodeCommand:
    """``kvfleet compute``: one node's place in the cluster, and its settings."""

    model: str = setting(help="Hugging Face-format model directory", metavar="DIR")
    node_id: str = setting(help="this node's id in etcd and block_service", metavar="ID")
    listen: str = setting("127.0.0.1:0", "host:port to serve Compute on (port 0: any)", metavar="ADDR")
    advertise: str | None = setting(None, "host:port the router should dial",
                                    unset="--listen with the bound port", metavar="ADDR")
    block_service: str | None = setting(
        None, "block_service host:port, or 'etcd': the leader elected in --etcd (with --etcd a fixed address is left "
              "for the leader too once one is elected)", unset="an in-process page table, for one node alone",
        metavar="ADDR|etcd")
    etcd: str | None = setting(None, "etcd URL to register in, e.g. http://127.0.0.1:2379; several members comma-"
                               "separated", unset="none, no membership", metavar="URL[,URL...]")
    lease_ttl: int = setting(5, "etcd lease seconds", at_least=1, metavar="S")
    role: str = setting(MIXED, "mixed: prefill and decode; prefill: compute prompts and their first token, then hand "
                        "the sequence to a decode node; decode: continue handed-over sequences, and short prompts",
                        choices=ROLES)
    group: str = setting(STABLE, "the node group (the configuration it runs): the router sends the nodes of group "
                         "canary the share of conversations `kvfleet canary start` sets, the others the rest",
                         metavar="NAME")
    port_file: str | None = setting(None, "write the bound port here once READY", metavar="FILE")
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    tls: InternalTls = field(default_factory=InternalTls)
    dependency_timeout: float = setting(60.0, "seconds to wait at start for etcd and block_service to answer before "
                                        "giving up (once started, the node waits for them as long as it takes)",
                                        above=0, metavar="S")
    settings: NodeSettings = field(default_factory=NodeSettings)

    def __post_init__(self) -> None:
        check(self)
        try:
            check_group(self.group)
        except ValueError as e:
            raise SettingError(f"--{e}") from None

    def engine_config(self) -> EngineConfig:
        """The engine's settings, under this node's id."""
        return replace(self.settings.engine, node_id=self.node_id)
