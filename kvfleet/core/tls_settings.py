"""The internal-TLS settings every service shares (``kvfleet.core.settings``), declared once. Pure.

A service serves and calls its peers over mutual TLS with the certificate directory ``--certs``
names (``kvfleet.core.certs``: ca.crt, tls.crt, tls.key), or in plaintext with ``--insecure-internal``
(a laptop, a benchmark); one of the two must be chosen, checked when the service starts
(``kvfleet.core.tls.configure``) so that plaintext is never what a forgotten flag gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet.core.metrics_server import port_parser
from kvfleet.core.settings import SettingError, check, setting

WARN_DAYS = 14.0


@dataclass(slots=True)
class InternalTls:
    """Internal connections: mutual TLS under the cluster CA, or plaintext by choice."""

    certs: str | None = setting(None, "this service's certificate directory (ca.crt, tls.crt, tls.key; "
                                "`kvfleet certs issue`) for mutual TLS with its peers", unset="none", metavar="DIR")
    insecure_internal: bool = setting(False, "plaintext internal connections and no identities (a laptop, "
                                      "a benchmark); never on a shared network")
    cert_warn_days: float = setting(WARN_DAYS, "say so in the log and readiness this many days before the "
                                    "certificate expires", above=0, metavar="DAYS")

    def __post_init__(self) -> None:
        check(self)
        if self.certs and self.insecure_internal:
            raise SettingError("--certs and --insecure-internal exclude each other")

    def require_choice(self) -> None:
        """A service must be told: mutual TLS or plaintext."""
        if not self.certs and not self.insecure_internal:
            raise SettingError("internal connections need --certs DIR (mutual TLS; `kvfleet certs init`) "
                               "or --insecure-internal (plaintext, by choice)")

    def argv(self) -> list[str]:
        """The flags that give a child process the same choice."""
        if self.insecure_internal:
            return ["--insecure-internal"]
        return ["--certs", self.certs] if self.certs else []


def health_port_setting() -> Any:
    """``--health-port`` of every service (``kvfleet.core.health_port``)."""
    return setting(None, "also serve gRPC health alone, in plaintext, on this port on --listen's host (for "
                   "Kubernetes grpc probes and compose healthchecks, which present no client certificate)",
                   unset="off", parse=port_parser("--health-port"), metavar="PORT")
