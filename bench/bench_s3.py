"""S3 upload throughput: the daemon's upload pipeline versus raw boto3 ``upload_file``.

Both upload the same files to the same local S3-compatible endpoint (a standalone moto
server, ``python -m moto.server``, on this machine). profd: the real
:class:`profd.store.uploads.Uploads` (its worker threads, transfer manager and post-upload
verification) draining rows queued in a real index with ``FileRepo.add_file(...,
upload_state='pending')``; the clock runs from ``start()`` until every row is ``uploaded``.
Raw: a fresh ``boto3.client('s3')`` and ``upload_file`` per file, one after another, default
TransferConfig (what a user's script does). Sets: 10 x 10 MB and 1 x 500 MB of random bytes;
runs alternate which goes first; objects are deleted between runs (moto keeps them in RAM).
profd uploads with its default multipart settings (the 500 MB file goes in parts); ``--quick``
lowers them so that its 12 MB file goes in parts too, through the same code.

Target: profd >= 0.9x raw boto3 throughput.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as B

BUCKET = "bench"


def start_moto(port: int, log: Path) -> subprocess.Popen[bytes]:
    f = log.open("wb")
    p = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=f,
        stderr=subprocess.STDOUT,
    )

    def up() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
            return True
        except Exception:
            return p.poll() is not None

    B.wait_for(up, 60, "moto server", every=0.2)
    if p.poll() is not None:
        raise RuntimeError(f"moto server exited: {log.read_text()[-2000:]}")
    return p


def client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config as BotoConfig

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=BotoConfig(s3={"addressing_style": "path"}),
    )


def empty_bucket(c: Any) -> None:
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})
    for u in c.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []):
        c.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])


def make_files(spool: Path, name: str, count: int, size: int) -> list[Path]:
    d = spool / "bench-job" / name / "c0"
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        p = d / f"main-r{i}.pt.trace.json.gz"
        with p.open("wb") as f:
            left = size
            while left:
                n = min(left, 8 << 20)
                f.write(os.urandom(n))
                left -= n
        out.append(p)
    return out


def run_raw(endpoint: str, files: list[Path], spool: Path, run: str) -> float:
    t0 = time.perf_counter()
    c = client(endpoint)
    for p in files:
        c.upload_file(str(p), BUCKET, f"raw-{run}/{p.relative_to(spool)}")
    return time.perf_counter() - t0


def run_profd(
    endpoint: str, files: list[Path], root: Path, spool: Path, run: str, parts: tuple[int, int]
) -> float:
    from profd.config import Config, S3Config
    from profd.reactor import Reactor
    from profd.store.index import Database, FileRepo
    from profd.store.uploads import Uploads

    state = root / f"state-{run}"
    cfg = Config(
        runtime_dir=root / "run",
        state_dir=state,
        spool_dir=spool,
        s3=S3Config(
            url=f"s3://{BUCKET}/profd-{run}",
            endpoint_url=endpoint,
            region="us-east-1",
            addressing_style="path",
            multipart_threshold=parts[0],
            multipart_chunksize=parts[1],
        ),
    )
    idx = Database(cfg.index_path)
    for p in files:
        FileRepo(idx).add_file(
            {
                "session": p.parent.parent.name,
                "job": "bench-job",
                "kind": "trace",
                "path": str(p),
                "rel": str(p.relative_to(spool)),
                "bytes": p.stat().st_size,
                "upload_state": "pending",
            }
        )
    reactor = Reactor()
    n = len(files)

    def done() -> bool:
        reactor.run_pending()
        r = idx.conn.execute(
            "SELECT SUM(upload_state = 'uploaded') AS ok, SUM(upload_state = 'failed') AS bad"
            " FROM files"
        ).fetchone()
        if r["bad"]:
            rows = idx.conn.execute("SELECT last_error FROM files WHERE upload_state = 'failed'")
            raise RuntimeError(f"profd upload failed: {[r['last_error'] for r in rows]}")
        return int(r["ok"] or 0) == n

    t0 = time.perf_counter()
    up = Uploads(cfg, reactor)
    up.start()
    up.kick()
    try:
        B.wait_for(done, 900, "profd uploads", every=0.01)
        wall = time.perf_counter() - t0
    finally:
        up.stop()
        idx.close()
        reactor.close()
    return wall


def verify_cost(files: list[Path], parts: tuple[int, int]) -> float:
    """CPU time profd's post-upload verification spends hashing the local files."""
    from profd.store import s3

    t0 = time.perf_counter()
    for p in files:
        s3.digest(p, p.stat().st_size, *parts)
    return time.perf_counter() - t0


