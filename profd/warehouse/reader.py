"""Reading the warehouse: its objects as Arrow datasets, a node's unflushed rows laid over
them, and a DuckDB connection that can run one SELECT over them and nothing else.

A warehouse is an absolute local directory or ``s3://bucket/prefix`` (read with pyarrow's
own S3 client: DuckDB's httpfs extension is a download, which a locked-down or offline
machine cannot make). Each table is the Parquet objects under ``{url}/{table}/``,
hive-partitioned on ``date`` (a ``YYYY-MM-DD`` string): on local disk read by DuckDB's own
reader (allowed that one directory), from S3 as a pyarrow dataset with the schema of
:data:`SCHEMAS` given rather than read from the objects, so opening a table reads none.
An :class:`Overlay` replaces one writer's object for one partition: that file is left out
and the overlay's rows are read instead, so a row is seen once whether or not its node has
flushed it. Each table is listed once per query with the objects' tokens (through boto3
from S3: pyarrow's listing has no ETags), and the reading rule
(:func:`profd.warehouse.tables.plan`) picks what to read from that one listing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.fs as pafs

from profd.warehouse.arrow import SCHEMAS, Overlay, arrow_table
from profd.warehouse.tables import (
    SOURCE,
    TABLES,
    Footer,
    Listed,
    Plan,
    disk_token,
    object_key,
    plan,
    stands_for,
)

if TYPE_CHECKING:
    import pyarrow.dataset as ds

#: Where ``profctl query`` and the named queries read when no daemon is asked.
WAREHOUSE_ENV = "PROFD_WAREHOUSE"
#: The hive partition column every table has besides its own.
DATE = pa.field("date", pa.string())
#: Object reads in flight at once: from S3 each is a round trip, most of a query's time.
IO_THREADS = 64


class WarehouseError(Exception):
    """A warehouse that cannot be opened or a query it refuses, as one line."""


class StaleOverlay(WarehouseError):
    """A node's unflushed rows of an hour came before its day was sealed: the listing holds
    that writer's day object, which has the hour's older rows. Ask the node again."""


def table_schema(table: str) -> pa.Schema:
    """A table's columns as a reader sees them: :data:`SCHEMAS` plus ``date``."""
    return SCHEMAS[table].append(DATE)


@dataclass(frozen=True)
class S3Settings:
    """How to reach an S3-compatible store; ``None`` fields fall back to the SDK's chain."""

    endpoint_url: str | None = None
    region: str | None = None


@dataclass(frozen=True)
class Location:
    """An opened warehouse root: ``fs`` and ``root`` (``bucket/prefix`` or a local path);
    from S3, ``client`` (boto3's) lists it: pyarrow's listing has no ETags."""

    url: str
    fs: pafs.FileSystem
    root: str
    client: Any = None

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key


def locate(url: str, s3: S3Settings | None = None) -> Location:
    """The warehouse at ``url``: an absolute path, or ``s3://bucket[/prefix]``."""
    if url.startswith("s3://"):
        root = url[5:].strip("/")
        if not root:
            raise WarehouseError(f"warehouse {url!r}: no bucket")
        fs = s3_filesystem(s3 or S3Settings())
        bucket = root.split("/", 1)[0]
        try:
            found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
        except OSError as exc:
            raise WarehouseError(f"warehouse {url}: {_one_line(exc)}") from None
        if not found:
            # A listing under a missing bucket is empty: say so rather than answer nothing.
            raise WarehouseError(f"warehouse {url}: no bucket {bucket!r}")
        return Location(url, fs, root, s3_client(s3 or S3Settings()))
    if "://" in url or not os.path.isabs(url):
        raise WarehouseError(f"warehouse {url!r}: use an absolute path or s3://bucket/prefix")
    return Location(url, pafs.LocalFileSystem(), url.rstrip("/") or "/")


