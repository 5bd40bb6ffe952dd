"""Pipeline memory and time on one raw trace: the streaming pipeline vs the whole-file one.

Target: a 1 GB raw trace in <= 300 MB peak RSS per pipeline worker.

For each size it writes a synthetic kineto trace (``tests/kineto_synth.py``: torch.profiler's
layout, CUDA job with record_shapes, with_stack and profile_memory, about 290 bytes an event)
and runs ``process_open`` on it, as a daemon worker does, once per implementation, each in a
fresh interpreter:

* **profd**: this checkout (``profd/pipeline``: :mod:`profd.pipeline.stream` reads one event at
  a time; the analyses keep compact columns);
* **baseline**: the pipeline as of commit ``BASE_COMMIT``, the last one that read the whole
  file with ``json.loads`` and kept every event as a dict. Its ``profd/`` is extracted with
  ``git archive`` into a temp dir and imported from there (the child checks which file it
  imported).

The child reports the wall time of the ``process_open`` call, its peak RSS (``VmHWM``) and
its RSS before the call (interpreter and imports). Both implementations' outputs are
compared (sha256 of the decompressed trace, the memory report and the summary up to its
operator tables, which were changed on purpose: no Python frames, no profd, wall-clock
times): they must be identical. Sizes alternate which implementation runs first. One more
profd run per size puts ``distributedInfo`` after ``traceEvents``, the layout that makes profd
read the file twice.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B
from kineto_synth import write_trace  # tests/, on sys.path through benchlib

#: The last commit whose pipeline loads the whole trace (the implementation replaced).
BASE_COMMIT = "4b65d70"
MB = 1 << 20
TARGET_MB = 300
FULL_SIZES_MB = (100, 250, 1024)
QUICK_SIZES_MB = (20,)

CHILD = r"""
import json, os, resource, sys, time
root, raw, out = sys.argv[1:4]
sys.path.insert(0, root)
import profd.pipeline.process as process

def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0

assert process.__file__.startswith(os.path.realpath(root) + os.sep), process.__file__
before = rss_kib()
t0 = time.perf_counter()
with open(raw, "rb") as fh:
    res = process.process_open(fh, os.fstat(fh.fileno()).st_size, out, "bench-r3", 3, 8,
                               header={"session": "bench"})
wall = time.perf_counter() - t0
print(json.dumps({
    "wall_s": wall, "peak_mib": hwm_kib() / 1024, "start_mib": before / 1024,
    "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "steps": len(res.steps_found), "files": [os.path.basename(f.path) for f in res.files],
    "module": process.__file__,
}))
"""


def baseline_tree(dest: Path) -> Path | None:
    """``profd/`` as of BASE_COMMIT under ``dest``, or None when git cannot give it."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(B.ROOT), "archive", BASE_COMMIT, "profd"],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"no baseline: git archive {BASE_COMMIT} failed ({exc})", file=sys.stderr)
        return None
    return dest


def run_child(root: Path, raw: Path, out: Path) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(raw), str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not the checkout: its profd/ must not shadow root's
    )
    if p.returncode != 0:
        raise RuntimeError(f"process_open from {root} failed ({p.returncode}):\n{p.stderr}")
    res: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    res["digests"] = digests(out)
    res["digests_vs_base"] = digests(out, SUMMARY_TABLES)
    return res


#: Where the summary's operator tables start: what follows differs from BASE_COMMIT's by design.
SUMMARY_TABLES = b"\n## CPU operators"


def digests(directory: Path, cut: bytes | None = None) -> dict[str, str]:
    """sha256 of each output file, the trace's taken after decompression; with ``cut``, a
    summary's only up to it."""
    out = {}
    for path in sorted(directory.iterdir()):
        h = hashlib.sha256()
        opener: Any = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rb") as fh:
            if cut is not None and path.name.endswith(".summary.txt"):
                h.update(fh.read().split(cut)[0])
            else:
                while block := fh.read(4 * MB):
                    h.update(block)
        out[path.name] = h.hexdigest()
    return out


def main() -> int:
    ap = B.parser(__doc__)
    ap.add_argument("--sizes", help="comma-separated trace sizes in MiB (default: 100,250,1024)")
    args = ap.parse_args()
    started = time.monotonic()
    sizes = QUICK_SIZES_MB if args.quick else FULL_SIZES_MB
    if args.sizes:
        sizes = tuple(int(x) for x in args.sizes.split(","))
    work = Path(tempfile.mkdtemp(prefix="profd-bench-pipeline-"))
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {"base_commit": BASE_COMMIT, "sizes": {}}
    try:
        base_root = baseline_tree(work / "base")
        details["baseline_available"] = base_root is not None
        for k, size_mb in enumerate(sizes):
            d: dict[str, Any] = {}
            raws = {}
            for layout in ("head", "tail"):
                raws[layout] = work / f"raw-{size_mb}-{layout}.json"
                t0 = time.monotonic()
                with open(raws[layout], "wb") as fh:
                    info = write_trace(fh, size_mb * MB, info=layout)
                d[f"trace_{layout}"] = {**vars(info), "write_s": round(time.monotonic() - t0, 1)}
            print(f"{size_mb} MB: {d['trace_head']}", file=sys.stderr)
            impls: list[tuple[str, Path]] = [("profd", B.ROOT)]
            if base_root is not None:
                impls.append(("baseline", base_root))
            if k % 2:
                impls.reverse()
            for label, root in impls:
                d[label] = run_child(root, raws["head"], work / f"out-{label}")
                print(f"  {label}: {json.dumps(d[label])}", file=sys.stderr)
            d["profd_info_after_events"] = run_child(B.ROOT, raws["tail"], work / "out-tail")
            print(f"  profd, info after: {d['profd_info_after_events']}", file=sys.stderr)
            if "baseline" in d:
                d["outputs_identical"] = (
                    d["profd"]["digests_vs_base"] == d["baseline"]["digests_vs_base"]
                )
                if not d["outputs_identical"]:
                    raise RuntimeError(f"outputs differ at {size_mb} MB: {d}")
            for p in raws.values():
                p.unlink()
            details["sizes"][str(size_mb)] = d
            rows += size_rows(size_mb, d, target=size_mb >= 1024)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    B.write_result(
        "pipeline",
        args.out,
        args.quick,
        {"sizes_mb": list(sizes), "base_commit": BASE_COMMIT, "target_mib": TARGET_MB},
        rows,
        details,
        started,
    )
    return 0


def size_rows(size_mb: int, d: dict[str, Any], target: bool) -> list[dict[str, Any]]:
    new, old = d["profd"], d.get("baseline")
    tail = d["profd_info_after_events"]
    label = f"{size_mb} MB" if size_mb < 1024 else f"{size_mb / 1024:g} GB"
    what = f"whole-file load, {BASE_COMMIT}" if old else ""
    return [
        B.row(
            f"pipeline peak RSS, {label} trace",
            f"<= {TARGET_MB} MB at 1 GB" if target else "-",
            new["peak_mib"],
            "MiB",
            baseline=old["peak_mib"] if old else None,
            baseline_what=what,
            met=(new["peak_mib"] <= TARGET_MB) if target else None,
            spread=f"start {new['start_mib']:.0f} MiB",
        ),
        B.row(
            f"pipeline wall time, {label} trace",
            "-",
            new["wall_s"],
            "s",
            baseline=old["wall_s"] if old else None,
            baseline_what=what,
            spread=(
                f"distributedInfo after traceEvents: {tail['wall_s']:.1f} s,"
                f" {tail['peak_mib']:.0f} MiB"
            ),
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
