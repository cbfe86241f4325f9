"""The tenants a local cluster serves unless given a tenants file: ``gold`` (paid level 2) and
``free`` (level 0), the two the demo's traffic and ``kvfleet up``'s printed example use."""

DEMO_TENANTS = """\
tenants:
  - name: gold
    api_key: sk-gold
    quota_mib: 256
    paid_level: 2
    max_concurrent: 16
  - name: free
    api_key: sk-free
    quota_mib: 64
    paid_level: 0
    max_concurrent: 4
"""
