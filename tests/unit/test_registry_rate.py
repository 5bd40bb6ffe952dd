"""How a ``late`` report teaches the registry a client's step rate (time as an argument)."""

from __future__ import annotations

import msgspec

from profd.daemon.clients.registry import RATE_WINDOW_S, Client, Registry


def client(step: int, at: float, host: str = "h", pid: int = 1) -> Client:
    c = Client(
        ident=b"x", host=host, pid=pid, job="j", role="main", rank=0, local_rank=0, world_size=1,
        step_mode="auto", allowed=True, torch=None, device=None,
    )  # fmt: skip
    c.step, c.step_at = step, at
    return c


def test_two_queued_late_reports_do_not_make_a_rate_of_millions() -> None:
    # Seen in CI: a GIL-bound job's first late report (step 14,624, seen seconds earlier) and
    # its second (step 43,579) arrived 3 ms apart. Measured between arrivals that is ten
    # million steps/s and the session was moved to step 36 million, out of reach.
    reg, c = Registry(), client(step=12, at=100.0)
    reg.observed_step(c, 14_624, now=106.0, sent_at=100.2)
    first = c.sps
    assert 2_000 < first < 3_000
    reg.observed_step(c, 43_579, now=106.003, sent_at=106.0)
    assert c.sps < 10_000  # over the ~6 s since the first arm was sent, not over 3 ms
    assert c.step == 43_579


def test_a_late_report_never_lowers_the_step_or_the_rate() -> None:
    reg, c = Registry(), client(step=500, at=100.0)
    c.sps = 50.0
    reg.observed_step(c, 400, now=101.0, sent_at=100.5)
    assert (c.step, c.step_at, c.sps) == (500, 100.0, 50.0)


def heartbeats(
    reg: Registry, c: Client, start: float, every: float, steps: list[int], sps: float | None
) -> None:
    for i, step in enumerate(steps, 1):
        reg.heartbeat(c, start + i * every, step, sps, "idle")


def test_a_claimed_rate_is_capped_by_the_rate_the_daemon_observes() -> None:
    # A peer claiming the protocol's maximum rate while its steps advance 20 per second.
    reg, c = Registry(), client(step=0, at=100.0)
    heartbeats(reg, c, 100.0, 1.0, [20, 40, 60], sps=1e9)
    assert 19 < c.sps <= 20.0
    # A peer that claims a rate and never steps has no rate at all.
    reg, c = Registry(), client(step=5, at=100.0)
    heartbeats(reg, c, 100.0, 0.2, [5] * 10, sps=1e9)
    assert c.sps == 0.0


def test_an_honest_claim_below_the_observed_rate_is_kept() -> None:
    reg, c = Registry(), client(step=0, at=100.0)
    heartbeats(reg, c, 100.0, 1.0, [20, 40], sps=18.5)
    assert c.sps == 18.5
    reg, c = Registry(), client(step=0, at=100.0)
    heartbeats(reg, c, 100.0, 1.0, [20, 40], sps=None)  # a client that claims nothing
    assert c.sps == 20.0


def test_bunched_heartbeats_make_no_huge_rate() -> None:
    # Two heartbeats queued behind a GIL-holding step arrive 3 ms apart: the rate is measured
    # over at least RATE_WINDOW_S, not over the milliseconds between them.
    reg, c = Registry(), client(step=0, at=100.0)
    reg.heartbeat(c, 101.0, 20, None, None)
    reg.heartbeat(c, 101.003, 60, None, None)
    assert c.sps == 20.0
    assert RATE_WINDOW_S >= 0.5
    reg.heartbeat(c, 102.0, 80, None, None)
    assert c.sps == 60.0  # 60 steps over the second since the last measure


def test_a_step_counter_that_goes_back_starts_a_new_measure() -> None:
    reg, c = Registry(), client(step=1000, at=100.0)
    reg.heartbeat(c, 101.0, 1020, None, None)
    reg.heartbeat(c, 102.0, 3, None, None)  # the process started counting again
    assert c.sps == 0.0 and c.step == 3
    reg.heartbeat(c, 103.0, 13, None, None)
    assert c.sps == 10.0


