"""The tenants file parser (kvfleet.core.tenants) and the router's key lookup (kvfleet.router.tenants)."""

import pytest

from kvfleet.core.tenants import Tenant, TenantsFileError, load_tenants, parse_tenants
from kvfleet.router.tenants import AuthError, TenantDirectory

GOOD = """
tenants:
  - name: acme
    api_key: sk-acme
    quota_mib: 512
    reserved_mib: 64
    paid_level: 2
    max_concurrent: 8
  - name: hobby
    api_key: sk-hobby
    quota_mib: 1.5
    paid_level: 0
    max_concurrent: 1
"""


def entry(**over):
    base = dict(name="t", api_key="k", quota_mib=1, paid_level=0, max_concurrent=1)
    base.update(over)
    return {k: v for k, v in base.items() if v is not ...}


def test_load_good_file(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD)
    acme, hobby = load_tenants(path)
    assert acme == Tenant("acme", "sk-acme", 512.0, 2, 8, 64.0)
    assert hobby.reserved_mib == 0.0 and hobby.quota_mib == 1.5
    assert acme.quota_blocks(bytes_per_block=2**20) == 512
    assert acme.lower_tier_quota_mib is None and acme.lower_tier_quota_blocks(2**20) is None  # unlimited


def test_the_lower_tier_cap_is_its_own_field():
    """The quota charges device-pool blocks; ``lower_tier_quota_mib`` caps host + disk."""
    [t] = parse_tenants({"tenants": [entry(lower_tier_quota_mib=2.5)]})
    assert t.lower_tier_quota_mib == 2.5 and t.quota_mib == 1
    assert t.lower_tier_quota_blocks(bytes_per_block=2**19) == 5


@pytest.mark.parametrize(
    "data, words",
    [
        (None, "'tenants:' list"),
        ({"tenants": []}, "non-empty list"),
        ({"tenants": ["x"]}, "tenants[0]: expected a mapping"),
        ({"tenants": [entry(max_concurrent=...)]}, "missing max_concurrent"),
        ({"tenants": [entry(colour="red")]}, "unknown field(s) colour"),
        ({"tenants": [entry(quota_mib=0)]}, "quota_mib must be > 0"),
        ({"tenants": [entry(quota_mib="lots")]}, "quota_mib must be a number"),
        ({"tenants": [entry(paid_level=1.5)]}, "paid_level must be an integer"),
        ({"tenants": [entry(paid_level=True)]}, "paid_level must be an integer"),
        ({"tenants": [entry(paid_level=-1)]}, "paid_level must be >= 0"),
        ({"tenants": [entry(max_concurrent=-1)]}, "max_concurrent must be >= 0"),
        ({"tenants": [entry(reserved_mib=2)]}, "reserved_mib must be between"),
        ({"tenants": [entry(lower_tier_quota_mib=0)]}, "tenants[0] (t): lower_tier_quota_mib must be > 0"),
        ({"tenants": [entry(lower_tier_quota_mib="x")]}, "lower_tier_quota_mib must be a number"),
        ({"tenants": [entry(api_key="a b")]}, "api_key must be a string without spaces"),
        ({"tenants": [entry(api_key="")]}, "api_key must not be empty"),
        ({"tenants": [entry(name=3)]}, "name must be a string"),
        ({"tenants": [entry(), entry(api_key="k2")]}, "name 't' appears twice"),
        ({"tenants": [entry(), entry(name="u")]}, "reuses another tenant's api_key"),
    ],
)
def test_bad_files_say_where_and_why(data, words):
    with pytest.raises(TenantsFileError, match=None) as info:
        parse_tenants(data, "t.yaml")
    assert words in str(info.value) and str(info.value).startswith("t.yaml")


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(TenantsFileError, match="cannot read"):
        load_tenants(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: [\n")
    with pytest.raises(TenantsFileError, match="not valid YAML"):
        load_tenants(bad)


def test_authenticate(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(GOOD)
    directory = TenantDirectory.from_file(path)
    assert directory.authenticate("Bearer sk-acme").name == "acme"
    assert directory.authenticate("bearer  sk-hobby ").name == "hobby"
    for header, words in [(None, "missing"), ("", "missing"), ("sk-acme", "malformed"),
                          ("Bearer ", "unknown"), ("Bearer sk-nope", "unknown")]:
        with pytest.raises(AuthError, match=words):
            directory.authenticate(header)
    assert directory.authenticate_metadata([("x-trace", "1"), ("authorization", "Bearer sk-acme")]).name == "acme"
    with pytest.raises(AuthError, match="missing"):
        directory.authenticate_metadata([("x-trace", "1")])
    for values in (["Bearer sk-nope", "Bearer sk-acme"], ["Bearer sk-acme", "Bearer sk-acme"]):
        with pytest.raises(AuthError, match="exactly one authorization header"):
            directory.authenticate_metadata([("authorization", v) for v in values])
    assert directory.normalised_paid_level(directory.by_name("acme")) == 1.0
    assert directory.normalised_paid_level(directory.by_name("hobby")) == 0.0
    assert directory.concurrency_limits() == {"acme": 8, "hobby": 1}
