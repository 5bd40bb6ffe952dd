"""The Nsight Systems CLI as profd drives it: command lines, a runner, report discovery.

profd uses nsys's interactive sessions:

* ``profctl run --nsys -- CMD`` runs ``nsys launch --session-new=NAME ... CMD``: the job runs
  with nsys injected but collects nothing, and its clients report ``NAME`` to the daemon.
* For a session with ``--backend nsys`` the daemon runs ``nsys start --session=NAME
  --capture-range=cudaProfilerApi`` with an output path it chose inside its spool; the armed
  ranks call ``cudaProfilerStart``/``cudaProfilerStop`` at the exact step boundaries.
* nsys writes one report per capture range. The daemon picks the reports up from the path it
  chose (never from a node-local temp dir it has to guess), and if a report does not appear
  in time it runs ``nsys stop``, which makes nsys finalise what it collected.
* nsys records into a raw ``.qdstrm`` stream and converts it into the ``.nsys-rep`` with its
  importer (``QdstrmImporter``, in the ``host-*`` folder of an Nsight Systems install). An nsys
  without it (the copy inside Nsight Compute) prints "Unable to retrieve the importer version:
  skipping importation of the QDSTRM file" and leaves only the ``.qdstrm``.

Nothing here imports torch; the calls are plain subprocesses with timeouts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPORT_SUFFIX = ".nsys-rep"
PARTIAL_SUFFIX = ".qdstrm"  # nsys's raw stream, converted into the report at the end
DEFAULT_TRACE = "cuda,nvtx,osrt"
STATS_REPORTS = ("nvtx_sum", "cuda_gpu_kern_sum")
IMPORTER = "QdstrmImporter"
INSTALL = (
    "install Nsight Systems (the nsight-systems package, or NVIDIA's installer) and point"
    " PROFD_NSYS or [nsys] path at its nsys"
)


class NsysError(Exception):
    """An nsys command failed; the message is one line with nsys's own words."""


@dataclass(frozen=True)
class Result:
    rc: int
    output: str

    def tail(self, n: int = 300) -> str:
        text = " ".join(self.output.split())
        return text[-n:]


def find(configured: str | None) -> str | None:
    """The nsys binary: the configured path or name, else ``nsys`` on PATH."""
    name = configured or "nsys"
    if os.sep in name:
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name)


def launch_argv(
    nsys: str,
    session: str,
    cmd: Sequence[str],
    trace: str = DEFAULT_TRACE,
    extra: Sequence[str] = (),
) -> list[str]:
    return [nsys, "launch", f"--session-new={session}", f"--trace={trace}", *extra, *cmd]


def start_argv(nsys: str, session: str, output: Path, ranges: int) -> list[str]:
    # "stop" ends the collection after one range; repeat:N writes one report per range.
    end = "stop" if ranges == 1 else f"repeat:{ranges}"
    return [
        nsys,
        "start",
        f"--session={session}",
        "--capture-range=cudaProfilerApi",
        f"--capture-range-end={end}",
        f"--output={output}",
        "--force-overwrite=true",
    ]


def stop_argv(nsys: str, session: str) -> list[str]:
    return [nsys, "stop", f"--session={session}"]


def cancel_argv(nsys: str, session: str) -> list[str]:
    return [nsys, "cancel", f"--session={session}"]


def stats_argv(nsys: str, report: Path) -> list[str]:
    argv = [nsys, "stats", "--force-export=true"]
    for r in STATS_REPORTS:
        argv += ["--report", r]
    return [*argv, str(report)]


def run(argv: Sequence[str], timeout: float) -> Result:
    """Run one nsys command; raises :class:`NsysError` when it cannot run or fails."""
    try:
        p = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
        )
    except FileNotFoundError:
        raise NsysError(f"nsys not found at {argv[0]}") from None
    except subprocess.TimeoutExpired:
        raise NsysError(f"`nsys {argv[1]}` did not finish in {timeout:.0f}s") from None
    res = Result(p.returncode, (p.stdout or "") + (p.stderr or ""))
    if p.returncode != 0:
        raise NsysError(f"`nsys {argv[1]}` exited {p.returncode}: {res.tail()}")
    return res


def _outputs(base: Path, suffix: str) -> list[Path]:
    """Files nsys wrote for output ``base`` with ``suffix``, in capture-range order.

    With several ranges nsys numbers its outputs; the first may carry no number."""
    pat = re.compile(re.escape(base.name) + r"(?:[._-](\d+))?" + re.escape(suffix) + "$")
    found: list[tuple[int, Path]] = []
    try:
        entries = list(base.parent.iterdir())
    except OSError:
        return []
    for p in entries:
        m = pat.match(p.name)
        if m is not None:
            found.append((int(m.group(1) or 0), p))
    return [p for _, p in sorted(found)]


