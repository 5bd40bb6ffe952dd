"""Shared helpers for the profd benchmarks: machine facts, statistics, results, a real daemon.

Every benchmark writes ``{out}/{name}.json`` with the same top-level keys (see
:func:`write_result`); ``bench/run.py`` reads them back and prints one table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
# The daemon launcher the tests use too (tests/daemonproc.py). BIN, re-exported for the
# benchmarks, is the directory of this interpreter's console scripts (profd, profctl,
# torchrun), so the benchmarks start the same executables the tests do.
sys.path.insert(0, str(ROOT / "tests"))
from daemonproc import BIN as BIN  # noqa: E402
from daemonproc import DaemonProcess  # noqa: E402
from daemonproc import free_port as free_port  # noqa: E402
from daemonproc import wait_for as wait_for  # noqa: E402


def compile_sources(root: Path = ROOT) -> None:
    """Byte-compile profd and the client of the source tree at ``root``, as ``pip install``
    does for an installed package.

    An editable checkout under ``PYTHONDONTWRITEBYTECODE=1`` (this machine sets it) compiles
    profd's sources again in every new process: ~35 ms of each ``profctl`` command that no
    installed profd pays.
    """
    import compileall

    for d in ("profd", "client"):
        compileall.compile_dir(str(root / d), quiet=1)


def daemon_from(tree: str | None) -> dict[str, str]:
    """The environment that runs ``profd`` and ``profctl`` from another source tree (a
    worktree of the commit to compare with: its ``profd/`` and ``client/`` first on
    ``PYTHONPATH``), everything else (the harness, the simulated clients) from this one: a
    paired A/B with one harness. Give both sides a tree, this checkout included, so both
    pay the same extra path lookups on import. ``{}`` for None."""
    if tree is None:
        return {}
    root = Path(tree).resolve()
    if not (root / "profd" / "__init__.py").is_file():
        raise SystemExit(f"--daemon-from {tree}: no profd/ package there")
    compile_sources(root)
    return {"PYTHONPATH": f"{root}{os.pathsep}{root / 'client'}"}


compile_sources()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SIGTERM ends a benchmark as Ctrl-C does: through its ``finally`` blocks, which stop the
    # daemon, the simulated clients and the floor's processes it started (the default
    # action would leave them running, and the next run would measure beside them).
    raise SystemExit(128 + signum)


signal.signal(signal.SIGTERM, _exit_on_sigterm)

RESULT_KEYS = ("name", "quick", "date", "machine", "params", "rows", "details", "wall_s")


# --- command line ---------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", default=str(RESULTS), help="directory for the JSON result")
    return p


# --- machine ----------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    torch_version = None
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch_version,
        "kernel": platform.release(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


# --- statistics -----------------------------------------------------------------------------
def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default); q in [0, 100]."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summary(values: Sequence[float], nd: int = 3) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "min": round(min(values), nd),
        "p10": round(pct(values, 10), nd),
        "p50": round(pct(values, 50), nd),
        "p90": round(pct(values, 90), nd),
        "p99": round(pct(values, 99), nd),
        "max": round(max(values), nd),
    }


# --- results ----------------------------------------------------------------------------------
def row(
    metric: str,
    target: str,
    measured: float | None,
    unit: str,
    baseline: float | None = None,
    baseline_what: str = "",
    ratio: float | None = None,
    met: bool | None = None,
    spread: str = "",
) -> dict[str, Any]:
    """One line of the results table. ``ratio`` is measured/baseline unless given."""
    if ratio is None and measured is not None and baseline:
        ratio = measured / baseline
    return {
        "metric": metric,
        "target": target,
        "measured": None if measured is None else round(float(measured), 4),
        "unit": unit,
        "spread": spread,
        "baseline": None if baseline is None else round(float(baseline), 4),
        "baseline_what": baseline_what,
        "ratio": None if ratio is None else round(float(ratio), 4),
        "met": met,
    }


def write_result(
    name: str,
    out: str | Path,
    quick: bool,
    params: dict[str, Any],
    rows: list[dict[str, Any]],
    details: dict[str, Any],
    started: float,
) -> Path:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    res = {
        "name": name,
        "quick": quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "params": params,
        "rows": rows,
        "details": details,
        "wall_s": round(time.monotonic() - started, 1),
    }
    path = d / f"{name}.json"
    path.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print_rows(rows)
    print(f"wrote {path}", file=sys.stderr)
    return path


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 100:
            return f"{v:.0f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def print_rows(rows: Iterable[dict[str, Any]], file: Any = None) -> None:
    out = file or sys.stdout
    head = ("metric", "target", "measured", "spread", "baseline", "ratio", "met")
    table = [head]
    for r in rows:
        table.append(
            (
                r["metric"],
                r["target"],
                f"{fmt(r['measured'])} {r['unit']}",
                r.get("spread", ""),
                f"{fmt(r['baseline'])} ({r['baseline_what']})" if r["baseline_what"] else "-",
                fmt(r["ratio"]),
                fmt(r["met"]),
            )
        )
    widths = [max(len(str(t[i])) for t in table) for i in range(len(head))]
    for i, t in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(t, widths, strict=True)), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def markdown_rows(rows: Iterable[dict[str, Any]]) -> str:
    lines = [
        "| metric | target | profd | spread | baseline | ratio | met |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        base = f"{fmt(r['baseline'])} ({r['baseline_what']})" if r["baseline_what"] else "-"
        met = {True: "**met**", False: "**missed**", None: "-"}[r["met"]]
        lines.append(
            f"| {r['metric']} | {r['target']} | {fmt(r['measured'])} {r['unit']} | "
            f"{r.get('spread', '')} | {base} | {fmt(r['ratio'])} | {met} |"
        )
    return "\n".join(lines) + "\n"


# --- a real daemon ----------------------------------------------------------------------------
#: ``[daemon] max_peers_per_process`` and ``max_peers_per_user`` of the benchmarks' daemon.
SIM_PEERS = 65_536


@dataclass
class Daemon(DaemonProcess):
    """A real ``profd run`` in a temporary dir, with the daemon's heartbeat set by config."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="profd-bench-")))
    heartbeat: float = 1.0
    ctl_timeout: float = 120.0
    #: More ``[daemon]`` keys for its config (TOML lines).
    daemon_keys: str = ""
    #: More TOML tables for its config (``[watch]``).
    tables: str = ""
    #: Simulated clients share worker processes (256 ranks in each at 1,024), and the peer
    #: limits are for real processes: lifted unless this is false.
    sim_peers: bool = True
    _conn: Any = None

    def start(self) -> Daemon:
        self.config = self.root / "profd.toml"
        peers = (
            f"max_peers_per_process = {SIM_PEERS}\nmax_peers_per_user = {SIM_PEERS}\n"
            if self.sim_peers
            else ""
        )
        self.config.write_text(
            f"[daemon]\nheartbeat_interval = {self.heartbeat}\n{peers}{self.daemon_keys}"
            f"{self.tables}"
        )
        self.launch()
        try:
            wait_for(
                lambda: self._alive() and (self.runtime_dir / "control.sock").exists(),
                30,
                "daemon socket",
            )
            wait_for(lambda: self._alive() and self._answers(), 30, "daemon to answer")
        except BaseException as e:
            log = self.log_tail()
            self.stop()
            if isinstance(e, Exception):
                raise RuntimeError(f"profd run did not come up ({e}); its log:\n{log}") from e
            raise
        return self

    def _alive(self) -> bool:
        """True while the daemon runs; raises once it has exited (no point waiting on)."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            raise RuntimeError(f"profd run exited with {rc}")
        return True

    def _answers(self) -> bool:
        try:
            self.request("status")
            return True
        except Exception:
            self.close_conn()
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def conn(self) -> Any:
        if self._conn is None:
            from profd.ctl.connection import Connection

            self._conn = Connection(str(self.runtime_dir), timeout_ms=60_000)
        return self._conn

    def close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, t: str, **fields: Any) -> Any:
        return self.conn().request(t, **fields)

    def stop(self, keep: bool = False) -> None:
        self.close_conn()
        self.terminate()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def spawn_worker(
    script: Path, args: Sequence[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A worker speaking JSON lines: commands on stdin, one JSON reply per line on stdout."""
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
    )


