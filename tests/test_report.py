"""profctl report / diff / report --timeline end to end.

One real daemon uploading to moto's S3 server, one real 3-rank gloo job whose behaviour the
test switches through a file while it runs: rank 1 does extra work before the collective on
every step (session A), nobody does (B), every rank does extra ``aten::addmm`` (C), nobody
does, captured ``--with-stack --profile-memory`` (D: profd's own frames, Python frames and
addresses must stay out of every operator table; CPU memory pages, linked). The module
fixture captures the three sessions, asks for the reports, then stops the daemon and removes
its spool, and asks S3 alone; the tests check what each answer says. No assertion depends on
how fast anything runs.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import BIN, Daemon, Jobs, wait_for
from s3fixtures import BUCKET, MotoServer

#: One job and one daemon for the whole file (the module fixture ``run``): on one xdist
#: worker, or each worker would start its own (``dev.py test`` runs ``--dist loadgroup``).
pytestmark = pytest.mark.xdist_group("report_run")

PREFIX = "reports"
URL = f"s3://{BUCKET}/{PREFIX}"
WAIT = 180.0
ACTIVE = "6"


@dataclass
class Run:
    root: Path
    daemon: Daemon
    sessions: dict[str, str] = field(default_factory=dict)
    docs: dict[str, dict[str, Any]] = field(default_factory=dict)
    html: Path | None = None
    text: str = ""
    timeline: dict[str, Any] = field(default_factory=dict)
    timeline_doc: dict[str, Any] = field(default_factory=dict)
    timeline_beside: list[str] = field(default_factory=list)  # what is next to the file
    in_cycle_dirs: list[str] = field(default_factory=list)  # any timeline inside a cycle dir
    diff: dict[str, Any] = field(default_factory=dict)
    diff_text: str = ""
    from_s3: dict[str, Any] = field(default_factory=dict)
    s3_timeline_doc: dict[str, Any] = field(default_factory=dict)  # merged from S3 alone
    timeline_header: bytes = b""  # the first bytes of the merged gzip
    stack_doc: dict[str, Any] = field(default_factory=dict)  # D's report (--json)
    stack_text: str = ""  # D's report (text) and its page
    stack_html: Path | None = None
    stack_summaries: dict[str, str] = field(default_factory=dict)  # D's per-rank summary.txt
    stack_memory: dict[str, str] = field(default_factory=dict)  # D's per-rank memory.html


def s3_config() -> str:
    return f"""