def s3_filesystem(s3: S3Settings) -> pafs.S3FileSystem:
    """pyarrow's S3 client with the credentials boto3's default chain finds (environment,
    shared files, instance role) and the endpoint from ``s3``, else ``AWS_ENDPOINT_URL``."""
    import boto3

    session = boto3.session.Session()
    creds = session.get_credentials()
    kw: dict[str, Any] = {}
    if creds is not None:
        frozen = creds.get_frozen_credentials()
        kw.update(
            access_key=frozen.access_key,
            secret_key=frozen.secret_key,
            session_token=frozen.token,
        )
    else:
        kw["anonymous"] = True
    region = s3.region or session.region_name
    if region:
        kw["region"] = region
    endpoint = _endpoint(s3)
    if endpoint:
        scheme, sep, rest = endpoint.partition("://")
        kw["endpoint_override"] = rest.rstrip("/") if sep else endpoint
        kw["scheme"] = scheme if sep else "https"
    pa.set_io_thread_count(IO_THREADS)
    return pafs.S3FileSystem(**kw)


def _endpoint(s3: S3Settings) -> str | None:
    endpoint = s3.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
    return endpoint or os.environ.get("AWS_ENDPOINT_URL")


def s3_client(s3: S3Settings) -> Any:
    """boto3's S3 client for the same store and credentials as :func:`s3_filesystem`, and
    the same path-style requests to an endpoint named (pyarrow's way, and MinIO's)."""
    import boto3
    from botocore.config import Config

    endpoint = _endpoint(s3)
    style = {"s3": {"addressing_style": "path"}} if endpoint else {}
    config = Config(retries={"max_attempts": 3, "mode": "standard"}, **style)
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint, region_name=s3.region, config=config)


def _listing(loc: Location, table: str) -> dict[str, Listed]:
    """Every Parquet object of ``table`` by path (as ``loc.fs`` names it), sorted, with the
    size and token the writers' merges compare (:class:`~profd.warehouse.sink.Sink`)."""
    out: dict[str, Listed] = {}
    try:
        if loc.client is None:
            for folder, _, names in os.walk(loc.path(table), onerror=_unless_missing):
                for name in names:
                    if name.endswith(".parquet") and not name.startswith("."):
                        path = f"{folder}/{name}"
                        try:
                            st = os.stat(path)
                        except FileNotFoundError:
                            continue
                        out[path] = Listed(st.st_size, disk_token(st))
        else:
            bucket, _, prefix = loc.path(table).partition("/")
            pages = loc.client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=bucket, Prefix=prefix + "/"):
                for o in page.get("Contents", []):
                    if o["Key"].endswith(".parquet"):
                        etag = str(o["ETag"]).strip('"')
                        out[f"{bucket}/{o['Key']}"] = Listed(int(o["Size"]), etag)
    except Exception as exc:  # an OSError on disk, botocore's errors from S3
        raise WarehouseError(f"cannot list {loc.url}/{table}: {_one_line(exc)}") from None
    return dict(sorted(out.items()))


def _unless_missing(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):  # a table not written yet is only empty
        raise exc


def held_by(loc: Location, path: str) -> dict[str, str]:
    """The sources and tokens the fleet object at ``path`` holds (its footer: one or two
    reads from its end); none if it went since the listing (the read of it fails then, and
    the query runs again)."""
    import pyarrow.parquet as pq

    try:
        with loc.fs.open_input_file(path) as f:
            meta = pq.read_metadata(f)
    except (FileNotFoundError, OSError):
        return {}
    return Footer.parse(meta.metadata or {}).held


_DATE_DIR = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/[^/]*$")


def overlay_rows(o: Overlay) -> pa.Table:
    """An overlay's rows with the ``date`` its partition names."""
    rows = o.rows.select(SCHEMAS[o.table].names).cast(SCHEMAS[o.table])
    return rows.append_column(DATE, pa.array([o.part[:10]] * rows.num_rows, pa.string()))


