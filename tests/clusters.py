"""Several real daemons on this machine as a cluster: each with its own node name, state and
TCP port on 127.0.0.1, CURVE keys made by ``profctl keys new`` (the ``cluster`` fixture)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemonproc import BIN, free_port
from harness import Daemon


def keys_new(name: str, directory: Path) -> None:
    r = subprocess.run(
        [str(BIN / "profctl"), "keys", "new", name, "--dir", str(directory)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


@dataclass
class Cluster:
    base: Path
    make: Callable[..., Daemon]
    nodes: list[tuple[Daemon, str]]  # (daemon, "127.0.0.1:PORT")

    @property
    def keys(self) -> Path:
        return self.base / "keys"

    def add(
        self,
        name: str,
        heartbeat: float = 60,
        config: str = "",
        env: dict[str, str] | None = None,
        **cluster: str,
    ) -> tuple[Daemon, str]:
        """A daemon named ``name`` listening on a free port; ``heartbeat``: its interval
        (long by default: raw peers send none, and must stay listed for the whole test);
        ``config``: more TOML tables (``[s3]``), ``env``: more environment."""
        port = free_port()
        table = {
            "listen": f"tcp://127.0.0.1:{port}",
            "server_key": str(self.keys / "daemon.key_secret"),
            "authorized_keys": str(self.base / "authorized"),
            **cluster,
        }
        text = (
            f'[daemon]\nnode_name = "{name}"\n'
            f"heartbeat_interval = {heartbeat}\n[cluster]\n"
            + "".join(f'{k} = "{v}"\n' for k, v in table.items())
        )
        node = (self.make(config=text + config, **(env or {})), f"127.0.0.1:{port}")
        self.nodes.append(node)
        return node

    def ctl(
        self,
        *args: str,
        nodes: list[str] | None = None,
        key: str | None = "alice",
        max_fds: int | None = None,
        **env: str,
    ) -> subprocess.CompletedProcess[str]:
        """profctl over TCP to ``nodes`` (default: every daemon added); ``max_fds``: run it
        with that hard limit on open descriptors."""
        e = {k: v for k, v in os.environ.items() if not k.startswith("PROFD_")}
        # Nothing local to fall back on: every answer comes over TCP.
        e["PROFD_RUNTIME_DIR"] = str(self.base / "no-local-daemon")
        e["PROFD_CLUSTER"] = ",".join(nodes if nodes is not None else [a for _, a in self.nodes])
        e["PROFD_SERVER_KEY"] = str(self.keys / "daemon.key")
        if key is not None:
            e["PROFD_CLIENT_KEY"] = str(self.keys / f"{key}.key_secret")
        e.update(env)

        def limit() -> None:
            if max_fds is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (max_fds, max_fds))

        return subprocess.run(
            [str(BIN / "profctl"), *args],
            env=e,
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=limit if max_fds is not None else None,
        )

    def json(self, *args: str, **kw: Any) -> Any:
        r = self.ctl(*args, "--json", **kw)
        assert r.returncode == 0, f"profctl {args} exited {r.returncode}: {r.stderr}"
        return json.loads(r.stdout)
