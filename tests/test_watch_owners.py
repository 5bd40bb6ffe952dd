"""The watch surface across users: a root daemon in group mode, the job's owner and another
member of the daemon's group (real users, ``useradd``), each running real client processes.

* a hang of the owner's job: the other member sees that it happened, not the owner's stacks
  (neither through ``profctl incidents``/``incident`` nor in the spool), and the daemon's log
  names no function of it;
* a process of the other member joins the owner's job claiming fast steps: the slow-rank rule
  judges the owner's ranks among themselves, and its capture takes only the owner's;
* a process of the other member joins the owner's job claiming step 10^9: the samples land
  on the owner's steps, on the owner's ranks, and the owner's ``start --next`` is not held
  behind them; a rank of the owner's that jumps is left out of the samples and counted.
"""

from __future__ import annotations

import json
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from daemonproc import wait_for
from harness import BIN, Daemon
from users import User, group_daemon

pytestmark = [pytest.mark.slow]

USERS = ("profd-victim", "profd-attacker")
PYTHON = str(BIN / "python")
WAIT = 90.0
#: A function name only the owner's stacks hold.
SECRET = "victims_secret_waiting_place"

#: A client process: ``job rank step_s hang_after jump_at jump_to`` (0: never).
PROG = f"""
import sys, time, profd_client
job, rank, step_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
hang_after, jump_at, jump_to = (int(a) for a in sys.argv[4:7])
profd_client.attach(job=job, role="worker", rank=rank, world_size=4, step="manual",
                    heartbeat=0.2)
def {SECRET}():
    time.sleep(3600)
for i in range(1, 10**8):
    if hang_after and i > hang_after:
        {SECRET}()
    if jump_at and i == jump_at:
        profd_client.step(jump_to)
    time.sleep(step_s)
    profd_client.step()
"""


#: (user, job, rank, step seconds, hang after, jump at, jump to): one ``PROG``.
Run = tuple[User, str, int, float, int, int, int]


@contextmanager
def procs(*runs: Run) -> Iterator[list[subprocess.Popen[str]]]:
    started = []
    try:
        for user, job, rank, step_s, hang_after, jump_at, jump_to in runs:
            args = [job, rank, step_s, hang_after, jump_at, jump_to]
            started.append(user.popen([PYTHON, "-c", PROG, *map(str, args)]))
        yield started
    finally:
        for p in started:
            p.kill()
            p.wait()


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout


def _step(d: Daemon, rank: int) -> int:
    return int(next(r["step"] for r in d.ps() if r["rank"] == rank))


def _attached(d: Daemon, job: str, n: int, min_step: int = 1) -> list[dict[str, Any]]:
    def ready() -> list[dict[str, Any]] | None:
        rows = [r for r in d.ps() if r["job"] == job]
        return rows if len(rows) >= n and all(r["step"] >= min_step for r in rows) else None

    rows: list[dict[str, Any]] = wait_for(ready, WAIT, f"{n} ranks of {job} attached")
    return rows


HANG = """
[watch]
stall_after = 2.0
hold = 2.0
"""


def test_another_users_hang_shows_them_no_stacks_and_the_log_no_functions() -> None:
    with (
        group_daemon(USERS, HANG) as (d, (victim, attacker)),
        procs((victim, "theirs", 0, 0.02, 25, 0, 0)),
    ):
        _attached(d, "theirs", 1)

        def hung() -> list[dict[str, Any]] | None:
            rows = [r for r in d.ctl_json("incidents", "--kind", "hang") if r["job"] == "theirs"]
            return rows or None

        [row] = wait_for(hung, WAIT, "the hang incident")
        iid = row["id"]
        # Root sees every stack; so does the job's owner.
        assert SECRET in json.dumps(row["evidence"]), row
        assert SECRET in _ok(victim.ctl("incident", iid, "--json"))
        # Another member of the group learns that the job hangs, and nothing of its stacks.
        listed = json.loads(_ok(attacker.ctl("incidents", "--json")))
        assert [r["id"] for r in listed] == [iid], listed
        for out in (
            json.dumps(listed),
            _ok(attacker.ctl("incident", iid, "--json")),
            _ok(attacker.ctl("incident", iid)),
            _ok(attacker.ctl("incidents")),
        ):
            # Neither its functions, its files nor its native frames.
            for shown in (SECRET, "<string>", "clock_nanosleep"):
                assert shown not in out, out
        doc = json.loads(_ok(attacker.ctl("incident", iid, "--json")))
        assert doc["evidence"]["stalled_s"] >= 2.0, doc
        assert "withheld" in doc["evidence"]["verdict"], doc
        assert not doc["evidence"].get("ranks") and not doc["evidence"].get("summary"), doc
        # On disk: the owner's file, readable by nobody else of the group.
        path = d.spool / "theirs" / "incidents" / f"{iid}.json"
        st = path.stat()
        assert st.st_uid == victim.uid and stat.S_IMODE(st.st_mode) == 0o600, (st, oct(st.st_mode))
        assert SECRET in path.read_text()
        r = attacker.run("/bin/cat", str(path))
        assert r.returncode != 0 and SECRET not in r.stdout, r
        assert SECRET in victim.run("/bin/cat", str(path)).stdout
        log = d.log.read_text()
        assert f"incident {iid}" in log, log[-3000:]
        assert SECRET not in log and "clock_nanosleep" not in log, log[-3000:]