def table_dataset(
    loc: Location, table: str, files: Mapping[str, Listed], overlays: Iterable[Overlay] = ()
) -> ds.Dataset:
    """``table``'s rows: its objects, less those an overlay replaces, plus the overlays'."""
    # Imported here: pyarrow.dataset brings pandas along, half a second profctl on local
    # disk does not need.
    import pyarrow.dataset as ds

    mine = [o for o in overlays if o.table == table]
    replaced = set(replaced_paths(loc, table, mine))
    schema = table_schema(table)
    fmt = ds.ParquetFileFormat()
    # Each fragment told its size (from the listing) and its date (from its key): from S3
    # that saves a HEAD request per object, a third of the requests of a small object.
    fragments = [
        fmt.make_fragment(
            path, loc.fs, partition_expression=ds.field("date") == m.group(1), file_size=o.size
        )
        for path, o in files.items()
        if path not in replaced and (m := _DATE_DIR.search(path))
    ]
    parts: list[ds.Dataset] = []
    if fragments:
        parts.append(ds.FileSystemDataset(fragments, schema, fmt, loc.fs))
    extra = [overlay_rows(o) for o in mine if o.rows.num_rows]
    if extra or not parts:
        parts.append(ds.dataset(pa.concat_tables(extra) if extra else schema.empty_table()))
    return parts[0] if len(parts) == 1 else ds.dataset(parts)


def replaced_paths(loc: Location, table: str, overlays: Iterable[Overlay]) -> list[str]:
    """The objects of ``table`` that ``overlays`` stand in for, as ``loc.fs`` names them."""
    return [
        loc.path(key)
        for o in overlays
        if o.table == table
        for key in stands_for(o.table, o.part, o.stem)
    ]


def locked(allowed: Sequence[str] = ()) -> Any:
    """A DuckDB connection with no way out: no file or network access but to the
    directories ``allowed``, no extensions, no Python variables as tables, and its settings
    locked so a query cannot undo that. Made before anything touches a statement: even
    binding one (to list its tables) may open the files it names."""
    import duckdb

    con = duckdb.connect(":memory:")
    if allowed:
        con.execute(
            "SET allowed_directories = $dirs", {"dirs": [d.rstrip("/") + "/" for d in allowed]}
        )
    con.execute("SET python_enable_replacements = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def native_view(
    con: Any,
    loc: Location,
    table: str,
    overlays: Sequence[Overlay],
    files: Iterable[str],
    fleet: str = "",
) -> None:
    """``table`` as a view over DuckDB's own Parquet reader (local disk only: it is about
    three times faster than a pyarrow dataset over thousands of small objects): the writers'
    objects ``files``, less those an overlay replaces, then ``fleet`` (:func:`fleet_sql`)
    and the overlays' rows. Named one by one, never by a glob: DuckDB would list the
    directories again when the query runs, and an object written or handed over since the
    listing the reading rule was applied to would be read twice or not at all."""
    mine = [o for o in overlays if o.table == table]
    replaced = set(replaced_paths(loc, table, mine))
    paths = ", ".join(_literal(f) for f in files if f not in replaced)
    if paths:
        sql = (
            f"SELECT * FROM read_parquet([{paths}], hive_partitioning = true,"
            " hive_types = {'date': VARCHAR})"
        )
    else:
        con.register(f"empty_{table}", table_schema(table).empty_table())
        sql = f"SELECT * FROM empty_{table}"
    con.execute(f"CREATE VIEW {table} AS {_with_more(con, table, sql, fleet, mine)}")


def _with_more(con: Any, table: str, sql: str, fleet: str, overlays: list[Overlay]) -> str:
    """``sql`` (a table's writers' rows) with its fleet objects' rows and its overlays'."""
    if fleet:
        sql += f" UNION ALL BY NAME {fleet}"
    extra = [overlay_rows(o) for o in overlays if o.rows.num_rows]
    if extra:
        con.register(f"overlay_{table}", pa.concat_tables(extra))
        sql += f" UNION ALL BY NAME SELECT * FROM overlay_{table}"
    return sql


