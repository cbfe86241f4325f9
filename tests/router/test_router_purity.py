"""Pure router logic imports neither torch nor grpc (STYLE.md habit 2)."""

import subprocess
import sys

PURE = ["router.tenants", "router.stall_watch", "router.priority_queue", "router.routing", "router.request", "router.admission", "router.resume",
        "kvfleet.tenants"]


def test_pure_modules_import_no_grpc_or_torch():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'torch', 'aetcd'))\n"
        + "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
