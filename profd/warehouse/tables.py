"""The warehouse's tables: their columns (the only definition: the Arrow schemas, the docs and
the DDL in docs/warehouse.md are made from or checked against it) and where their objects
live. No pyarrow here: the daemon imports this module and never loads pyarrow.

Layout (docs/warehouse.md "Layout"): ``{url}/{table}/date=YYYY-MM-DD/{stem}.parquet``, where
the stem names the writer: ``{node}~{instance}`` (``instance``: a random id the daemon keeps in
its state directory, so a reimaged node with the same name never overwrites the files of the
one before it), plus ``~{HH}`` (the UTC hour) for the hourly tables (all but ``incidents``)
while their day is open. Each writer owns its objects and rewrites one whole object per flush
(a single PUT, or a rename on disk). Once a day has closed, a writer *seals* each hourly
table's day: one object ``{stem}.parquet`` with the whole day, which from then on takes every
change of that day, and which *supersedes* the writer's hourly objects of that date
(:func:`superseded`): a reader leaves them out, so every row is read exactly once, before,
during and after the seal. The hourly objects are deleted a grace period after the seal
(docs/design.md "Warehouse").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

#: Each table's columns, in order: (name, type). The types are named here so that this
#: module (and the daemon, which names tables, partitions and objects through it) needs no
#: pyarrow; :data:`profd.warehouse.arrow.SCHEMAS` makes the Arrow schemas of them:
#: ``ts`` is a UTC timestamp in ms, ``regions`` a map of region name to ms (float32),
#: ``suspects`` a list of {node, role, rank}.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "captures": (
        ("job", "string"),
        ("session", "string"),
        ("node", "string"),
        ("host", "string"),
        ("role", "string"),
        ("rank", "int32"),
        ("world_size", "int32"),
        ("cycle", "int32"),
        ("step_first", "int64"),
        ("step_last", "int64"),
        ("backend", "string"),
        ("label", "string"),
        ("state", "string"),
        ("bytes", "int64"),
        ("stall_ms", "float64"),
        ("trace_key", "string"),
        ("created", "ts"),
    ),
    "rank_steps": (
        ("job", "string"),
        ("session", "string"),
        ("node", "string"),
        ("role", "string"),
        ("rank", "int32"),
        ("cycle", "int32"),
        ("step", "int64"),
        ("ms", "float64"),
        ("compute_ms", "float64"),
        ("collective_ms", "float64"),
        ("idle_ms", "float64"),
        ("mode", "string"),
    ),
    "operators": (
        ("job", "string"),
        ("session", "string"),
        ("node", "string"),
        ("role", "string"),
        ("rank", "int32"),
        ("cycle", "int32"),
        ("name", "string"),
        ("kind", "string"),  # cpu | gpu | collective
        ("calls", "int64"),
        ("self_ms", "float64"),
        ("total_ms", "float64"),
        ("steps", "int32"),  # the steps the capture held: per step = self_ms / steps
    ),
    "job_minutes": (
        ("job", "string"),
        ("role", "string"),
        ("minute", "ts"),
        ("node", "string"),
        ("nodes", "int32"),
        ("ranks", "int32"),
        ("steps", "int64"),
        ("p50_ms", "float64"),
        ("p90_ms", "float64"),
        ("max_ms", "float64"),
        ("slowest_rank", "int32"),
        ("slowest_node", "string"),
        ("vs_baseline", "float64"),
    ),
    "rank_minutes": (
        ("job", "string"),
        ("node", "string"),
        ("role", "string"),
        ("rank", "int32"),
        ("minute", "ts"),
        ("steps", "int32"),
        ("p50_ms", "float32"),
        ("p90_ms", "float32"),
        ("p99_ms", "float32"),
        ("max_ms", "float32"),
        ("regions", "regions"),
    ),
    "incidents": (
        ("id", "string"),
        ("kind", "string"),
        ("job", "string"),
        ("role", "string"),
        ("node", "string"),
        ("state", "string"),
        ("detected", "ts"),
        ("resolved", "ts"),
        ("step", "int64"),
        ("suspects", "suspects"),
        ("session", "string"),
        ("reason", "string"),
        ("lost_rank_s", "float64"),
    ),
}

TABLES = tuple(COLUMNS)
#: Tables written one object per writer per UTC hour: a node's day of them is too large to
#: rewrite at every flush (at one capture a second, the day's capture tables cost the export
#: some 1.3 s of CPU per flush for each hour of the day so far: docs/benchmarks.md).
HOURLY = frozenset({"captures", "rank_steps", "operators", "job_minutes", "rank_minutes"})
#: Tables whose rows are kept ``keep_rank_days`` rather than ``keep_days``.
RANK_DAYS = frozenset({"rank_minutes"})

_PART = re.compile(r"^\d{4}-\d{2}-\d{2}(/\d{2})?$")
_STEM_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def check_part(table: str, part: str) -> None:
    """A partition as the export queue names it: ``YYYY-MM-DD``, or ``YYYY-MM-DD/HH`` for
    the hourly tables (which also take ``YYYY-MM-DD``: a sealed day). ValueError otherwise."""
    if table not in COLUMNS:
        raise ValueError(f"no warehouse table {table!r}")
    if not _PART.match(part) or ("/" in part and table not in HOURLY):
        raise ValueError(f"{table}: bad partition {part!r}")


def writer_stem(node: str, instance: str) -> str:
    """``{node}~{instance}`` with anything unsafe in an object key made ``_``."""
    return f"{_STEM_UNSAFE.sub('_', node)}~{_STEM_UNSAFE.sub('_', instance)}"


def object_key(table: str, part: str, stem: str) -> str:
    """The key, relative to the warehouse's root, of one writer's object for one partition."""
    check_part(table, part)
    date, _, hour = part.partition("/")
    name = f"{stem}~{hour}" if hour else stem
    return f"{table}/date={date}/{name}.parquet"


def stands_for(table: str, part: str, stem: str) -> list[str]:
    """The keys of the objects a writer's rows of ``part`` are read in place of: its object
    for ``part``; for a day of an hourly table, its hourly objects of that date too."""
    keys = [object_key(table, part, stem)]
    if table in HOURLY and "/" not in part:
        keys += [f"{table}/date={part}/{name}" for name in hourly_names(stem)]
    return keys


def hourly_names(stem: str) -> list[str]:
    """The names one writer's hourly objects of a date can have."""
    return [f"{stem}~{h:02d}.parquet" for h in range(24)]