def fleet_sql(
    con: Any, loc: Location, table: str, fleets: Mapping[str, Listed], p: Plan, native: bool
) -> str:
    """A SELECT of the rows of ``table``'s chosen fleet objects that count: those whose
    source no object of the writer's own in the date stands for
    (:func:`profd.warehouse.tables.plan`). The chosen objects of dates without such objects
    are read whole; the others less their covered sources, by an anti-join (a filter
    written out per row costs a second over a month of a thousand nodes)."""
    if not fleets:
        return ""
    whole = {f: n for f, n in fleets.items() if not p.fleets.get(f)}
    part = {f: n for f, n in fleets.items() if p.fleets.get(f)}
    selects = []
    for name, chosen in (("whole", whole), ("part", part)):
        if not chosen:
            continue
        if native:
            paths = ", ".join(_literal(f) for f in chosen)
            source = (
                f"read_parquet([{paths}], hive_partitioning = true,"
                " hive_types = {'date': VARCHAR})"
            )
        else:
            source = f"fleet_{name}_{table}"
            con.register(source, fleet_dataset(loc, table, chosen))
        if name == "whole":
            selects.append(f"SELECT * EXCLUDE ({SOURCE}) FROM {source}")
            continue
        covered = [
            (m.group(1), s)
            for path in chosen
            if (m := _DATE_DIR.search(path))
            for s in sorted(p.fleets[path])
        ]
        con.register(
            f"covered_{table}",
            pa.table(
                {
                    "date": pa.array([d for d, _ in covered], pa.string()),
                    "source": pa.array([s for _, s in covered], pa.string()),
                }
            ),
        )
        selects.append(
            f"SELECT f.* EXCLUDE ({SOURCE}) FROM {source} f ANTI JOIN covered_{table} c"
            f" ON f.date = c.date AND f.{SOURCE} = c.source"
        )
    return "SELECT * FROM (" + " UNION ALL BY NAME ".join(selects) + ")"


def fleet_dataset(loc: Location, table: str, fleets: Mapping[str, Listed]) -> ds.Dataset:
    """The fleet objects ``fleets`` as one dataset, with their :data:`SOURCE` column."""
    import pyarrow.dataset as ds

    schema = table_schema(table).insert(len(SCHEMAS[table]), pa.field(SOURCE, pa.string()))
    fmt = ds.ParquetFileFormat()
    fragments = [
        fmt.make_fragment(
            path, loc.fs, partition_expression=ds.field("date") == m.group(1), file_size=o.size
        )
        for path, o in fleets.items()
        if (m := _DATE_DIR.search(path))
    ]
    return ds.FileSystemDataset(fragments, schema, fmt, loc.fs)


def is_local(loc: Location) -> bool:
    return isinstance(loc.fs, pafs.LocalFileSystem)