def main() -> None:
    args = B.parser(__doc__).parse_args()
    started = time.monotonic()
    quick = args.quick
    from profd.config import S3Config

    if quick:
        # Many small files in single PUTs, and one file above the multipart threshold (raw
        # boto3's 8 MB default and profd's lowered one; parts >= S3's 5 MB minimum).
        sets = {"3x1MB": (3, 1 << 20), "1x12MB": (1, 12 << 20)}
        parts = (8 << 20, 5 << 20)
        reps = 2  # both orders
    else:
        sets = {"10x10MB": (10, 10 << 20), "1x500MB": (1, 500 << 20)}
        parts = (S3Config.multipart_threshold, S3Config.multipart_chunksize)
        reps = 3
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    root = Path(tempfile.mkdtemp(prefix="profd-bench-s3-"))
    spool = root / "spool"
    port = B.free_port()
    moto = start_moto(port, root / "moto.log")
    endpoint = f"http://127.0.0.1:{port}"
    res: dict[str, dict[str, list[float]]] = {}
    sizes: dict[str, int] = {}
    digest_s: dict[str, float] = {}
    try:
        c = client(endpoint)
        c.create_bucket(Bucket=BUCKET)
        for name, (count, size) in sets.items():
            files = make_files(spool, name, count, size)
            sizes[name] = count * size
            res[name] = {"profd": [], "raw": []}
            for r in range(reps):
                order = ("raw", "profd") if r % 2 == 0 else ("profd", "raw")
                for v in order:
                    run = f"{name}-{r}"
                    if v == "raw":
                        wall = run_raw(endpoint, files, spool, run)
                    else:
                        wall = run_profd(endpoint, files, root, spool, run, parts)
                    res[name][v].append(wall)
                    empty_bucket(c)
                    print(f"{name} {v}: {sizes[name] / wall / 1e6:.1f} MB/s", file=sys.stderr)
            digest_s[name] = verify_cost(files, parts)
            shutil.rmtree(files[0].parent, ignore_errors=True)
    finally:
        moto.terminate()
        try:
            moto.wait(20)
        except subprocess.TimeoutExpired:
            moto.kill()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    details: dict[str, Any] = {}
    for name in sets:
        mbps = {v: [sizes[name] / w / 1e6 for w in ws] for v, ws in res[name].items()}
        p, r = B.summary(mbps["profd"], 1), B.summary(mbps["raw"], 1)
        rows.append(
            B.row(
                f"S3 upload throughput, {name}",
                ">= 0.9x raw boto3",
                p["p50"],
                "MB/s",
                baseline=r["p50"],
                baseline_what="boto3 upload_file",
                met=p["p50"] >= 0.9 * r["p50"],
                spread=f"profd {p['min']}..{p['max']}, raw {r['min']}..{r['max']} MB/s",
            )
        )
        details[name] = {
            "bytes": sizes[name],
            "wall_s": res[name],
            "MBps": mbps,
            "profd_local_digest_s": round(digest_s[name], 3),
            "profd_multipart": sizes[name] // sets[name][0] >= parts[0],
        }
    params = {
        "sets": sets,
        "reps": reps,
        "endpoint": "moto.server (local, in-memory)",
        "profd_workers": 2,
        "profd_multipart_threshold_chunksize": parts,
    }
    B.write_result("s3", args.out, quick, params, rows, details, started)


if __name__ == "__main__":
    main()
