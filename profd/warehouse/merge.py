"""Fleet objects: every writer's rows of one table's date in one object.

A node can make its own day one object (the seal); fewer objects than nodes needs one writer
to merge the others', and a query over a month of a thousand nodes reads thirty objects
instead of thirty thousand, and over today a handful of hours' objects per node instead of
every hour's (docs/benchmarks.md). Each row of a fleet object names in
:data:`~profd.warehouse.tables.SOURCE` the writer's object it came from: ``{stem}`` (a day
object) or ``{stem}~{HH}`` (an hourly one). The rule every reader applies
(:func:`profd.warehouse.tables.plan`) keeps each row read once at every moment: of a date's
fleet objects only the highest serial counts, and a row of it only if neither its source
object nor its writer's day object is in the date, which are read instead. So a writer's
object is the truth while it exists, and merging changes nothing a reader sees until the
writer deletes its own object, which it does only once the chosen fleet object holds that
very object (the listing's token, recorded in the fleet object's footer) and fleet objects
have held it ``grace`` seconds. A writer that changes a merged hour or day writes that
object again, which takes over at once.

What is merged: a writer's hourly object ``merge_after`` seconds after its hour ends (while
the writer has no day object in the date: that supersedes them), its day object
``merge_after`` seconds after its date ends; a day object's rows replace every row of its
writer in the fleet object. Serials are claimed with a create-if-absent write (S3's
``If-None-Match: *``, ``link`` on disk), each new fleet object built from the chosen one and
the writers' objects beside it: two writers racing for a serial cannot both win, and the
loser's work is dropped.

Who merges: the writers of a date in the order of their stems, turned by a hash of the table,
date and hour of the oldest object due (:func:`turn`), so that each merge falls to another
node and none pays for every one (at 1,024 nodes a date's 24 hourly merges of the two minute
tables cost ~440 s of CPU, docs/benchmarks.md); the first of that order once an object is
due, one more for each hour nobody has (a dead first writer stops nothing for long). Run in
the export's flush process (pyarrow loaded there).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.seal import Merging
from profd.warehouse.sink import Sink
from profd.warehouse.tables import (
    CREATED_KEY,
    NO_FLEET,
    SINCE_KEY,
    SOURCE,
    SOURCES_KEY,
    Footer,
    Listed,
    fleet_key,
    fleet_serial,
    source_of,
    stem_of,
)

#: Dates of its own a flush looks at (chosen at random among those due, so a date waiting
#: out its grace period does not hold up the others).
DAYS_PER_FLUSH = 4
ROW_GROUP = 131072


def fleet_schema(table: str) -> pa.Schema:
    return SCHEMAS[table].append(pa.field(SOURCE, pa.string()))


def footer(sink: Sink, table: str, date: str, name: str, size: int) -> Footer:
    """A fleet object's :class:`Footer` (two reads from its end)."""
    key = f"{table}/date={date}/{name}"
    tail = sink.get(key, max(0, size - 8), size)
    length = int.from_bytes(tail[:4], "little") + 8
    meta = pq.read_metadata(pa.BufferReader(sink.get(key, max(0, size - length), size)))
    return Footer.parse(meta.metadata or {})


def tend(
    days: list[tuple[str, str]],
    sink: Sink,
    stem: str,
    merging: Merging,
    now: float,
    on_merged: Callable[[str, str], None],
    stopping: Callable[[], bool],
    always: list[tuple[str, str]] | None = None,
) -> dict[str, int]:
    """This writer's part for some of its ``days`` due (table, date), and for every one of
    ``always`` (its open days, a handful): hand its objects over (delete them) where the
    chosen fleet object holds them; merge where it is one of the date's mergers and some
    writer's object due is not held yet. ``on_merged`` is told each date whose day object
    (or every object of this writer) is gone. Counts of ``merged`` (fleet objects written),
    ``handed`` (day objects handed over) and ``hours`` (dates some of whose hourly objects
    were)."""
    done = {"merged": 0, "handed": 0, "hours": 0}
    looks = random.sample(days, min(DAYS_PER_FLUSH, len(days))) + (always or [])
    for table, date in looks:
        if stopping():
            break
        try:
            what = step(sink, table, date, stem, merging, now)
        except FileNotFoundError:
            # An object listed went before it was read (another writer handed its own over,
            # or deleted a superseded fleet object): the next look lists again.
            what = "waiting"
        if what in ("handed", "gone"):
            on_merged(table, date)
        if what in done:
            done[what] += 1
    return done


def step(sink: Sink, table: str, date: str, stem: str, merging: Merging, now: float) -> str:
    """One date of one table: ``gone`` (this writer has no object there), ``handed`` (its
    day object deleted, the chosen fleet object holds it), ``hours`` (some of its hourly
    objects deleted, the same way), ``merged`` (a fleet object written), or ``waiting``."""
    listed = sink.folder(table, date)
    if not any(stem_of(n) == stem for n in listed):
        return "gone"
    fleets = sorted((k, n) for n in listed if (k := fleet_serial(n)) is not None)
    serial, chosen = fleets[-1] if fleets else (0, "")
    base = footer(sink, table, date, chosen, listed[chosen].size) if chosen else NO_FLEET
    held, old = base.held, now - merging.grace
    ready = mergeable(listed, date, merging, now)
    mine = [
        s
        for s, o in ready.items()
        if stem_of(s) == stem and held.get(s) == o.token and base.held_since(s) <= old
    ]
    if mine:
        for source in mine:
            sink.delete(f"{table}/date={date}/{source}.parquet")
        if base.made <= old:  # superseded for as long as the grace: nobody reads them
            for _, name in fleets[:-1]:
                sink.delete(f"{table}/date={date}/{name}")
        return "handed" if stem in mine else "hours"
    todo = {s: o for s, o in ready.items() if held.get(s) != o.token}
    if not todo:
        return "waiting"
    writers = sorted({w for n in listed if (w := stem_of(n)) is not None})
    oldest = min(todo, key=lambda s: (_due(merging, date, s), s))
    due = _due(merging, date, oldest)
    if turn(writers, table, date, oldest).index(stem) >= merging.mergers(due, now):
        return "waiting"
    won = merge(sink, table, date, serial + 1, (chosen, base), todo, now)
    return "merged" if won else "waiting"


