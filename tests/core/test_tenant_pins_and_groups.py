"""The tenants file's pin budget and prefix groups (kvfleet.core.tenants): parsed, checked, one line per mistake."""

import pytest

from kvfleet.core.tenants import MIB, TenantsFileError, parse_tenants


def entry(**over):
    base = dict(name="t", api_key="k", quota_mib=4, paid_level=0, max_concurrent=0)
    base.update(over)
    return base


def test_pin_budget_and_group_are_read():
    a, b, c = parse_tenants({"prefix_groups": ["org"], "tenants": [
        entry(name="a", api_key="ka", pinned_mib=2, prefix_group="org"),
        entry(name="b", api_key="kb", prefix_group="org"),
        entry(name="c", api_key="kc"),
    ]})
    assert a.pinned_blocks(MIB // 2) == 4 and b.pinned_blocks(MIB) == 0  # no budget: no pins
    assert (a.prefix_group, b.prefix_group, c.prefix_group) == ("org", "org", None)


@pytest.mark.parametrize("doc, says", [
    ({"tenants": [entry(prefix_group="org")]}, "prefix_group 'org' is not one of the file's prefix_groups (none declared)"),
    ({"prefix_groups": ["org"], "tenants": [entry(prefix_group="orgg")]}, "prefix_group 'orgg' is not one of"),
    ({"prefix_groups": ["org"], "tenants": [entry(prefix_group=["org"])]}, "prefix_group must be a string"),
    ({"prefix_groups": "org", "tenants": [entry()]}, "prefix_groups must be a list of names"),
    ({"prefix_groups": ["org", "org"], "tenants": [entry()]}, "names a group twice"),
    ({"prefix_group": ["org"], "tenants": [entry()]}, "unknown top-level field(s) prefix_group"),
    ({"tenants": [entry(pinned_mib=-1)]}, "pinned_mib must be >= 0"),
    ({"tenants": [entry(pinned_mib=True)]}, "pinned_mib must be a number"),
])
def test_mistakes_are_one_line_naming_the_place(doc, says):
    with pytest.raises(TenantsFileError) as e:
        parse_tenants(doc, "f.yaml")
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_group_never_salts_like_a_tenant():
    from kvfleet.core.block_hash import block_hashes, tenant_extra_key
    with pytest.raises(TenantsFileError, match="control characters"):
        parse_tenants({"tenants": [entry(name="\x00group\x00org")]})
    tokens = list(range(32))
    group = block_hashes(tokens, 16, tenant_extra_key("a", prefix_group="org"))
    assert group == block_hashes(tokens, 16, tenant_extra_key("b", prefix_group="org"))  # the group shares
    assert group != block_hashes(tokens, 16, tenant_extra_key("org"))  # a tenant named like the group does not
    assert group != block_hashes(tokens, 16, tenant_extra_key("a"))
