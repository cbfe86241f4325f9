"""``kvfleet block-service``'s settings, each declared once (``kvfleet.core.settings``): its flags are
generated from ``BlockServiceSettings``, and a bad value, or two settings that cannot go together,
is one line before the log is recovered. A new setting is one field here. Pure: no grpc."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.block_service.eviction import AUTO, NAMES
from kvfleet.core.metrics_server import metrics_port_setting
from kvfleet.core.settings import check, setting
from kvfleet.core.tls_settings import InternalTls, health_port_setting

DURABILITIES = ("fsync", "write", "off")


def duration(value: object) -> float:
    """``3600``, ``90s``, ``5m``, ``1h`` -> seconds (positive)."""
    text = str(value).strip()
    units = {"s": 1, "m": 60, "h": 3600}
    scale = units.get(text[-1:].lower(), 1)
    try:
        seconds = float(text[:-1] if text[-1:].lower() in units else text) * scale
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (seconds, or 30s / 5m / 1h)") from None
    if not seconds > 0:
        raise ValueError(f"a duration must be positive, got {text!r}")
    return seconds


def _duration_of(flag: str):
    def parse(value: object) -> float:
        try:
            return duration(value)
        except ValueError as err:
            raise ValueError(f"{flag}: {err}") from None
    return parse


@dataclass(slots=True)
class EvictionSettings:
    """Which cached block a full pool gives up (``kvfleet.block_service.eviction``): block_service's own
    setting, and ``kvfleet up``'s, which passes it on."""

    eviction_policy: str = setting(AUTO, "which cached KV block a full pool evicts: lru, value (hits x "
                                   "prefill saved, aged), fair (the tenant furthest over its cache_share_mib first), "
                                   "fair+value; auto: the state directory's policy, else fair; a state directory "
                                   "keeps the policy it was written under", choices=(AUTO, *NAMES))

    def configured(self) -> str | None:
        """The policy asked for, or None (``auto``): the state directory's, else the default."""
        return None if self.eviction_policy == AUTO else self.eviction_policy

    def __post_init__(self) -> None:
        check(self)


@dataclass(slots=True)
class BlockServiceSettings:
    """``kvfleet block-service``: where it serves, how durably, and whether it is one of two replicas."""

    listen: str = setting("127.0.0.1:50051", "address to serve on (host:port)", metavar="ADDR")
    state_dir: str = setting(".state/block_service", "snapshots and write-ahead log", metavar="DIR")
    tenants: str | None = setting(None, "tenants YAML (the router's format); replaces the set", metavar="FILE")
    durability: str = setting("fsync", "fsync the log before answering, only write it, or keep no log",
                              choices=DURABILITIES)
    snapshot_interval_s: float = setting(3600.0, "a full snapshot this often (seconds, or 30s / 5m / 1h)",
                                         parse=_duration_of("--snapshot-interval-s"),
                                         aliases=("--snapshot-interval",), metavar="DURATION")
    backup_dir: str | None = setting(None, "ship the latest snapshot and the log since to DIR (disaster recovery)",
                                     metavar="DIR")
    log_ship_interval: float = setting(300.0, "ship the log to --backup-dir this often",
                                       parse=_duration_of("--log-ship-interval"), metavar="DURATION")
    snapshot_log_mib: float = setting(1024.0, "also snapshot when the log grows past this size", above=0,
                                      metavar="MIB")
    etcd: str | None = setting(None, "run as one of several replicas: elect the leader in this etcd "
                               "(http://host:port; several members comma-separated)", metavar="URL[,URL...]")
    advertise: str | None = setting(None, "the address the other replicas and the clients reach this one at",
                                    unset="--listen", metavar="HOST:PORT")
    standby: bool = setting(False, "with --etcd: start as a standby; campaign only after following a leader once")
    sync_standby: bool = setting(False, "with --etcd: acknowledge a change only once a standby in sync holds it too "
                                 "(none in sync: acknowledged once durable here, with a WARNING)")
    sync_timeout: float = setting(2.0, "the most a change waits for the standby before it falls out of sync",
                                  parse=_duration_of("--sync-timeout"), metavar="DURATION")
    lease_ttl: int = setting(5, "with --etcd: the leader lease in seconds; a dead leader is replaced within it",
                             at_least=1, metavar="S")
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    tls: InternalTls = field(default_factory=InternalTls)
    eviction: EvictionSettings = field(default_factory=EvictionSettings)

    def __post_init__(self) -> None:
        check(self)
        if self.backup_dir and self.durability == "off":
            raise ValueError("--backup-dir ships the log: it needs --durability fsync or write")
        if self.etcd and self.durability == "off":
            raise ValueError("--etcd replicates the log: it needs --durability fsync or write")
        if not self.etcd and (self.standby or self.sync_standby):
            raise ValueError("--standby and --sync-standby need --etcd (the replicas elect their leader there)")
        if self.etcd and self.lease_ttl < 2:
            raise ValueError(f"--lease-ttl must be at least 2 seconds with --etcd, got {self.lease_ttl}")