def ask(w: subprocess.Popen[str], cmd: dict[str, Any]) -> Any:
    """Send one command to a worker and wait for its one-line JSON reply."""
    assert w.stdin is not None and w.stdout is not None
    w.stdin.write(json.dumps(cmd) + "\n")
    w.stdin.flush()
    return read_reply(w)


def read_reply(w: subprocess.Popen[str]) -> Any:
    """The next JSON line from a worker (other lines are echoed to stderr)."""
    assert w.stdout is not None
    while True:
        line = w.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {w.args} exited (rc {w.wait()})")
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
        print(line, file=sys.stderr)


def steploop_ranks(
    d: Daemon, n: int, step_ms: float
) -> tuple[dict[str, str], list[subprocess.Popen[str]]]:
    """``n`` real processes of ``bench/steploop.py`` (job ``bench``, a step every ``step_ms``
    on a thread of their own), each ready and attached to ``d``; and their environment."""
    env = {**d.env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = [
        spawn_worker(BENCH / "steploop.py", [str(step_ms), str(r), str(n)], env) for r in range(n)
    ]
    try:
        for w in ranks:
            read_reply(w)
        wait_for(lambda: len(d.request("ps")) >= n, 120, "every rank attached")
    except BaseException:
        finish_workers(ranks)
        raise
    return env, ranks


def finish_workers(ws: Iterable[subprocess.Popen[str]]) -> None:
    for w in ws:
        try:
            if w.stdin is not None:
                w.stdin.close()
        except OSError:
            pass
    for w in ws:
        try:
            w.wait(20)
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait()


class SimFleet:
    """``n`` simulated clients spread over ``procs`` worker processes (bench/simclients.py)."""

    def __init__(
        self,
        daemon: Daemon,
        n: int,
        procs: int,
        job: str,
        hb: float = 1.0,
        rate: float = 10.0,
        work: bool = False,
        rank_base: int = 0,
        world: int | None = None,
        role: str = "sim",
        proc_base: int = 0,
    ) -> None:
        self.n = n
        procs = max(1, min(procs, n))
        per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
        env = daemon.env()
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.workers: list[subprocess.Popen[str]] = []
        base = rank_base
        for i, k in enumerate(per):
            args = [
                "--proc",
                str(proc_base + i),
                "--count",
                str(k),
                "--rank-base",
                str(base),
                "--world",
                str(world or n),
                "--job",
                job,
                "--role",
                role,
                "--hb",
                str(hb),
                "--rate",
                str(rate),
                "--runtime-dir",
                str(daemon.runtime_dir),
            ]
            if work:
                args.append("--work")
            self.workers.append(spawn_worker(BENCH / "simclients.py", args, env=env))
            base += k
        for w in self.workers:
            read_reply(w)

    def connected(self) -> int:
        return sum(ask(w, {"op": "status"})["connected"] for w in self.workers)

    def wait_connected(self, timeout: float = 120) -> None:
        wait_for(lambda: self.connected() >= self.n, timeout, f"{self.n} clients", every=0.5)

    def reconnects(self) -> list[int]:
        out: list[int] = []
        for w in self.workers:
            out.extend(ask(w, {"op": "reconnects"})["n"])
        return out

    def arms(self, session: str) -> list[tuple[int, float]]:
        out: list[tuple[int, float]] = []
        for w in self.workers:
            out.extend(ask(w, {"op": "arms", "session": session})["times"])
        return out

    def close(self) -> None:
        finish_workers(self.workers)
        self.workers = []


class SimNodes:
    """``nodes`` simulated nodes (bench/simnodes.py, ``extra`` its further arguments) of
    ``ranks`` ranks each, over ``procs`` worker processes; ``env`` is where ``profctl`` reaches
    them all (``PROFD_CLUSTER``, CURVE keys, no local daemon)."""

    def __init__(self, nodes: int, ranks: int, procs: int, extra: Sequence[str] = ()) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="profd-bench-cluster-"))
        keys = self.tmp / "keys"
        for name in ("daemon", "operator"):
            subprocess.run(
                [str(BIN / "profctl"), "keys", "new", name, "--dir", str(keys)],
                check=True,
                capture_output=True,
            )
        per = -(-nodes // procs)
        self.workers = [
            spawn_worker(
                BENCH / "simnodes.py",
                [
                    "--first",
                    str(first),
                    "--count",
                    str(min(per, nodes - first)),
                    "--world",
                    str(nodes * ranks),
                    "--ranks",
                    str(ranks),
                    "--secret",
                    str(keys / "daemon.key_secret"),
                    *extra,
                ],
            )
            for first in range(0, nodes, per)
        ]
        try:
            self.ports: list[int] = [
                p for w in self.workers for p in ask(w, {"cmd": "ready"})["ports"]
            ]
        except BaseException:
            self.close()
            raise
        nodes_file = self.tmp / "nodes.txt"
        nodes_file.write_text("".join(f"127.0.0.1:{p}\n" for p in self.ports))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PROFD_")}
        self.env.update(
            PROFD_CLUSTER=f"@{nodes_file}",
            PROFD_SERVER_KEY=str(keys / "daemon.key"),
            PROFD_CLIENT_KEY=str(keys / "operator.key_secret"),
            PROFD_RUNTIME_DIR=str(self.tmp / "no-local-daemon"),
        )

    def close(self) -> None:
        finish_workers(self.workers)
        shutil.rmtree(self.tmp, ignore_errors=True)
