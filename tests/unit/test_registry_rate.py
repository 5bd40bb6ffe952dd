"""How a ``late`` report teaches the registry a client's step rate (time as an argument)."""

from __future__ import annotations

from profd.daemon.clients.registry import Client, Registry


def client(step: int, at: float) -> Client:
    c = Client(
        ident=b"x", host="h", pid=1, job="j", role="main", rank=0, local_rank=0, world_size=1,
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