def superseded(paths: Iterable[str]) -> set[str]:
    """The hourly objects among ``paths`` whose writer has a day object in the same ``date=``
    directory (it was sealed: that object holds the whole day, these are left to be deleted).
    A path's writer is its name's ``{node}~{instance}``: no stem holds another ``~``."""
    days: set[tuple[str, str]] = set()
    hours: list[tuple[str, str, str]] = []
    for path in paths:
        folder, _, name = path.rpartition("/")
        fields = name.removesuffix(".parquet").split("~")
        if len(fields) == 2:
            days.add((folder, name.removesuffix(".parquet")))
        elif len(fields) == 3:
            hours.append((folder, f"{fields[0]}~{fields[1]}", path))
    return {path for folder, stem, path in hours if (folder, stem) in days}


#: A fleet object's name: ``~fleet~{serial:08d}.parquet`` (no writer's stem starts with
#: ``~``). It holds many writers' rows of one table's date, each with the name of the
#: writer's object it came from in the column :data:`SOURCE`; the one with the highest
#: serial in a ``date=`` folder is the *chosen* one, the others are left to be deleted
#: (docs/design.md "Warehouse").
FLEET_PREFIX = "~fleet~"
#: The column only fleet objects have: the writer's object a row came from, its name less
#: ``.parquet`` (:func:`source_of`): ``{stem}`` (a day object) or ``{stem}~{HH}`` (an hour).
SOURCE = "_source"
_FLEET = re.compile(r"^~fleet~(\d{8})\.parquet$")


def fleet_key(table: str, date: str, serial: int) -> str:
    """The key of ``table``'s fleet object number ``serial`` for ``date``."""
    check_part(table, date[:10])
    return f"{table}/date={date}/{FLEET_PREFIX}{serial:08d}.parquet"


def fleet_serial(name: str) -> int | None:
    """The serial of a fleet object's file name; None for any other name."""
    m = _FLEET.match(name)
    return int(m.group(1)) if m else None


def stem_of(name: str) -> str | None:
    """The writer stem (``{node}~{instance}``) of a writer's object's file name (a day
    object's or an hourly one's) or of a fleet row's :data:`SOURCE`; None for a fleet
    object's or any other name."""
    fields = name.removesuffix(".parquet").split("~")
    return f"{fields[0]}~{fields[1]}" if len(fields) in (2, 3) and fields[0] else None


def source_of(name: str) -> str | None:
    """What a fleet row taken from the writer's object ``name`` says in :data:`SOURCE`: the
    object's name without ``.parquet`` (``{stem}`` for a day object, ``{stem}~{HH}`` for an
    hourly one); None for a fleet object's or any other name."""
    return name.removesuffix(".parquet") if stem_of(name) is not None else None


def covered(source: str) -> list[str]:
    """The fleet sources an object of a writer's own stands for in its date: an hourly
    object for its own source; a day object (``{stem}``) for the whole day, whichever
    objects of that writer a fleet object took its rows from."""
    if source.count("~") == 2:
        return [source]
    return [source, *(f"{source}~{h:02d}" for h in range(24))]


@dataclass(frozen=True)
class Listed:
    """One object as a listing shows it. ``token`` changes whenever the object is replaced
    (S3's ETag; on disk :func:`disk_token`)."""

    size: int
    token: str


def disk_token(st: os.stat_result) -> str:
    """A file's listing token: its size, mtime and inode (a rename over it changes them)."""
    return f"{st.st_size}-{st.st_mtime_ns}-{st.st_ino}"