def _twin(path: Path, suffix: str, other: str) -> Path:
    return path.with_name(path.name[: -len(suffix)] + other)


def reports(base: Path) -> list[Path]:
    """Finished reports nsys wrote for output ``base``, in capture-range order. A report
    whose raw ``.qdstrm`` stream is still beside it is being converted and is not listed."""
    return [
        p
        for p in _outputs(base, REPORT_SUFFIX)
        if not _twin(p, REPORT_SUFFIX, PARTIAL_SUFFIX).exists()
    ]


def lone_streams(base: Path) -> list[Path]:
    """Raw ``.qdstrm`` streams for output ``base`` with no report beside them: captures nsys
    has not converted (yet, or ever: see :func:`import_problem`)."""
    return [
        p
        for p in _outputs(base, PARTIAL_SUFFIX)
        if not _twin(p, PARTIAL_SUFFIX, REPORT_SUFFIX).exists()
    ]


def importer(binary: str) -> Path | None:
    """nsys's ``QdstrmImporter``, looked for where NVIDIA's installs put it relative to the
    real nsys binary: beside it, or in a folder next to its folder or to its parent
    (``<install>/target-linux-x64/nsys`` and ``<install>/bin/nsys`` both have
    ``<install>/host-linux-x64/QdstrmImporter``). None when none is there."""
    real = Path(os.path.realpath(binary))
    here = real.parent
    candidates = [here / IMPORTER]
    for up in (here.parent, here.parent.parent):
        try:
            candidates += sorted(up.glob(f"*/{IMPORTER}"))
        except OSError:
            continue
    for c in candidates:
        if os.access(c, os.X_OK) and c.is_file():
            return c
    return None


#: What the importer's ``--version`` may take: a loader error answers in milliseconds.
PROBE_TIMEOUT_S = 5.0
_LOADER = re.compile(r"error while loading shared libraries: (\S+?):")
_probed: dict[tuple[str, float], str | None] = {}


def importer_fault(imp: Path) -> str | None:
    """Why the importer ``imp`` cannot run, from one ``--version`` run, or None when it ran
    or its answer says nothing certain. Cached per file and modification time (the daemon
    asks at every nsys session start; an install fixed meanwhile is seen again)."""
    try:
        key = (str(imp), imp.stat().st_mtime)
    except OSError as exc:
        return f"{imp} cannot be read ({exc.strerror})"
    if key in _probed:
        return _probed[key]
    why: str | None = None
    try:
        r = subprocess.run(
            [str(imp), "--version"], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, errors="replace", timeout=PROBE_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pass  # slow, not broken: nsys will find out for itself
    except OSError as exc:
        why = f"{imp} does not run ({exc.strerror})"
    else:
        out = f"{r.stderr}\n{r.stdout}"
        lib = _LOADER.search(out)
        if lib is not None:
            # nsys then says only "Unable to retrieve the importer version".
            why = f"{imp} does not run: the library {lib.group(1)} is missing"
            if lib.group(1).startswith("libdw."):
                why += " (elfutils' libdw: `apt install libdw1` or `dnf install elfutils-libs`)"
        elif r.returncode in (126, 127):
            why = f"{imp} does not run (exit {r.returncode}: {out.strip()[:200]})"
    _probed[key] = why
    return why


def import_problem(binary: str) -> str | None:
    """Why ``binary`` cannot turn a capture into a report, in words, or None when its
    importer is where an Nsight Systems install keeps it and runs."""
    real = os.path.realpath(binary)
    shown = binary if real == binary else f"{binary} ({real})"
    imp = importer(binary)
    if imp is None:
        return (
            f"{shown} has no {IMPORTER} near it, so it cannot convert a capture into a report"
            " (the nsys inside Nsight Compute is such a copy)"
        )
    fault = importer_fault(imp)
    if fault is None:
        return None
    return f"{shown} cannot convert a capture into a report: its {fault}"


def left_only(stream: Path, why: str | None) -> str:
    """One line for a cycle that ended with nsys's raw stream and no report."""
    report = stream.name[: -len(PARTIAL_SUFFIX)] + REPORT_SUFFIX
    cause = why or (
        "nsys did not import it; the usual cause is an nsys without its importer, such as"
        " the copy inside Nsight Compute"
    )
    return f"nsys left only {stream} (its raw capture) and no {report}: {cause}; {INSTALL}"
