"""Where the local cluster that ``kvfleet up`` started can be found: a small JSON file
(``$KVFLEET_STATE_FILE``, default ``~/.cache/kvfleet/cluster.json``) with the router's address, the
demo key when the demo tenants are served, the pid of ``kvfleet up``, its block_service replicas'
addresses and its etcd.

``kvfleet generate`` without ``--router`` and ``kvfleet blocks`` without ``--block-service`` read
it (the leader among two replicas is the one etcd names), so a newcomer does not copy an address; a file
whose ``up`` is gone (killed without cleanup) is ignored. ``up`` removes the file at shutdown
only when it is still its own (a second ``up`` started meanwhile owns it then).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


def state_file() -> Path:
    explicit = os.environ.get("KVFLEET_STATE_FILE")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("KVFLEET_CACHE") or Path.home() / ".cache" / "kvfleet"
    return Path(cache) / "cluster.json"


@dataclass(slots=True, frozen=True)
class ClusterState:
    router: str             # host:port
    pid: int                # of `kvfleet up`
    api_key: str | None     # the demo tenants' gold key, None when the user's tenants are served
    work_dir: str
    block_service: tuple[str, ...] = ()  # its replicas' host:port (two with a standby)
    etcd: str = ""                       # its etcd's URL, which names the block_service leader
    certs: str = ""                      # its certificates directory ("": plaintext); admin/ is the operator's
    router_metrics: str = ""             # the router's metrics base URL (``kvfleet canary report``)

    def write(self, path: Path | None = None) -> Path:
        path = path or state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def read(cls, path: Path | None = None) -> "ClusterState | None":
        """The running local cluster, or None (no file, unreadable, or its ``up`` is gone)."""
        path = path or state_file()
        try:
            fields = json.loads(path.read_text())
            state = cls(**{**fields, "block_service": tuple(fields.get("block_service", ()))})
        except (OSError, ValueError, TypeError, AttributeError):
            return None
        return state if _alive(state.pid) else None

    def remove(self, path: Path | None = None) -> None:
        """Remove the file if it still describes this cluster."""
        path = path or state_file()
        try:
            if json.loads(path.read_text()).get("pid") == self.pid:
                path.unlink()
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