def open_tables(
    loc: Location,
    tables: Iterable[str],
    overlays: Sequence[Overlay] = (),
    progress: Callable[[str], None] | None = None,
    native: bool | None = None,
    read: dict[str, Listed] | None = None,
) -> Any:
    """A :func:`locked` connection with every table as a view: ``tables`` with their
    objects and overlays (DuckDB's reader on local disk, pyarrow's from S3, or as
    ``native`` says), the others empty. Only ``tables`` are listed: a listing is most of
    a small query's time in S3. ``read``, when given, gets every object the views read, as
    the listing showed it."""
    local = is_local(loc)
    native = local if native is None else native and local
    con = locked([loc.root] if local else [])
    wanted = set(tables)
    for name in TABLES:
        mine = [o for o in overlays if o.table == name and name in wanted]
        if name not in wanted:
            con.register(name, table_schema(name).empty_table())
            continue
        if progress is not None:
            progress(f"listing {loc.url.rstrip('/')}/{name}/")
        listed = _listing(loc, name)
        _check_overlays(loc, name, mine, listed)
        here = [(loc.path(f"{name}/date={o.part[:10]}"), o.source) for o in mine]
        tokens = {path: o.token for path, o in listed.items()}
        p = plan(listed, here, tokens, lambda fleet: held_by(loc, fleet))
        files = {f: listed[f] for f in p.writers(listed)}
        fleets = {f: listed[f] for f in p.fleets}
        if read is not None:
            # Not the objects an overlay stands in for: they are never read (and the node's
            # own hours are rewritten at every flush).
            replaced = set(replaced_paths(loc, name, mine))
            read.update((f, n) for f, n in files.items() if f not in replaced)
            read.update(fleets)
        fleet = fleet_sql(con, loc, name, fleets, p, native)
        if native and files:
            native_view(con, loc, name, mine, files, fleet)
        elif files:
            con.register(f"writers_{name}", table_dataset(loc, name, files, mine))
            con.execute(
                f"CREATE VIEW {name} AS "
                + _with_more(con, name, f"SELECT * FROM writers_{name}", fleet, [])
            )
        else:
            # No writer's objects: the fleet's rows and the overlays', or none.
            empty = f"empty_{name}"
            con.register(empty, table_schema(name).empty_table())
            con.execute(
                f"CREATE VIEW {name} AS "
                + _with_more(con, name, f"SELECT * FROM {empty}", fleet, mine)
            )
    return con


def _check_overlays(
    loc: Location, table: str, overlays: Sequence[Overlay], listed: Mapping[str, Listed]
) -> None:
    """:class:`StaleOverlay` where an overlay of one hour has its writer's day object listed."""
    for o in overlays:
        if o.table == table and "/" in o.part:
            day = loc.path(object_key(o.table, o.part[:10], o.stem))
            if day in listed:
                raise StaleOverlay(f"{o.stem} sealed {table} of {o.part[:10]} meanwhile")


#: Times :func:`query` runs a query whose objects went while it read them before it gives up.
QUERY_TRIES = 3


