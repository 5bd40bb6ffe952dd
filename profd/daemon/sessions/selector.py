"""Which attached clients a session targets."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from profd import globs
from profd.daemon.clients.registry import Client
from profd_client.ranks import RankSpecError, parse_ranks


class SelectorError(ValueError):
    pass


@dataclass(frozen=True)
class Selector:
    job: str | None = None
    roles: tuple[str, ...] = ()
    ranks: frozenset[int] | None = None  # None: every rank
    host: str | None = None
    pids: frozenset[int] | None = None

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Selector:
        roles = spec.get("roles") or ()
        if isinstance(roles, str):
            roles = (roles,)
        if not all(isinstance(r, str) and r for r in roles):
            raise SelectorError("--role takes glob patterns")
        ranks: frozenset[int] | None = None
        raw = spec.get("ranks")
        if raw is not None:
            try:
                ranks = parse_ranks(str(raw))
            except RankSpecError as exc:
                raise SelectorError(str(exc)) from None
        pids = spec.get("pids")
        if pids is not None and not all(isinstance(p, int) for p in pids):
            raise SelectorError("--pid takes integers")
        return cls(
            job=spec.get("job") or None,
            roles=tuple(roles),
            ranks=ranks,
            host=spec.get("host") or None,
            pids=frozenset(pids) if pids else None,
        )

    def matches(self, c: Client) -> bool:
        if self.job is not None and c.job != self.job:
            return False
        if self.host is not None and c.host != self.host:
            return False
        if self.pids is not None and c.pid not in self.pids:
            return False
        if self.roles and not any(globs.match(c.role, r) for r in self.roles):
            return False
        return self.ranks is None or c.rank in self.ranks

    def describe(self) -> str:
        parts = []
        if self.job:
            parts.append(f"job={self.job}")
        if self.roles:
            parts.append("role=" + ",".join(self.roles))
        if self.ranks is not None:
            parts.append("ranks=" + ",".join(map(str, sorted(self.ranks))))
        if self.host:
            parts.append(f"host={self.host}")
        if self.pids:
            parts.append("pid=" + ",".join(map(str, sorted(self.pids))))
        return " ".join(parts) or "all"

    def select(self, clients: Iterable[Client]) -> list[Client]:
        """Matching clients that their PROFD_RANKS allowlist lets profile."""
        hits = [c for c in clients if self.matches(c)]
        if not hits:
            return []
        explicit = self.ranks is not None or self.pids is not None
        allowed = [c for c in hits if c.allowed]
        if explicit and len(allowed) < len(hits):
            denied = ", ".join(f"{c.role} rank {c.rank}" for c in hits if not c.allowed)
            raise SelectorError(f"excluded by the job's PROFD_RANKS: {denied}")
        return sorted(allowed, key=lambda c: (c.job, c.role, c.rank, c.pid))


def describe_attached(clients: Iterable[Client]) -> str:
    """A short listing for "matches nothing" errors."""
    groups: dict[tuple[str, str], list[int]] = {}
    for c in clients:
        groups.setdefault((c.job, c.role), []).append(c.rank)
    if not groups:
        return "no processes are attached"
    return "attached: " + "; ".join(
        f"job={j} role={r} ranks={','.join(map(str, sorted(rs)))}"
        for (j, r), rs in sorted(groups.items())
    )
