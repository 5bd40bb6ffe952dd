"""Fleet objects: a closed day of one table, every writer's rows in one object.

A node can make its own day one object (the seal); fewer objects than nodes needs one writer
to merge the others' days, and a query over a month of a thousand nodes reads thirty objects
instead of thirty thousand (docs/benchmarks.md). The rule every reader applies
(:func:`profd.warehouse.tables.plan`) keeps each row read once at every moment: of a date's
fleet objects only the highest serial counts, and a row of it only if its writer
(:data:`~profd.warehouse.tables.SOURCE`) has no object of its own in the date, which is
read instead. So a writer's object is the truth while it exists, and merging changes nothing
a reader sees until the writer deletes its own object, which it does only once the chosen
fleet object holds that very object (the listing's token, recorded in the fleet object's
footer) and has done so ``grace`` seconds (a reader that listed just before has that long).
A writer that changes a merged day writes its day object again, which takes over at once.

Serials are claimed with a create-if-absent write (S3's ``If-None-Match: *``, ``link`` on
disk), each new fleet object built from the chosen one and the writers' objects beside it:
two writers racing for a serial cannot both win, and the loser's work is dropped.

Who merges: the writers of a date in the order of their stems; the first once the date is
``merge_after`` past its end, one more for each day nobody has (a dead first writer stops
nothing for long). Run in the export's flush process (pyarrow loaded there).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from profd.warehouse.arrow import SCHEMAS
from profd.warehouse.seal import Merging
from profd.warehouse.sink import Listed, Sink
from profd.warehouse.tables import SOURCE, fleet_key, fleet_serial, stem_of

#: The footer key of a fleet object's sources: JSON ``{stem: token}``.
SOURCES_KEY = b"profd.sources"
#: The footer key of when it was made (the merging daemon's clock, Unix seconds): a writer
#: hands its object over ``grace`` after that.
CREATED_KEY = b"profd.created"
#: Days of its own a flush looks at (chosen at random among those due, so a day waiting out
#: its grace period does not hold up the others).
DAYS_PER_FLUSH = 4
ROW_GROUP = 131072


def fleet_schema(table: str) -> pa.Schema:
    return SCHEMAS[table].append(pa.field(SOURCE, pa.string()))


def footer(sink: Sink, table: str, date: str, name: str, size: int) -> tuple[dict[str, str], float]:
    """The ``{stem: token}`` a fleet object's footer records, and when it was made (two
    reads from its end)."""
    key = f"{table}/date={date}/{name}"
    tail = sink.get(key, max(0, size - 8), size)
    length = int.from_bytes(tail[:4], "little") + 8
    meta = pq.read_metadata(pa.BufferReader(sink.get(key, max(0, size - length), size)))
    kv = meta.metadata or {}
    found: dict[str, str] = json.loads(kv.get(SOURCES_KEY, b"{}"))
    return found, float(kv.get(CREATED_KEY, b"0"))


def tend(
    days: list[tuple[str, str]],
    sink: Sink,
    stem: str,
    merging: Merging,
    now: float,
    on_merged: Callable[[str, str], None],
    stopping: Callable[[], bool],
) -> dict[str, int]:
    """This writer's part for some of its ``days`` due (table, date): hand its day object
    over (delete it) where the chosen fleet object holds it; merge where it is one of the
    date's mergers and some writer's object is not held yet. ``on_merged`` is told each day
    whose object is gone. Counts of ``merged`` (fleet objects written) and ``handed``."""
    done = {"merged": 0, "handed": 0}
    for table, date in random.sample(days, min(DAYS_PER_FLUSH, len(days))):
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
    """One day of one table: ``gone`` (this writer has no object there), ``handed`` (its
    object deleted, the chosen fleet object holds it), ``merged`` (a fleet object
    written), or ``waiting``."""
    listed = sink.folder(table, date)
    mine = listed.get(f"{stem}.parquet")
    if mine is None:
        return "gone"
    fleets = sorted((k, n) for n in listed if (k := fleet_serial(n)) is not None)
    serial, chosen = fleets[-1] if fleets else (0, "")
    held, made = footer(sink, table, date, chosen, listed[chosen].size) if chosen else ({}, 0.0)
    if held.get(stem) == mine.token:
        if made > now - merging.grace:
            return "waiting"
        sink.delete(f"{table}/date={date}/{stem}.parquet")
        for _, name in fleets[:-1]:  # superseded for as long as the grace: nobody reads them
            sink.delete(f"{table}/date={date}/{name}")
        return "handed"
    days = {w: o for n, o in listed.items() if (w := stem_of(n)) and n == f"{w}.parquet"}
    order = sorted(days)
    if order.index(stem) >= merging.mergers(date, now):
        return "waiting"
    todo = {s: o for s, o in days.items() if held.get(s) != o.token}
    if not todo:
        return "waiting"
    present = {w for n in listed if (w := stem_of(n)) is not None}
    won = merge(sink, table, date, serial + 1, (chosen, held), todo, present, now)
    return "merged" if won else "waiting"


def merge(
    sink: Sink,
    table: str,
    date: str,
    serial: int,
    base: tuple[str, dict[str, str]],
    todo: dict[str, Listed],
    present: set[str],
    now: float,
) -> bool:
    """Fleet object ``serial`` of ``table``'s ``date``: the rows of the chosen one (``base``:
    its name and sources) of writers with no object of their own any more, and the rows of
    the writers' day objects ``todo`` (name their tokens in its footer). False if another
    writer took the serial first."""
    chosen, held = base
    schema = fleet_schema(table)
    keep = {s: t for s, t in held.items() if s not in present}
    keep.update({s: o.token for s, o in todo.items()})
    meta = {SOURCES_KEY: json.dumps(keep, sort_keys=True).encode(), CREATED_KEY: repr(now).encode()}
    fd, tmp = tempfile.mkstemp(prefix="profd-fleet-", suffix=".parquet")
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, schema.with_metadata(meta), compression="zstd") as w:
            pending: list[pa.Table] = []
            for rows in _rows(sink, table, date, chosen, held, todo, present):
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
    held: dict[str, str],
    todo: dict[str, Listed],
    present: set[str],
) -> Iterator[pa.Table]:
    """The new fleet object's rows, a row group or one writer's day at a time."""
    folder = f"{table}/date={date}"
    schema = fleet_schema(table)
    if chosen:
        gone = pa.array(sorted(s for s in held if s in present), pa.string())
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