#: The footer key of a fleet object's sources: JSON ``{source: token}``, each writer's object
#: whose rows it holds (:data:`SOURCE`) and its listing token then.
SOURCES_KEY = b"profd.sources"
#: The footer key of when it was made (the merging daemon's clock, Unix seconds): the fleet
#: objects it supersedes are deleted ``grace`` after that.
CREATED_KEY = b"profd.created"
#: The footer key of when each source's rows (at that token) first went into a fleet
#: object: JSON ``{source: unix}``; its writer hands that object over ``grace`` after that
#: (a date's fleet object is made again each hour, which must not hold a hand-over back).
SINCE_KEY = b"profd.since"


@dataclass(frozen=True)
class Footer:
    """What a fleet object's footer records: its sources' tokens, when it was made, and
    since when it has held each source at that token."""

    held: dict[str, str]
    made: float
    since: dict[str, float]

    def held_since(self, source: str) -> float:
        return self.since.get(source, self.made)

    @classmethod
    def parse(cls, kv: Mapping[bytes, bytes]) -> Footer:
        """The footer of a fleet object's key-value metadata."""
        made = float(kv.get(CREATED_KEY, b"0"))
        since = {k: float(v) for k, v in json.loads(kv.get(SINCE_KEY, b"{}")).items()}
        return cls(json.loads(kv.get(SOURCES_KEY, b"{}")), made, since)


NO_FLEET = Footer({}, 0.0, {})


@dataclass(frozen=True)
class Plan:
    """How a reader reads a listing of one table: ``skip`` the objects it leaves out
    (hourly objects a day object supersedes, fleet objects that are not their date's
    chosen one, writers' objects whose rows the chosen one holds), and for each chosen
    fleet object the sources (:data:`SOURCE`) whose rows in it it leaves out: those a
    writer's own object read in its date stands for (:func:`covered`)."""

    skip: frozenset[str]
    fleets: dict[str, frozenset[str]]

    def writers(self, paths: Iterable[str]) -> list[str]:
        """``paths`` less those skipped and the fleet objects: each read whole."""
        return [p for p in paths if p not in self.skip and p not in self.fleets]


def plan(
    paths: Iterable[str],
    more: Iterable[tuple[str, str]] = (),
    tokens: Mapping[str, str] | None = None,
    held: Callable[[str], Mapping[str, str]] | None = None,
) -> Plan:
    """The reading :class:`Plan` of ``paths`` (keys or paths of one table's objects).
    ``more``: (folder, source) pairs that count as a writer's objects there although they
    are not listed (a node's unflushed rows of an hour, ``{stem}~{HH}``, or of a sealed day,
    ``{stem}``, read in place of its objects).

    With the listing's ``tokens`` (by path) and ``held`` (a chosen fleet object's path to
    its footer's sources and tokens, asked only of dates where writers' objects are listed),
    a writer's object whose very version the chosen fleet object holds is not read: its
    rows come from the fleet object. Such an object is the only kind a writer ever deletes
    (its hand-over), so a reader that plans this way never reads an object that may be
    deleted under it."""
    listed = list(paths)
    own: dict[str, list[tuple[str, str]]] = {}
    fleets: dict[str, list[tuple[int, str]]] = {}
    for path in listed:
        folder, _, name = path.rpartition("/")
        serial = fleet_serial(name)
        if serial is not None:
            fleets.setdefault(folder, []).append((serial, path))
        elif (source := source_of(name)) is not None:
            own.setdefault(folder, []).append((path, source))
    skip = set(superseded(listed))
    chosen: dict[str, str] = {}
    for folder, found in fleets.items():
        found.sort()
        skip.update(path for _, path in found[:-1])
        chosen[folder] = found[-1][1]
    present: dict[str, set[str]] = {}
    for folder, objects in own.items():
        fleet = chosen.get(folder)
        has: Mapping[str, str] = held(fleet) if fleet and held and tokens is not None else {}
        for path, source in objects:
            token = tokens.get(path) if tokens is not None else None
            if path not in skip and token is not None and has.get(source) == token:
                skip.add(path)
            else:
                present.setdefault(folder, set()).update(covered(source))
    for folder, source in more:
        present.setdefault(folder, set()).update(covered(source))
    fleet_of = {path: frozenset(present.get(folder, ())) for folder, path in chosen.items()}
    return Plan(frozenset(skip), fleet_of)


def cutoff_date(now: float, days: int) -> str:
    """The oldest date (``YYYY-MM-DD``, UTC) a partition kept ``days`` days may have."""
    return datetime.fromtimestamp(now - days * 86400.0, UTC).strftime("%Y-%m-%d")


def expired(table: str, part: str, now: float, keep_days: int, keep_rank_days: int) -> bool:
    """The partition is past its retention: never written again, its mark dropped."""
    days = keep_rank_days if table in RANK_DAYS else keep_days
    return part[:10] < cutoff_date(now, days)
