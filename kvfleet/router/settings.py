"""``kvfleet router``'s settings, each declared once (``kvfleet.core.settings``): its flags are generated
from ``RouterSettings`` and a bad value is one line before anything starts. Pure: no grpc."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.core.metrics_server import metrics_port_setting
from kvfleet.core.settings import SettingError, check, setting
from kvfleet.core.tls_settings import InternalTls, health_port_setting
from kvfleet.router.disagg import DisaggConfig
from kvfleet.router.routing import RoutingConfig


@dataclass(slots=True)
class RouterSettings:
    """``kvfleet router``: the public doors, the queue and the routing weights."""

    etcd: str = setting(help="etcd URL, e.g. http://127.0.0.1:2379; several members comma-separated",
                        metavar="URL[,URL...]")
    tenants: str = setting(help="tenants YAML file", metavar="FILE")
    listen: str = setting("127.0.0.1:50051", "host:port to serve on (port 0: any)", metavar="ADDR")
    listen_unix: str | None = setting(None, "also serve on this Unix domain socket, for clients on the same machine "
                                      "(cheaper per streamed message than TCP loopback)", metavar="PATH")
    http_listen: str | None = setting(None, "also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) "
                                      "on host:port", metavar="ADDR")
    http_timeout_s: float = setting(600.0, "an HTTP request still unanswered after this long gets 504", above=0,
                                    metavar="S")
    block_service: str | None = setting(None, "block_service host:port (prefix lookups), or 'etcd': the leader "
                                        "elected in --etcd", unset="no prefix lookups", metavar="ADDR|etcd")
    model: str | None = setting(None, "model directory for the tokenizer", unset="the one the compute nodes advertise",
                                metavar="DIR")
    queue_size: int = setting(1024, "waiting requests before shedding", at_least=1, metavar="N")
    capacity: int | None = setting(None, "requests running at once across the cluster; requests above it wait here, "
                                   "by score", unset="the sum of the READY nodes' live caps on running sequences, from "
                                   "membership", at_least=1, metavar="N")
    w_paid: float = setting(0.6, "queue score weight of the paid level", at_least=0)
    w_wait: float = setting(0.4, "queue score weight of the waiting time", at_least=0)
    wait_scale_s: float = setting(10.0, "seconds of waiting worth one unit of the queue's wait term (at 10 a request "
                                  "is overtaken only by requests that arrive less than 15 s after it)", above=0,
                                  metavar="S")
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    stall_timeout_s: float = setting(120.0, "a node silent this long mid-request counts as failed (the request "
                                     "moves on)", above=0, metavar="S")
    port_file: str | None = setting(None, "write the bound port here once serving", metavar="FILE")
    dependency_timeout: float = setting(60.0, "seconds to wait at start for etcd (and block_service) to answer "
                                        "before giving up", above=0, metavar="S")
    metrics_port: int | None = metrics_port_setting()
    health_port: int | None = health_port_setting()
    tls_cert: str | None = setting(None, "serve the public doors (--listen, --listen-unix excepted, and --http-listen) "
                                   "over TLS with this certificate chain (PEM)", unset="plaintext, e.g. behind a "
                                   "TLS-terminating proxy", metavar="FILE")
    tls_key: str | None = setting(None, "the private key of --tls-cert (PEM)", unset="none", metavar="FILE")
    tls: InternalTls = field(default_factory=InternalTls)

    def __post_init__(self) -> None:
        check(self)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingError("--tls-cert and --tls-key go together")