def query(
    loc: Location,
    tables: Iterable[str],
    overlays: Sequence[Overlay],
    sql: str,
    params: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> pa.Table:
    """``sql`` over the warehouse's ``tables``, each row read once: the query reads exactly
    the objects one listing returned, as the reading rule (:func:`plan`) chose them, and
    never a writer's object its date's fleet object holds (the only kind a hand-over
    deletes). An object listed and deleted before it was read (a superseded fleet object or
    hourly object, after its grace period), or rewritten in place (a sealed day's late
    rows), fails the read; the tables are listed again and the query run again, at most
    :data:`QUERY_TRIES` times. A query that fails with every object as it was listed fails
    as it is (an error of its own)."""
    import duckdb

    wanted = tuple(tables)
    for attempt in range(QUERY_TRIES):
        read: dict[str, Listed] = {}
        con = None
        try:
            # In the try: DuckDB's reader opens local objects as their views are made.
            con = open_tables(loc, wanted, overlays, progress, read=read)
            if progress is not None:
                progress("querying")
            return run_sql(con, sql, params)
        except StaleOverlay:
            raise  # the caller asks the node again
        except (WarehouseError, duckdb.Error) as exc:
            # What the read of a changed object says depends on where it lands (S3's
            # NoSuchKey, "No such file", no Parquet magic or no thrift footer where the
            # listed size put it): the listing, not the message, tells.
            if attempt + 1 < QUERY_TRIES and _changed(loc, wanted, read):
                continue
            if isinstance(exc, WarehouseError):
                raise
            raise WarehouseError(f"reading {loc.url}: {_one_line(exc)}") from None
        finally:
            if con is not None:
                con.close()
    raise AssertionError("unreachable")  # the last try returns or raises


def _changed(loc: Location, tables: Iterable[str], read: Mapping[str, Listed]) -> bool:
    """Whether an object of ``read`` was deleted or replaced (another token) since it was
    listed. A listing that fails now says nothing changed: the query's error stands."""
    if not read:
        return False
    now: dict[str, Listed] = {}
    try:
        for name in tables:
            now.update(_listing(loc, name))
    except WarehouseError:
        return False
    return any(now.get(path) != was for path, was in read.items())


def run_sql(con: Any, sql: str, params: Mapping[str, Any] | None = None) -> pa.Table:
    """One SELECT (or WITH ... SELECT) statement's result on a :func:`locked` connection.
    Anything else, or a statement DuckDB rejects, is a :class:`WarehouseError` naming the
    error and where it is."""
    import duckdb

    check_select(con, sql)
    try:
        rel = con.sql(sql, params=dict(params)) if params else con.sql(sql)
        result: pa.Table = rel.to_arrow_table()
    except duckdb.Error as exc:
        raise WarehouseError(describe(exc, sql)) from None
    return result


def check_select(con: Any, sql: str) -> None:
    """:class:`WarehouseError` unless ``sql`` is exactly one SELECT (WITH included), as
    DuckDB's own parser reads it."""
    import duckdb

    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise WarehouseError(describe(exc, sql)) from None
    if len(statements) != 1:
        raise WarehouseError(f"one statement at a time, got {len(statements)}")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        raise WarehouseError(f"only SELECT or WITH queries, got {kind.name}")


def tables_of(con: Any, sql: str) -> set[str]:
    """The warehouse tables a statement without parameters reads (CTE names left out), as
    the :func:`locked` connection ``con`` binds it."""
    import duckdb

    try:
        names: set[str] = con.get_table_names(sql, qualified=False)
    except duckdb.Error as exc:
        raise WarehouseError(describe(exc, sql)) from None
    return names & set(TABLES)


_CARET = re.compile(r"^LINE (\d+): (.*)$")


def describe(exc: Exception, sql: str) -> str:
    """DuckDB's error as one line, with the line and column it points at when it does."""
    text = str(exc)
    lines = text.splitlines()
    head = lines[0] if lines else type(exc).__name__
    for i, line in enumerate(lines[:-1]):
        m = _CARET.match(line)
        if not m or "^" not in lines[i + 1]:
            continue
        lineno, shown = int(m.group(1)), m.group(2)
        caret = lines[i + 1].index("^") - (len(line) - len(shown))
        source = sql.splitlines()[lineno - 1] if lineno <= len(sql.splitlines()) else shown
        offset = 0
        if shown.startswith("..."):
            # DuckDB shows a window of a long line: find where the window starts (the
            # line's tail when the window runs to its end).
            window = shown[3:]
            if window.endswith("..."):
                found = source.find(window[:-3])
                offset = found - 3 if found >= 0 else 0
            else:
                offset = len(source) - len(window) - 3
        return f"{head} (line {lineno}, column {max(1, caret + offset + 1)})"
    return head


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def overlays_from_reply(items: Iterable[Mapping[str, Any]]) -> list[Overlay]:
    """The ``overlays`` of a daemon's ``warehouse`` reply: each one's rows from its
    ``columns`` (a list per column, as :func:`profd.warehouse.build.build` makes them),
    made an Arrow table of its table's schema."""
    out: list[Overlay] = []
    for item in items:
        table, part, stem = str(item["table"]), str(item["part"]), str(item["stem"])
        if table not in SCHEMAS:
            raise WarehouseError(f"daemon sent rows of an unknown table {table!r}")
        try:
            object_key(table, part, stem)  # the partition is well formed
        except ValueError as exc:
            raise WarehouseError(f"daemon sent a bad partition: {exc}") from None
        cols = item["columns"]
        if not isinstance(cols, Mapping):
            raise WarehouseError(f"daemon sent unreadable {table} rows: not a map of columns")
        missing = set(SCHEMAS[table].names) - set(cols)
        if missing:
            raise WarehouseError(f"daemon's {table} rows lack {sorted(missing)}")
        try:
            rows = arrow_table(table, {k: list(v) for k, v in cols.items()})
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise WarehouseError(f"daemon sent unreadable {table} rows: {_one_line(exc)}") from None
        out.append(Overlay(table, part, stem, rows))
    return out
