"""Who is on the other end of a unix socket, from the kernel rather than from the peer.

libzmq reads ``SO_PEERCRED`` when an IPC connection is accepted and attaches it to every
message of that connection as the ``Peer-Address`` property, ``host:uid:gid:pid`` (4.3+ on
Linux). That is the only identity the daemon believes: a ``hello`` that claims another pid
is refused, and a message whose connection is not the one that said hello is dropped.

In a container the pid a process sees for itself (and puts in its hello) is not the pid the
kernel reports to the daemon in the node's namespace; ``/proc/PID/status`` lists a process's
pid in every namespace it lives in (``NSpid``), so a claim is accepted when it is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class PeerCred:
    uid: int
    gid: int
    pid: int  # in the daemon's pid namespace

    @classmethod
    def parse(cls, address: str | None) -> PeerCred | None:
        """``host:uid:gid:pid`` as libzmq formats it for IPC peers; None for anything else."""
        if not address:
            return None
        parts = address.rsplit(":", 3)
        if len(parts) != 4:
            return None
        try:
            uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            return None
        if min(uid, gid) < 0 or pid <= 0:
            return None
        return cls(uid, gid, pid)


def _status(pid: int, proc: Path = PROC) -> dict[str, str]:
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.strip()
    return fields


def namespace_pids(pid: int, proc: Path = PROC) -> tuple[int, ...]:
    """``pid``'s pid in each pid namespace, outermost first; ``()`` if it is gone."""
    st = _status(pid, proc)
    if not st:
        return ()
    try:
        # Kernels before 4.1 have no NSpid: there the only pid is the one we have.
        return tuple(int(x) for x in st.get("NSpid", str(pid)).split())
    except ValueError:
        return (pid,)


def groups(pid: int, proc: Path = PROC) -> frozenset[int]:
    """The process's primary and supplementary gids (empty if it is gone)."""
    st = _status(pid, proc)
    # Gid: real, effective, saved, fs; the effective one (second) is what permissions use.
    gid = st.get("Gid", "").split()[1:2]
    return frozenset(int(x) for x in gid + st.get("Groups", "").split() if x.isdigit())


def claim_problem(claimed_pid: int, cred: PeerCred | None, proc: Path = PROC) -> str | None:
    """Why a hello claiming ``claimed_pid`` over a connection with ``cred`` is refused."""
    if cred is None:
        return "the daemon cannot learn this connection's process from the kernel"
    if claimed_pid == cred.pid:
        return None
    if claimed_pid in namespace_pids(cred.pid, proc):
        return None
    return f"claims pid {claimed_pid} but the connection belongs to pid {cred.pid}"


@dataclass(frozen=True)
class Requester:
    """A ``profctl`` on ``control.sock``: whose processes and sessions it may act on."""

    uid: int
    privileged: bool  # root, the daemon's uid, ``[daemon] admin_group``, a TCP operator

    def may_act_on(self, owner: int | None) -> bool:
        return self.privileged or owner == self.uid

    @classmethod
    def operator(cls) -> Requester:
        """An operator whose key is in ``[cluster] authorized_keys`` (TCP): an admin."""
        return cls(-1, True)

    @classmethod
    def of(cls, peer: PeerCred | None, own_uid: int, admin_gid: int | None) -> Requester:
        if peer is None:
            # Without credentials nobody is trusted with other users' processes.
            return cls(-1, False)
        privileged = peer.uid in (0, own_uid) or (
            admin_gid is not None and admin_gid in groups(peer.pid)
        )
        return cls(peer.uid, privileged)