def test_peers_are_counted_per_process_and_per_user() -> None:
    reg = Registry()

    def peer(host: str, node_pid: int, uid: int) -> Client:
        c = client(0, 0.0, host)
        c.ident, c.node_pid, c.uid = host.encode(), node_pid, uid
        return c

    a, b, other = peer("a", 10, 1000), peer("b", 10, 1000), peer("c", 11, 1001)
    for c in (a, b, other):
        reg.add(c)
    assert (reg.peers_of_process(10), reg.peers_of_user(1000), reg.peers_of_user(1001)) == (2, 2, 1)
    reg.add(peer("a", 10, 1000))  # the same peer again (a new socket): no new peer
    assert (reg.peers_of_process(10), reg.peers_of_user(1000)) == (2, 2)
    reg.remove(a)  # the record it replaced: nothing to take away
    assert reg.peers_of_process(10) == 2
    reg.remove(reg.by_key[("a", 1)])
    reg.remove(b)
    assert (reg.peers_of_process(10), reg.peers_of_user(1000), reg.peers_of_process(11)) == (
        0,
        0,
        1,
    )
    assert 10 not in reg._per_process  # a process gone leaves no entry behind


def test_a_job_is_owned_by_the_uid_of_its_first_process_while_any_is_attached() -> None:
    reg = Registry()
    first, other, second = (client(step=0, at=100.0, pid=pid) for pid in (1, 2, 3))
    first.uid, other.uid, second.uid = 1001, 1002, 1001
    first.ident, other.ident, second.ident = b"a", b"b", b"c"
    reg.add(first)
    reg.add(other)
    assert reg.owner("j") == 1001 and reg.owner("elsewhere") is None
    assert [reg.owned(c) for c in (first, other)] == [True, False]
    reg.remove(first)  # the owner's first process left, another of the job stays
    reg.add(second)
    assert reg.owner("j") == 1001 and reg.owned_by_job() == {"j": [second]}
    reg.remove(second)
    reg.remove(other)
    assert reg.owner("j") is None
    reg.add(other)  # the job attaches again: its first process decides
    assert reg.owner("j") == 1002


def test_each_ps_row_carries_the_latest_heartbeat_and_its_claimants() -> None:
    reg, c = Registry(), client(step=5, at=100.0)
    first = c.ps_row("n1", 5, False, 0.5, ())
    reg.heartbeat(c, 101.0, 9, 4.0, "capturing")
    c.cpu, c.rss = 12.5, 1 << 20
    second = c.ps_row("n1", 11, True, 0.5, ())
    assert (first.step, first.state, first.cpu_percent, first.age_s) == (5, "idle", None, 0.5)
    assert (second.step, second.steps_per_s, second.state) == (11, 4.0, "capturing")
    assert (second.cpu_percent, second.rss_bytes, second.step_extrapolated) == (12.5, 1 << 20, True)
    assert (second.duplicate, second.claimed_by) == (False, (1,))
    shared = c.ps_row("n2", 11, True, 0.5, (1, 7))
    assert (shared.duplicate, shared.claimed_by, shared.node) == (True, (1, 7), "n2")
    assert c.ps_row("n1", 11, True, 0.5, ()).claimed_by == (1,)  # not the last row's
    assert msgspec.structs.asdict(first).keys() == msgspec.structs.asdict(second).keys()


def test_the_identity_order_and_the_claimants_follow_every_attach_and_detach() -> None:
    """``ps`` reads both at every request from a view the registry keeps until who is attached
    changes: it must never show a process gone or miss one come."""
    reg = Registry()

    def proc(host: str, pid: int, rank: int, job: str = "j") -> Client:
        c = client(0, 0.0, host, pid)
        c.ident, c.rank, c.job = f"{host}{pid}".encode(), rank, job
        return c

    def listed() -> list[tuple[str, int, str, int]]:
        return [(c.job, c.rank, c.host, c.pid) for c in reg.by_identity()]

    b1, a0, other = proc("b", 7, 1), proc("a", 5, 0), proc("a", 9, 0, job="i")
    for c in (b1, a0, other):
        reg.add(c)
    assert listed() == [("i", 0, "a", 9), ("j", 0, "a", 5), ("j", 1, "b", 7)]
    assert reg.claimants() == {}
    twin = proc("c", 3, 1)  # a second process claims j rank 1
    reg.add(twin)
    assert listed() == [("i", 0, "a", 9), ("j", 0, "a", 5), ("j", 1, "b", 7), ("j", 1, "c", 3)]
    assert reg.claimants() == {("j", "main", 1): [3, 7]}
    reg.remove(b1)
    assert listed() == [("i", 0, "a", 9), ("j", 0, "a", 5), ("j", 1, "c", 3)]
    assert reg.claimants() == {}
    again = proc("a", 5, 2)  # the same process (host, pid) says hello as rank 2
    assert reg.add(again) is a0
    assert listed() == [("i", 0, "a", 9), ("j", 1, "c", 3), ("j", 2, "a", 5)]
    reg.remove(a0)  # the record it replaced: nothing changes
    assert listed() == [("i", 0, "a", 9), ("j", 1, "c", 3), ("j", 2, "a", 5)]
