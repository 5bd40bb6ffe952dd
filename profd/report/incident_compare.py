"""What differs in an incident's capture (docs/design.md "Watch", Automatic capture): ``profctl
incident ID``, and the top of the capture's HTML report.

Read from per-rank statistics alone (the index, or ``show``/``session.json`` maps), never
the traces, and computed by the ``diff`` engine (:func:`profd.report.diff.diff_reports`):

* **suspect against peer**: the capture's suspects (side B) against the healthy peer captured
  beside them (side A), per operator and per step: a positive delta is what the suspect spends
  more. Same session, same steps: steps pair by number.
* for a ``regression`` (every captured rank is a suspect: there is no peer), **the capture
  against the job's last sample before it** (side A), on the ranks both have: what the job
  spends more now than when it was last sampled. Without such a sample, a note says so.

The result is a JSON-able map (the incident's ``comparison``); :func:`comparison_text` prints
it for ``profctl incident ID``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from profd.report.diff import diff_reports, diff_text
from profd.report.model import build_report
from profd.store.index import SessionRepo
from profd.watch.incident_record import Incident
from profd.watch.kinds import registry as kinds
from profd.watch.sampling import LABEL as SAMPLE_LABEL

Who = tuple[str, str, int]


def _who(t: Mapping[str, Any]) -> Who:
    return (str(t["host"]), str(t["role"]), int(t["rank"]))


def _label(ws: list[Who]) -> str:
    return ", ".join(f"{role} r{rank}@{host}" for host, role, rank in ws) or "nobody"


def _with(session: Mapping[str, Any], targets: list[Any]) -> dict[str, Any]:
    return {**session, "targets": targets}


def compare(
    incident: Mapping[str, Any],
    capture: Mapping[str, Any],
    sample: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The comparison of ``incident`` (its map: ``kind``, ``suspects``) from its processed
    ``capture`` session, and for a regression the job's last ``sample`` before it (None:
    there is none); sessions as ``show --json`` or the index give them."""
    kind = str(incident["kind"])
    suspected = {(str(s["host"]), str(s["role"]), int(s["rank"])) for s in incident["suspects"]}
    targets = list(capture.get("targets") or [])
    suspects = [t for t in targets if _who(t) in suspected]
    peers = [t for t in targets if _who(t) not in suspected]
    out: dict[str, Any] = {
        "incident": incident.get("id"),
        "kind": kind,
        "session": capture.get("id"),
        "suspects": [list(_who(t)) for t in suspects],
        "peers": [list(_who(t)) for t in peers],
        "suspect_vs_peer": None,
        "sample": None,
        "capture_vs_sample": None,
        "notes": [],
    }
    notes: list[str] = out["notes"]
    if kinds.known(kind).job_changed:
        if sample is None:
            notes.append(
                "no sample of the job before the capture to compare it with"
                " ([watch] sample_every is off, or the job was not sampled yet)"
            )
        else:
            out["sample"] = sample.get("id")
            out["capture_vs_sample"] = _against_sample(capture, sample, notes)
        return out
    b = build_report(_with(capture, suspects))
    a = build_report(_with(capture, peers))
    if not b.ranks or not a.ranks:
        side = "suspect" if not b.ranks else "peer"
        notes.append(f"the capture has no statistics of any {side}: nothing to compare")
        return out
    d = diff_reports(a, b)
    d["a"] = f"peer {_label([_who(t) for t in peers])}"
    d["b"] = f"suspect {_label([_who(t) for t in suspects])}"
    out["suspect_vs_peer"] = d
    return out


def _against_sample(
    capture: Mapping[str, Any], sample: Mapping[str, Any], notes: list[str]
) -> dict[str, Any] | None:
    captured = {_who(t) for t in capture.get("targets") or []}
    both = [t for t in sample.get("targets") or [] if _who(t) in captured]
    if not both:
        notes.append("the sample has none of the captured ranks: compared with all of its ranks")
        both = list(sample.get("targets") or [])
    a = build_report(_with(sample, both))
    b = build_report(capture)
    if not a.ranks or not b.ranks:
        notes.append("the capture or the sample has no statistics: nothing to compare")
        return None
    d = diff_reports(a, b)
    d["a"] = f"sample {a.session}"
    d["b"] = f"capture {b.session}"
    return d


def comparison_from_index(
    sessions: SessionRepo, incident: Incident | Mapping[str, Any], session_id: str
) -> dict[str, Any]:
    """:func:`compare` for ``incident`` and its processed capture ``session_id``, read from
    the index (for a regression, with the job's last sample created before the capture)."""
    inc = incident.to_dict() if isinstance(incident, Incident) else dict(incident)
    capture = sessions.session(session_id)
    if capture is None or capture["id"] != session_id:
        return {
            "incident": inc.get("id"),
            "kind": inc["kind"],
            "session": session_id,
            "notes": [f"session {session_id} is not in the index"],
        }
    sample = None
    if kinds.known(str(inc["kind"])).job_changed:
        sid = sessions.last_labelled(str(inc["job"]), SAMPLE_LABEL, float(capture["created_at"]))
        sample = sessions.session(sid) if sid is not None else None
    return compare(inc, capture, sample)


def comparison_text(c: Mapping[str, Any]) -> str:
    """``profctl incident ID``'s account of a comparison."""
    lines = [f"capture {c.get('session')}"]
    for key, title in (
        ("suspect_vs_peer", "suspect against peer (delta: what the suspect spends more)"),
        ("capture_vs_sample", "capture against the job's last sample (delta: what is new)"),
    ):
        d = c.get(key)
        if d:
            lines += ["", title, diff_text(d).rstrip("\n")]
    lines += [f"note: {n}" for n in c.get("notes") or []]
    return "\n".join(lines) + "\n"


def headline(c: Mapping[str, Any], n: int = 3) -> list[str]:
    """The few operators that differ most, for a one-line summary and the HTML page."""
    d = c.get("suspect_vs_peer") or c.get("capture_vs_sample")
    if not d:
        return []
    rows = [o for o in d["ops"] if o.get("delta_ms") is not None and o["delta_ms"] > 0]
    return [f"{o['name']}: +{o['delta_ms']:.2f} ms/step" for o in rows[:n]]