[s3]
url = "{URL}"
region = "us-east-1"
addressing_style = "path"
checksum_when_required = true
backoff_base = 0.2
backoff_max = 2.0
"""


def ctl_json(d: Daemon, *args: str, env: dict[str, str] | None = None) -> Any:
    r = subprocess.run(
        [str(BIN / "profctl"), *args, "--json"],
        env=env or d.env(),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert r.returncode == 0, f"profctl {args}: {r.returncode} {r.stderr}{r.stdout}"
    return json.loads(r.stdout)


def steps_on(d: Daemon, n: int) -> None:
    """Wait until every rank is ``n`` steps past where the furthest one is now."""
    now = max(r["step"] for r in d.ps())
    d.wait_attached(3, timeout=WAIT, min_step=now + n)


def capture(d: Daemon, mode: Path, *options: str) -> str:
    """A session of ``ACTIVE`` steps; the job rests (``mode``) as soon as every rank has
    captured them, so that it leaves the CPU to the daemon taking in the traces."""
    sid: str = ctl_json(d, "start", "--next", "--active", ACTIVE, *options)["session"]
    d.wait_captured(sid, WAIT)
    mode.write_text("rest")
    final = d.wait_ended(sid, WAIT)
    assert final["state"] == "done", final
    return sid


def wait_uploaded(d: Daemon, sid: str) -> None:
    def done() -> bool:
        db = sqlite3.connect(f"file:{d.state_dir / 'index.db'}?mode=ro", uri=True, timeout=30)
        try:
            rows = db.execute(
                "SELECT kind, upload_state FROM files WHERE session = ?", (sid,)
            ).fetchall()
        finally:
            db.close()
        return any(k == "session" for k, _ in rows) and all(s == "uploaded" for _, s in rows)

    wait_for(done, WAIT, f"session {sid} uploaded", every=0.3)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("report")
    (root / "moto").mkdir()
    moto = MotoServer(root / "moto").start()
    d = Daemon(root / "profd", extra_env=moto.env())
    d.root.mkdir()
    d.config = d.root / "profd.toml"
    d.config.write_text(s3_config())
    d.start()
    jobs = Jobs(root)
    mode = root / "mode"
    mode.write_text("straggler 1")
    r = Run(root, d)
    try:
        # The extra work is well above what a loaded 2-core machine adds as noise to the
        # collective times of 3 ranks (tens of ms).
        jobs.start("straggler.py", nproc=3, daemon=d, MODE_FILE=str(mode), EXTRA_MS="150")
        d.wait_attached(3, timeout=WAIT, min_step=3)
        wait_for(
            lambda: all(p["steps_per_s"] > 0 for p in d.polled_ps()), WAIT, "step rates", every=0.2
        )
        # Slow steps first, then fast ones: ``--next`` puts a session about a second of the
        # job's measured step rate ahead, so a capture right after a switch from fast steps
        # to slow ones would wait out many slow steps (~5 s) before it begins.
        for name, text in (("A", "straggler 1"), ("C", "slow"), ("B", "none"), ("D", "none")):
            mode.write_text(text)
            steps_on(d, 4)  # every rank has read the new mode
            stack = ("--with-stack", "--profile-memory") if name == "D" else ()
            r.sessions[name] = capture(d, mode, *stack)
        jobs.kill_all()
        a, b, c = (r.sessions[k] for k in "ABC")
        r.html = root / "a.html"
        r.docs["A"] = ctl_json(d, "report", a, "-o", str(r.html))
        r.docs["B"] = ctl_json(d, "report", b, "-o", str(root / "b.html"))
        text = d.ctl("report", a, "-o", str(root / "a2.html"))
        assert text.returncode == 0, text.stderr
        r.text = text.stdout
        r.diff = ctl_json(d, "diff", b, c)
        r.diff_text = d.ctl("diff", b, c).stdout
        r.timeline = ctl_json(d, "report", a, "--timeline", "-o", str(root / "a3.html"))
        for path in r.timeline["timelines"]:
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                r.timeline_doc = json.load(fh)
            r.timeline_beside = sorted(p.name for p in Path(path).parent.iterdir())
        r.timeline_header = Path(r.timeline["timelines"][0]).read_bytes()[:64]
        r.in_cycle_dirs = [str(p) for p in d.spool.rglob("c*/*timeline*")]
        sid = r.sessions["D"]
        r.stack_html = root / "d.html"
        r.stack_doc = ctl_json(d, "report", sid, "-o", str(root / "d0.html"))
        text = d.ctl("report", sid, "-o", str(r.stack_html))
        assert text.returncode == 0, text.stderr
        r.stack_text = text.stdout + r.stack_html.read_text(encoding="utf-8")
        for f in d.spool.rglob(f"{sid}/c*/*"):
            if f.name.endswith(".summary.txt"):
                r.stack_summaries[f.name] = f.read_text(encoding="utf-8")
            elif f.name.endswith(".memory.html"):
                r.stack_memory[f.name] = f.read_text(encoding="utf-8")
        wait_uploaded(d, a)
        d.stop()
        shutil.rmtree(d.spool)
        env = {**os.environ, **moto.env(), "PROFD_RUNTIME_DIR": str(root / "no-daemon")}
        env.pop("PROFD_CONFIG", None)
        r.from_s3 = ctl_json(d, "report", a, "--s3", URL, "-o", str(root / "s3.html"), env=env)
        s3_tl = ctl_json(
            d, "report", a, "--s3", URL, "--timeline", "--timeline-dir", str(root / "s3tl"),
            "-o", str(root / "s3tl.html"), env=env,
        )  # fmt: skip
        for path in s3_tl["timelines"]:
            with gzip.open(path, "rt") as fh:
                r.s3_timeline_doc = json.load(fh)
        yield r
    finally:
        jobs.kill_all()
        d.stop()
        moto.stop()


def by_rank(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {x["rank"]: x for x in doc["ranks"]}


def test_the_rank_with_extra_work_is_the_straggler(run: Run) -> None:
    doc = run.docs["A"]
    assert set(doc) >= {"session", "steps", "ranks", "stragglers"}
    assert doc["session"] == run.sessions["A"]
    assert [(s["rank"], s["role"]) for s in doc["stragglers"]] == [(1, "main")], doc["verdict"]
    ranks = by_rank(doc)
    assert sorted(ranks) == [0, 1, 2]
    assert len(doc["steps"]) >= 2
    for other in (0, 2):
        assert ranks[other]["collective_ms"] > ranks[1]["collective_ms"]
    assert ranks[1]["compute_ms"] > max(ranks[0]["compute_ms"], ranks[2]["compute_ms"])
    why = doc["stragglers"][0]["why"]
    assert "rank 1" in why and "compute" in why and "aten::mm" in why
    assert "straggler" not in run.text or "rank 1" in run.text
    assert "rank 1" in run.text.splitlines()[1]


def test_the_same_job_without_extra_work_has_no_straggler(run: Run) -> None:
    doc = run.docs["B"]
    assert doc["stragglers"] == [], doc["verdict"]
    # Nobody named. On a loaded machine one rank of an even job may lead by 5 % of a step
    # within the noise of 6 steps: the rule then says it cannot tell, never names it.
    assert doc["verdict"].startswith(("no straggler", "not enough steps to tell")), doc["verdict"]
    assert sorted(by_rank(doc)) == [0, 1, 2]


def test_report_from_s3_alone_is_the_same(run: Run) -> None:
    assert not run.daemon.spool.exists()
    assert run.from_s3 == run.docs["A"]


def test_diff_puts_the_slowed_operator_first(run: Run) -> None:
    d = run.diff
    assert d["a"] == run.sessions["B"] and d["b"] == run.sessions["C"]
    top = d["ops"][0]
    assert top["name"] == "aten::addmm", d["ops"][:3]
    # B never ran aten::addmm: not recorded there, not a change from 0.
    assert top["a_ms"] is None and top["not_recorded"] == "a" and top["b_ms"] > 0
    assert top["delta_ms"] is None
    assert d["summary"]["step"]["delta_ms"] > 0
    assert d["steps"] and all("delta_ms" in s for s in d["steps"])
    first_op = next(ln for ln in run.diff_text.splitlines() if ln.startswith("aten::"))
    assert first_op.startswith("aten::addmm") and first_op.split()[1] == "-", first_op
    assert first_op.endswith("not recorded in A")


def test_merged_timeline_has_every_rank_aligned_beside_the_cycle_dir(run: Run) -> None:
    (path,) = run.timeline["timelines"]
    out = Path(path)
    assert out.name == "c0.timeline.json.gz"
    assert out.parent.name == run.sessions["A"]
    assert "c0" in run.timeline_beside  # beside the cycle dir
    assert run.in_cycle_dirs == []  # and never in one (HTA would take it for a rank)
    doc = run.timeline_doc
    events = doc["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    assert len(names) == 3
    assert all(re.fullmatch(r"main r[012] @\S+", n) for n in names.values()), names
    steps: dict[int, dict[int, float]] = {pid: {} for pid in names}
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#"):
            steps[e["pid"]][int(e["name"].split("#")[1])] = e["ts"]
    assert all(steps[pid] for pid in names)
    first = doc["otherData"]["aligned_on_step"]
    starts = {steps[pid][first] for pid in names}
    assert len(starts) == 1, starts  # the same instant on every rank


def test_the_merged_timeline_from_s3_alone_is_the_same_as_from_the_spool(run: Run) -> None:
    local, remote = run.timeline_doc, run.s3_timeline_doc
    assert remote, "no timeline written from S3"

    def procs(doc: dict[str, Any]) -> list[str]:
        return sorted(
            e["args"]["name"]
            for e in doc["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"
        )

    assert procs(remote) == procs(local)
    assert remote["otherData"]["aligned_on_step"] == local["otherData"]["aligned_on_step"]
    assert len(remote["traceEvents"]) == len(local["traceEvents"])


def test_the_merged_timelines_gzip_header_names_the_final_file(run: Run) -> None:
    head = run.timeline_header
    assert head[:2] == b"\x1f\x8b" and head[3] & 0x08, head  # gzip, with FNAME
    name = head[10 : head.index(b"\0", 10)]
    assert name == b"c0.timeline.json", name


def test_with_stack_tables_hold_the_users_operators_only(run: Run) -> None:
    """A real --with-stack capture: no profd frame, no zmq, no Python frame, no address in
    any operator table (the report's, the per-rank summaries'), and no operator above the
    median step unless the page says why."""
    doc, text = run.stack_doc, run.stack_text
    assert sorted(by_rank(doc)) == [0, 1, 2] and doc["ops"]
    names = [o["name"] for o in doc["ops"]]
    assert "aten::mm" in names, names
    noise = re.compile(r"profd_client|zmq|\.py\(\d+\)|0x[0-9a-f]{4,}")
    assert not [n for n in names if noise.search(n)], names
    step = sorted(r["step_ms"] for r in doc["ranks"])[1]
    over = [o for o in doc["ops"] if o["median_ms"] > step]
    assert not over or "outside the profiled steps" in text, (over, step)
    assert "Wall-clock" in text  # what the table counts, under it
    assert len(run.stack_summaries) == 3
    for name, summary in run.stack_summaries.items():
        ops, sites = summary.split("## Python call sites (--with-stack)")
        ops = ops.split("## CPU operators")[1]
        assert "aten::mm" in ops and not noise.search(ops), (name, ops)
        assert re.search(r"straggler\.py\(\d+\)", sites), sites
        assert not re.search(r"profd_client|zmq/|0x[0-9a-f]{4,}", sites), sites


def test_cpu_memory_pages_draw_no_reserved_line_and_the_report_links_them(run: Run) -> None:
    assert len(run.stack_memory) == 3
    for name, page in run.stack_memory.items():
        assert 'class="allocated"' in page, name
        assert 'class="reserved"' not in page and "peak reserved" not in page, name
    assert run.stack_html is not None
    page = run.stack_html.read_text(encoding="utf-8")
    links = re.findall(r'<a href="(file://[^"]+\.memory\.html)">', page)
    assert len(links) == 3, page[-2000:]
    for link in links:
        assert Path(link.removeprefix("file://")).name in run.stack_memory


# --- the page in a real browser ------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.skip("no chromium, and apt-get cannot install it here (not root or no apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run([apt, "update", "-qq"], env=env, capture_output=True, timeout=600)
    r = subprocess.run(
        [apt, "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900
    )
    found = shutil.which("chromium")
    if found is None:
        pytest.skip(f"apt-get install chromium failed: {r.stderr.decode(errors='replace')[-300:]}")
    return found


def headless(chromium: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_html_report_renders_in_chromium(run: Run, chromium: str, tmp_path: Path) -> None:
    assert run.html is not None
    page = run.html.read_text(encoding="utf-8")
    # Self-contained: nothing to fetch, nothing to run.
    assert not re.search(r"<script|<link|\bsrc=|https?://", page)
    url = run.html.as_uri()
    dom = headless(chromium, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "Uncaught" not in dom.stderr and "SyntaxError" not in dom.stderr
    svgs = re.findall(r"<svg\b.*?</svg>", dom.stdout, re.S)
    assert len(svgs) >= 3 and all("<rect" in s for s in svgs[:3])
    assert "main r1" in dom.stdout
    shot = tmp_path / "report.png"
    r = headless(chromium, f"--screenshot={shot}", "--window-size=1200,1600", url)
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    print(f"report screenshot: {shot}")


def test_memory_page_links_render_in_chromium(run: Run, chromium: str) -> None:
    assert run.stack_html is not None
    dom = headless(chromium, "--dump-dom", run.stack_html.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    anchors = re.findall(r'<a href="file://[^"]+\.memory\.html">main r[012] @', dom.stdout)
    assert len(anchors) == 3, dom.stdout[-3000:]
