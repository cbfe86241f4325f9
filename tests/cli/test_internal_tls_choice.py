"""Every service command must be told how its internal connections go: given neither ``--certs`` nor
``--insecure-internal`` it says so in one line and exits 2, so plaintext is never what a forgotten
flag gives; and a certificate directory of another identity is refused in one line naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfleet.cli.ports import free_port
from kvfleet.core import certs
from kvfleet.core.identity import BLOCK_SERVICE_ID, ROUTER_ID, Identity
from tests.cli.test_first_contact import model, refused, tenants  # noqa: F401 - the fixtures are used

pytestmark = pytest.mark.process  # starts the commands in subprocesses without a tier fixture (tests/conftest.py)

NO_CHOICE = ("internal connections need --certs DIR (mutual TLS; `kvfleet certs init`) or --insecure-internal "
             "(plaintext, by choice)")
N0 = Identity.node("n0")


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    certs.ensure(directory, [N0, ROUTER_ID, BLOCK_SERVICE_ID])
    return directory


def service_argv(command: str, tmp_path: Path, model: Path, tenants: Path) -> list[str]:  # noqa: F811
    """``command`` with what it needs to start, but the choice of internal TLS."""
    return {
        "compute": ["compute", "--node-id", "n1", "--model", str(model)],
        "router": ["router", "--listen", "127.0.0.1:0", "--etcd", f"http://127.0.0.1:{free_port()}",
                   "--tenants", str(tenants)],
        "block-service": ["block-service", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state")],
    }[command]


@pytest.mark.parametrize("command", ["compute", "router", "block-service"])
def test_a_service_without_a_choice_of_internal_tls_is_refused_in_one_line(command, tmp_path, model, tenants):  # noqa: F811
    line = refused(*service_argv(command, tmp_path, model, tenants), tmp_path=tmp_path, code=2)
    assert line == f"kvfleet {command}: {NO_CHOICE}"
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("command, theirs, mine", [
    ("compute", N0, "node:n1"),  # a node started as n1 with n0's certificate
    ("router", BLOCK_SERVICE_ID, "router"),
    ("block-service", N0, "block-service"),
])
def test_another_identitys_certificate_is_refused_in_one_line(command, theirs, mine, tmp_path, model, tenants,  # noqa: F811
                                                               certs_dir):
    directory = certs.identity_dir(certs_dir, theirs)
    line = refused(*service_argv(command, tmp_path, model, tenants), "--certs", str(directory), tmp_path=tmp_path,
                   code=2)
    assert line == f"kvfleet {command}: --certs {directory}: the certificate is {theirs}'s, this service runs as {mine}"
    assert not (tmp_path / "state").exists()