def turn(writers: list[str], table: str, date: str, source: str) -> list[str]:
    """The order in which ``writers`` (sorted stems) may merge ``table``'s ``date`` when
    ``source`` is the oldest object due: turned by a CRC of the table, date and that
    object's hour (``day`` for a day object), the same on every node that lists the same."""
    hour = source.split("~")[2] if source.count("~") == 2 else "day"
    k = zlib.crc32(f"{table}/{date}/{hour}".encode()) % len(writers)
    return writers[k:] + writers[:k]


def mergeable(
    listed: dict[str, Listed], date: str, merging: Merging, now: float
) -> dict[str, Listed]:
    """The writers' objects of a date that may go into a fleet object at ``now``, by source
    (:func:`~profd.warehouse.tables.source_of`): a writer's day object once the date is
    ``merge_after`` past its end; a writer without one, its hourly objects once their
    hour is (a day object supersedes its writer's hourly objects: those are never merged)."""
    sealed = {n.removesuffix(".parquet") for n in listed if n.count("~") == 1}
    out = {}
    for name, o in listed.items():
        source = source_of(name)
        if source is None or (source not in sealed and stem_of(source) in sealed):
            continue
        if _due(merging, date, source) <= now:
            out[source] = o
    return out


def _due(merging: Merging, date: str, source: str) -> float:
    hour = source.split("~")[2] if source.count("~") == 2 else None
    return merging.due_at(date, None if hour is None else int(hour))


def merge(
    sink: Sink,
    table: str,
    date: str,
    serial: int,
    base: tuple[str, Footer],
    todo: dict[str, Listed],
    now: float,
) -> bool:
    """Fleet object ``serial`` of ``table``'s ``date``: the rows of the chosen one (``base``:
    its name and sources) that no object in ``todo`` replaces, and the rows of the writers'
    objects ``todo`` (by source; their tokens named in its footer). A writer's day object
    replaces its rows of every source; an hourly object its own. False if another writer
    took the serial first."""
    chosen, was = base
    schema = fleet_schema(table)
    days = {s for s in todo if s.count("~") == 1}
    keep = {s: t for s, t in was.held.items() if s not in todo and stem_of(s) not in days}
    dropped = sorted(set(was.held) - set(keep))
    since = {s: was.held_since(s) for s in keep}
    keep.update({s: o.token for s, o in todo.items()})
    since.update({s: now for s in todo})
    meta = {
        SOURCES_KEY: json.dumps(keep, sort_keys=True).encode(),
        CREATED_KEY: repr(now).encode(),
        SINCE_KEY: json.dumps(since, sort_keys=True).encode(),
    }
    fd, tmp = tempfile.mkstemp(prefix="profd-fleet-", suffix=".parquet")
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, schema.with_metadata(meta), compression="zstd") as w:
            pending: list[pa.Table] = []
            for rows in _rows(sink, table, date, chosen, dropped, todo):
                pending.append(rows)
                if sum(t.num_rows for t in pending) >= ROW_GROUP:
                    w.write_table(pa.concat_tables(pending))
                    pending = []
            w.write_table(pa.concat_tables(pending) if pending else schema.empty_table())
        return sink.put_new(fleet_key(table, date, serial), Path(tmp))
    finally:
        os.unlink(tmp)


def _rows(
    sink: Sink,
    table: str,
    date: str,
    chosen: str,
    dropped: list[str],
    todo: dict[str, Listed],
) -> Iterator[pa.Table]:
    """The new fleet object's rows, a row group or one writer's object at a time."""
    folder = f"{table}/date={date}"
    schema = fleet_schema(table)
    if chosen:
        gone = pa.array(dropped, pa.string())
        # A day of the biggest table is hundreds of MB: read from a local copy a row group
        # at a time, never whole in memory.
        fd, copy = tempfile.mkstemp(prefix="profd-fleet-base-", suffix=".parquet")
        os.close(fd)
        try:
            sink.fetch(f"{folder}/{chosen}", Path(copy))
            f = pq.ParquetFile(copy)
            for i in range(f.num_row_groups):
                rows = f.read_row_group(i).cast(schema)
                yield rows.filter(pc.invert(pc.is_in(rows[SOURCE], gone)))
        finally:
            os.unlink(copy)
    for s in sorted(todo):
        rows = pq.read_table(pa.BufferReader(sink.get(f"{folder}/{s}.parquet")))
        rows = rows.select(SCHEMAS[table].names).cast(SCHEMAS[table])
        yield rows.append_column(SOURCE, pa.array([s] * rows.num_rows, pa.string()))