SLOW = """
[watch]
window = 3.0
hold = 1.5
cooldown = 600.0
"""


def test_another_users_fast_peers_cannot_make_the_owners_rank_the_slow_one() -> None:
    # The owner's rank 0 (30 ms) and rank 2 (90 ms: really slow); two processes of another
    # user join the job as ranks 1 and 3 claiming 5 ms steps. Judged with them, rank 0 is
    # six times slower than its "peers" and its capture arms on the owner's process.
    with (
        group_daemon(USERS, SLOW) as (d, (victim, attacker)),
        procs((victim, "owned", 0, 0.03, 0, 0, 0), (victim, "owned", 2, 0.09, 0, 0, 0)) as mine,
    ):
        _attached(d, "owned", 2)
        with procs((attacker, "owned", 1, 0.005, 0, 0, 0), (attacker, "owned", 3, 0.005, 0, 0, 0)):
            rows = _attached(d, "owned", 4, min_step=20)
            # Shown as what they are: their own uid.
            assert {r["rank"]: r["uid"] for r in rows} == {
                0: victim.uid,
                1: attacker.uid,
                2: victim.uid,
                3: attacker.uid,
            }

            def named() -> list[dict[str, Any]] | None:
                rows = [r for r in d.ctl_json("incidents") if r["kind"] == "slow_rank"]
                return rows or None

            first = wait_for(named, WAIT, "a slow_rank incident")
            # Three windows more (rank 2 steps 33 times a window): one naming another rank
            # would have come by now.
            wait_for(
                lambda: _step(d, 2) > (first[0]["step"] or 0) + 100,
                WAIT,
                "rank 2 to go 100 steps past the incident",
            )
            found = named()
        assert found is not None
        assert [s["rank"] for r in found for s in r["suspects"]] == [2], found
        inc = found[0]
        assert inc["session"], inc
        s = d.ctl_json("show", inc["session"])
        assert {t["pid"] for t in s["targets"]} == {p.pid for p in mine}, s
        assert s["owner"] == victim.uid, s


SAMPLE = """
[watch]
sample_every = 200
sample_steps = 2
"""


def test_another_users_peer_does_not_decide_where_samples_land() -> None:
    # The owner's rank 0 steps at 50/s; a process of another user joins the job claiming step
    # 10^9; a second process of the owner's jumps from step 150 to 10^9 as well.
    with (
        group_daemon(USERS, SAMPLE) as (d, (victim, attacker)),
        procs((victim, "sampled", 0, 0.02, 0, 0, 0)) as (mine,),
    ):
        _attached(d, "sampled", 1)
        with procs(
            (attacker, "sampled", 1, 0.02, 0, 1, 10**9),
            (victim, "sampled", 2, 0.02, 0, 150, 10**9),
        ) as (_, jumper):
            wait_for(
                lambda: sum(r["step"] > 10**9 for r in d.ps() if r["job"] == "sampled") == 2,
                WAIT,
                "both jumps reported",
            )

            def samples() -> list[dict[str, Any]]:
                return [
                    s
                    for s in d.ctl_json("sessions", "--job", "sampled", "--limit", "100")
                    if s["label"] == "watch:sample"
                ]

            before = {s["id"] for s in samples()}

            def after_jumps() -> list[dict[str, Any]] | None:
                got = [s for s in samples() if s["id"] not in before]
                return got if got and _step(d, 0) > got[0]["cycles"][0][2] else None

            wait_for(after_jumps, WAIT, "a sample of rank 0 armed after the jumps")
            for s in samples():
                assert s["cycles"][0][1] < 10**6, s
                shown = d.ctl_json("show", s["id"])
                pids = {t["pid"] for t in shown["targets"]}
                # Never the other user's process; the owner's jumper only before its jump.
                early = s["id"] in before and pids == {mine.pid, jumper.pid}
                assert pids == {mine.pid} or early, shown
            assert d.ctl_json("status")["watch"]["implausible_steps"] >= 1
            # The owner's own capture of its rank 0 plans at its steps, not behind a sample
            # a billion steps ahead.
            mine_next = ("start", "--job", "sampled", "--pid", str(mine.pid), "--next", "--json")
            out = json.loads(_ok(victim.ctl(*mine_next)))
            assert out["steps"][0] < 10**6, out
            assert jumper.poll() is None
            # A sample armed far ahead (by an older daemon, or for a rank that left) is
            # withdrawn before it holds the owner's rank.
            far = d.ctl_json("start", "--job", "sampled", "--pid", str(mine.pid),
                             "--at-step", str(10**9), "--label", "watch:sample")  # fmt: skip
            ended = wait_for(
                lambda: (lambda s: s if s["state"] == "cancelled" else None)(
                    d.ctl_json("show", far["session"])
                ),
                WAIT,
                "the far sample withdrawn",
            )
            assert "withdrawn" in ended["error"], ended
