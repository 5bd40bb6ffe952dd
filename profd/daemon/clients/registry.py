"""The live registry of attached training processes. Owned by the event loop.

Client fields change only through :class:`Registry` methods; everything else reads them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from profd import claims
from profd.control_rows import PeerRow, PsHello, PsRow, hello_part
from profd_client import protocol as P


@dataclass
class Client:
    ident: bytes  # ZeroMQ routing id of the client's DEALER socket
    host: str
    pid: int
    job: str
    role: str
    rank: int
    local_rank: int
    world_size: int
    step_mode: str
    allowed: bool
    torch: str | None
    device: str | None
    nsys_session: str | None = None  # launched by ``profctl run --nsys``
    #: From the kernel (the connection's SO_PEERCRED), never from the hello: the pid in the
    #: daemon's namespace (what the process-statistics thread and liveness look at) and the
    #: process's uid/gid.
    node_pid: int = 0
    uid: int = -1
    gid: int = -1
    attached_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    step: int = 0
    step_at: float = field(default_factory=time.monotonic)
    #: The rate plans are made with: what the client claims (heartbeat ``sps``), never more
    #: than the daemon observed (steps over the wall time between heartbeats).
    sps: float = 0.0
    claimed_sps: float | None = None
    observed_sps: float = 0.0
    #: The (step, time) the next observation is measured from; None: the hello's.
    rate_from: tuple[int, float] | None = None
    state: str = "idle"
    #: Inside attach(), before step 1, until its welcome is sent (hello ``waiting``).
    attaching: bool = False
    cpu: float | None = None
    rss: int | None = None
    gpu_util: float | None = None
    gpu_mem: int | None = None
    #: The protocol version the client speaks; replies go out in it.
    version: int = 1
    #: The profd-client release the process runs (hello ``client_version``).
    client_version: str | None = None
    #: Where the client says each identity field came from (hello ``identity_source``).
    identity_source: dict[str, str] = field(default_factory=dict)
    #: The native id of its thread that counts steps (hello/heartbeat ``training_tid``).
    training_tid: int | None = None
    #: Its flight recorder is on (hello ``flight``): ``stacks`` asks it for a summary.
    flight: bool = False
    #: It keeps a black box (hello ``blackbox``): ``blackbox`` may ask for it.
    blackbox: bool = False
    #: Its hello asked for ``quiet`` answers: one every few heartbeats (the welcome's
    #: ``acks``), not every one.
    quiet: bool = False
    #: Seconds after an answer to its heartbeat before the next one is answered (0: every
    #: one), as its last welcome set it, and when (monotonic) the last one was.
    quiet_s: float = 0.0
    answered_at: float = 0.0
    #: When (monotonic) it re-registered as another rank within the last :data:`MOVES_S`.
    moves: tuple[float, ...] = ()
    _ps_hello: tuple[tuple[Any, ...], str] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        #: Its key in the registry's and the ledgers' maps: asked of every client on every
        #: heartbeat and tick, so made once (host and pid never change for this object).
        self.key: tuple[str, int] = (self.host, self.pid)

    def recent_moves(self, now: float) -> tuple[float, ...]:
        return tuple(t for t in self.moves if now - t < MOVES_S)

    @property
    def identity(self) -> tuple[str, str, int, int]:
        """What sessions select it by and name its files after."""
        return (self.job, self.role, self.rank, self.world_size)

    def ps_hello(self, node: str) -> tuple[Any, ...]:
        """The first columns of its ``ps`` row as listed by daemon ``node``: the hello's
        fields, fixed for this object (a new hello makes a new one), so made and checked once
        (``ps`` lists 1,024 rows on the loop at 1,024 clients). ``RowFault`` names a field
        beyond its definition."""
        part = self._ps_hello
        if part is None or part[1] != node:
            hello = PsHello(
                host=self.host,
                pid=self.pid,
                job=self.job,
                role=self.role,
                rank=self.rank,
                local_rank=self.local_rank,
                world_size=self.world_size,
                step_mode=self.step_mode,
                allowed=self.allowed,
                torch=self.torch,
                device=self.device,
                nsys_session=self.nsys_session,
                attached_at=self.attached_at,
                protocol=self.version,
                client_version=self.client_version,
                uid=self.uid,
                identity_source=self.identity_source,
                node=node,
            )
            part = self._ps_hello = (hello_part(hello), node)
        return part[0]

    def ps_live(
        self, step: int, extrapolated: bool, age_s: float, claimed_by: tuple[int, ...]
    ) -> tuple[Any, ...]:
        """The rest of its ``ps`` row (``control_rows.PS_LIVE``, in that order): its step as
        of now (``step_now``) and every pid that claims its identity (its own alone, unless
        another served process claims it too)."""
        shared = len(claimed_by) > 1
        return (
            step,
            round(self.sps, 2),
            self.state,
            self.cpu,
            self.rss,
            self.gpu_util,
            self.gpu_mem,
            shared,
            claimed_by if shared else (self.pid,),
            extrapolated,
            round(age_s, 3),
        )

    def ps_row(
        self, node: str, step: int, extrapolated: bool, age_s: float, claimed_by: tuple[int, ...]
    ) -> PsRow:
        """Its whole ``ps`` row as one typed value (what ``ps`` sends as two parts)."""
        values = self.ps_hello(node) + self.ps_live(step, extrapolated, age_s, claimed_by)
        return PsRow(**dict(zip(PsRow.__struct_fields__, values, strict=True)))


@dataclass
class Incompatible:
    """A peer that speaks a protocol version this daemon does not serve: listed, not served."""

    ident: bytes
    version: int | None
    fields: dict[str, Any]
    last_seen: float = field(default_factory=time.monotonic)

    def ps_row(self, node: str) -> PeerRow:
        """Its ``ps`` row: what it claimed, each field cut to what a row carries."""
        f = self.fields

        def pick(name: str, kind: type) -> Any:
            v = f.get(name)
            return v if isinstance(v, kind) and not isinstance(v, bool) else None

        return PeerRow(
            host=(pick("host", str) or "?")[:255],
            pid=pick("pid", int),
            job=(pick("job", str) or "?")[:200],
            role=(pick("role", str) or "?")[:200],
            rank=pick("rank", int),
            state="incompatible",
            protocol=self.version,
            client_version=(pick("client_version", str) or "")[:64] or None,
            error=f"speaks protocol version {self.version}",
            node=node,
        )


#: A rank's step is moved on at its rate for this many heartbeat intervals after the heartbeat
#: that carried it; a rank silent for longer may have stopped (a hang, a long checkpoint), and
#: its reported step is shown with its age instead of a guess.
FRESH_HEARTBEATS = 3


def step_now(c: Client, now: float, heartbeat_s: float) -> tuple[int, bool, float]:
    """``c``'s step as of monotonic ``now``: (step, extrapolated, age in seconds).

    The one rule ``ps`` and ``top`` show steps by. Each row is as old as its last heartbeat,
    so the rows of one lockstep job running 100 steps/s differ by up to 100 steps; moved on
    at the rank's rate they agree, and are marked as moved.
    """
    age = now - c.step_at
    if age < 0.0:
        age = 0.0
    if c.sps > 0 and age < FRESH_HEARTBEATS * heartbeat_s:
        # Never past the protocol's bound on a step: the row must stay sendable.
        return min(c.step + math.floor(c.sps * age), P.MAX_STEP), True, age
    return c.step, False, age


#: The shortest interval a rate is observed over: heartbeats queued behind a step that
#: holds the GIL arrive milliseconds apart, and steps over milliseconds are no rate.
RATE_WINDOW_S = 0.5

#: Peers of an unsupported version listed at most (each says hello every heartbeat).
MAX_INCOMPATIBLE = 1024

#: Times a peer may re-register as another rank within :data:`MOVES_S`: each move ends its
#: old rank's minute (a row of the index) and runs the ``[[auto]]`` rules again; a process
#: moves once or twice in its life (when ``torch.distributed`` starts).
MAX_MOVES = 6
MOVES_S = 60.0


def _identity_order(c: Client) -> tuple[str, str, int, str, int]:
    return (c.job, c.role, c.rank, c.host, c.pid)


class Registry:
    """Attached processes, and each job's owner on this node: the uid of the job's first
    process attached here, kept while any of its processes is. A job name is whatever its
    processes say, so any local user can join any job; only the owner's processes speak for
    the job to the watch (its detectors, hang reads, samples and automatic captures): one
    user's figures must not decide what is captured of another's processes."""

    def __init__(self) -> None:
        self.by_ident: dict[bytes, Client] = {}
        self.by_key: dict[tuple[str, int], Client] = {}
        self.incompatible: dict[bytes, Incompatible] = {}
        #: Registered clients per kernel pid and per uid, for the peer limits.
        self._per_process: dict[int, int] = {}
        self._per_user: dict[int, int] = {}
        #: Job -> [owner uid, processes of the job attached].
        self._jobs: dict[str, list[int]] = {}
        #: :meth:`by_identity` and :meth:`claimants` as of the last change of who is attached
        #: (None: changed since). A client's identity never changes in place (a new hello
        #: makes a new record), so only ``add`` and ``remove`` change them; ``ps`` asks for
        #: both at every request, ~0.5 ms at 1,024 clients.
        self._view: tuple[list[Client], dict[claims.Identity, list[int]]] | None = None

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[Client]:
        return iter(list(self.by_key.values()))

    def lookup(self, key: tuple[str, int]) -> Client | None:
        return self.by_key.get(key)

    def peers_of_process(self, node_pid: int) -> int:
        """Clients registered by the process of kernel pid ``node_pid``."""
        return self._per_process.get(node_pid, 0)

    def peers_of_user(self, uid: int) -> int:
        """Clients registered by processes of ``uid``."""
        return self._per_user.get(uid, 0)

    def owner(self, job: str) -> int | None:
        """The uid that owns ``job`` here (None: no process of it attached)."""
        held = self._jobs.get(job)
        return None if held is None else held[0]

    def owned(self, c: Client) -> bool:
        """Whether ``c`` is a process of its job's owner: only those speak for the job."""
        held = self._jobs.get(c.job)
        return held is not None and held[0] == c.uid

    def by_identity(self) -> list[Client]:
        """Every client in (job, role, rank, host, pid) order (the listings' order). The list
        is shared until the next change: callers do not change it."""
        return self._membership()[0]

    def claimants(self) -> dict[claims.Identity, list[int]]:
        """Identities (job, role, rank) that several clients claim, with their pids in
        ascending order (:func:`profd.claims.claimants`). Shared as :meth:`by_identity`."""
        return self._membership()[1]

    def _membership(self) -> tuple[list[Client], dict[claims.Identity, list[int]]]:
        view = self._view
        if view is None:
            ordered = sorted(self.by_key.values(), key=_identity_order)
            shared = claims.claimants(((c.job, c.role, c.rank), c.pid) for c in ordered)
            view = self._view = (ordered, shared)
        return view

    def owned_by_job(self) -> dict[str, list[Client]]:
        """Every job's processes of its owner, by job."""
        out: dict[str, list[Client]] = {}
        jobs = self._jobs
        for c in self.by_key.values():
            if jobs[c.job][0] == c.uid:
                g = out.get(c.job)
                if g is None:
                    out[c.job] = [c]
                else:
                    g.append(c)
        return out

    # --- transitions --------------------------------------------------------------------------
    def seen(self, c: Client, now: float) -> None:
        c.last_seen = now

    def heartbeat(
        self, c: Client, now: float, step: int | None, sps: float | None, state: str | None
    ) -> None:
        c.last_seen = now
        if step is not None:
            self._observe(c, step, now)
            c.step, c.step_at = step, now
        if sps is not None:
            c.claimed_sps = sps
        if step is not None or sps is not None:
            # A claim alone moves no plan: one peer claiming 10^9 steps/s pushed its whole
            # job's --next plan a billion steps ahead.
            claimed = c.claimed_sps
            c.sps = c.observed_sps if claimed is None else min(claimed, c.observed_sps)
        if state is not None:
            c.state = state

    def training_thread(self, c: Client, tid: int | None) -> None:
        """The client says which of its threads counts steps (``stacks`` marks it)."""
        if tid is not None:
            c.training_tid = tid

    def _observe(self, c: Client, step: int, now: float) -> None:
        base_step, base_at = c.rate_from or (c.step, c.step_at)
        if step < base_step:
            # The process counts from the start again (a new run): measure from here.
            c.rate_from, c.observed_sps = (step, now), 0.0
        elif now - base_at >= RATE_WINDOW_S:
            c.observed_sps = (step - base_step) / (now - base_at)
            c.rate_from = (step, now)
        else:
            c.rate_from = (base_step, base_at)

    def observed_step(self, c: Client, step: int, now: float, sent_at: float) -> None:
        """A ``late`` report: the client was at ``step`` some time between ``sent_at`` (when
        the arm it answers was sent) and ``now`` (when the report arrived)."""
        if step > c.step and now > c.step_at:
            # The estimate that planned its steps was low: learn the rate it really ran at
            # since its last report, or the next plan would be just as early. Dividing by the
            # whole interval keeps this a lower bound however late the report was sent.
            c.sps = max(c.sps, (step - c.step) / (now - c.step_at))
        if step > c.step:
            # The step may have been seen seconds before the report left (a training thread
            # holding the GIL delays the agent thread): date it at the earliest it could
            # have been seen, so the next rate is measured over a real interval, not over
            # the milliseconds between two queued reports.
            c.step, c.step_at = step, max(c.step_at, min(sent_at, now))

    def proc_read(
        self,
        c: Client,
        cpu: float | None,
        rss: int | None,
        gpu_util: float | None,
        gpu_mem: int | None,
    ) -> None:
        c.cpu, c.rss, c.gpu_util, c.gpu_mem = cpu, rss, gpu_util, gpu_mem

    def welcomed(self, c: Client) -> None:
        """The welcome is sent: the process no longer waits before step 1."""
        c.attaching = False

    def incompatible_peer(self, ident: bytes, version: int | None, msg: object) -> bool:
        """Note a peer we cannot serve; True the first time it is seen."""
        known = self.incompatible.get(ident)
        if known is not None:
            known.last_seen = time.monotonic()
            return False
        if len(self.incompatible) >= MAX_INCOMPATIBLE:
            return False
        fields = (
            {k: v for k, v in msg.items() if isinstance(k, str)} if isinstance(msg, dict) else {}
        )
        self.incompatible[ident] = Incompatible(ident, version, fields)
        return True

    def add(self, c: Client) -> Client | None:
        """Register ``c``; returns the record it replaces (same process, new socket)."""
        old = self.by_key.get(c.key)
        if old is not None:
            self.by_ident.pop(old.ident, None)
            self._count(old, -1)
            self._left(old.job)
        self.incompatible.pop(c.ident, None)  # it stepped down to a version we serve
        self._view = None
        self.by_key[c.key] = c
        self.by_ident[c.ident] = c
        self._count(c, 1)
        held = self._jobs.get(c.job)
        if held is None:
            self._jobs[c.job] = [c.uid, 1]
        else:
            held[1] += 1
        return old

    def moved(self, c: Client, old: Client, now: float) -> None:
        """``c`` replaced ``old`` as another rank at monotonic ``now``."""
        c.moves = (*old.recent_moves(now), now)

    def remove(self, c: Client) -> None:
        self.by_ident.pop(c.ident, None)
        if self.by_key.get(c.key) is c:
            self._view = None
            del self.by_key[c.key]
            self._count(c, -1)
            self._left(c.job)

    def _count(self, c: Client, delta: int) -> None:
        for counts, k in ((self._per_process, c.node_pid), (self._per_user, c.uid)):
            n = counts.get(k, 0) + delta
            if n:
                counts[k] = n
            else:
                del counts[k]

    def _left(self, job: str) -> None:
        held = self._jobs[job]
        held[1] -= 1
        if held[1] <= 0:
            del self._jobs[job]

    def get(self, ident: bytes) -> Client | None:
        return self.by_ident.get(ident)

    def stale(self, now: float, timeout: float) -> list[Client]:
        for ident, peer in list(self.incompatible.items()):
            if now - peer.last_seen > timeout:
                del self.incompatible[ident]
        return [c for c in self.by_key.values() if now - c.last_seen > timeout]
