"""The warehouse's read side: overlays in place of objects, empty tables, the locked-down
DuckDB connection, the daemon's overlay encoding, and docs/warehouse.md against the code."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profd.warehouse import queries as Q
from profd.warehouse import reader as R
from profd.warehouse.arrow import SCHEMAS, Overlay
from profd.warehouse.tables import SOURCE, TABLES, fleet_key, object_key, stem_of, writer_stem

DOC = Path(__file__).resolve().parents[2] / "docs" / "warehouse.md"
A, B = writer_stem("gpu01", "aaaa"), writer_stem("gpu02", "bbbb")
C, D = writer_stem("gpu03", "cccc"), writer_stem("gpu04", "dddd")
NODE = {A: "A", B: "B", C: "C", D: "D"}


def incidents(*ids: str, lost: float = 10.0) -> pa.Table:
    n = len(ids)
    t = datetime(2026, 3, 1, 12, tzinfo=UTC)
    return pa.table(
        {
            "id": list(ids),
            "kind": ["hang"] * n,
            "job": ["j"] * n,
            "role": ["trainer"] * n,
            "node": ["gpu01"] * n,
            "state": ["open"] * n,
            "detected": [t] * n,
            "resolved": [None] * n,
            "step": [1] * n,
            "suspects": [[{"node": "gpu01", "role": "trainer", "rank": 0}]] * n,
            "session": [None] * n,
            "reason": ["r"] * n,
            "lost_rank_s": [lost] * n,
        },
        schema=SCHEMAS["incidents"],
    )


def put(root: Path, table: str, part: str, stem: str, rows: pa.Table) -> None:
    path = root / object_key(table, part, stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows, path)


@pytest.fixture(params=["duckdb", "pyarrow"])
def reading(request: pytest.FixtureRequest) -> str:
    """Each test reads both ways: DuckDB's Parquet reader (local disk) and pyarrow datasets
    (what S3 uses), which must give the same rows."""
    return str(request.param)


def ask(
    root: Path, sql: str, overlays: list[Overlay] | None = None, how: str = "duckdb"
) -> list[dict[str, Any]]:
    loc = R.locate(str(root))
    if how == "duckdb":
        con = R.open_tables(loc, TABLES, overlays or [])
    else:
        con = R.open_tables(loc, TABLES, overlays or [], native=False)
    out: list[dict[str, Any]] = R.run_sql(con, sql).to_pylist()
    return out


def test_an_overlay_replaces_its_writers_object_and_only_that(tmp_path: Path, reading: str) -> None:
    put(tmp_path, "incidents", "2026-03-01", A, incidents("a1", "a2"))
    put(tmp_path, "incidents", "2026-03-01", B, incidents("b1"))
    put(tmp_path, "incidents", "2026-03-02", A, incidents("a3"))
    # A's unflushed state of 03-01: a2 grew, a4 is new, a1 is as it was.
    over = pa.concat_tables([incidents("a1"), incidents("a2", "a4", lost=99.0)])
    overlays = [Overlay("incidents", "2026-03-01", A, over)]
    got = ask(
        tmp_path, "SELECT id, lost_rank_s, date FROM incidents ORDER BY id", overlays, reading
    )
    assert [(r["id"], r["lost_rank_s"], r["date"]) for r in got] == [
        ("a1", 10.0, "2026-03-01"),
        ("a2", 99.0, "2026-03-01"),
        ("a3", 10.0, "2026-03-02"),
        ("a4", 99.0, "2026-03-01"),
        ("b1", 10.0, "2026-03-01"),
    ]
    assert [
        r["id"] for r in ask(tmp_path, "SELECT id FROM incidents ORDER BY id", None, reading)
    ] == [
        "a1",
        "a2",
        "a3",
        "b1",
    ]


def test_an_overlay_with_no_object_yet_and_an_empty_one(tmp_path: Path, reading: str) -> None:
    put(tmp_path, "incidents", "2026-03-01", A, incidents("a1"))
    overlays = [
        Overlay("incidents", "2026-03-05", A, incidents("new")),
        # Every row of A's 03-01 object is gone from its index (kept days): none are seen.
        Overlay("incidents", "2026-03-01", A, incidents()),
    ]
    got = ask(tmp_path, "SELECT id, date FROM incidents", overlays, reading)
    assert got == [{"id": "new", "date": "2026-03-05"}]


def test_hourly_overlay_names_the_hours_object(tmp_path: Path, reading: str) -> None:
    minute = datetime(2026, 3, 1, 7, 5, tzinfo=UTC)
    rows = pa.Table.from_pylist(
        [{"job": "j", "role": "r", "minute": minute, "node": "gpu01", "ranks": 8}],
        schema=SCHEMAS["job_minutes"],
    )
    put(tmp_path, "job_minutes", "2026-03-01/07", A, rows)
    put(tmp_path, "job_minutes", "2026-03-01/08", A, rows)
    i = rows.schema.get_field_index("ranks")
    doubled = pa.concat_tables([rows, rows.set_column(i, "ranks", pa.array([4], pa.int32()))])
    overlays = [Overlay("job_minutes", "2026-03-01/07", A, doubled)]
    got = ask(tmp_path, "SELECT sum(ranks) AS s, count(*) AS n FROM job_minutes", overlays, reading)
    assert got == [{"s": 20, "n": 3}]


def test_an_empty_warehouse_has_every_table_with_its_columns(tmp_path: Path, reading: str) -> None:
    for t in TABLES:
        cols = ask(tmp_path, f"SELECT column_name FROM (DESCRIBE SELECT * FROM {t})", None, reading)
        assert [c["column_name"] for c in cols] == [*SCHEMAS[t].names, "date"]
        assert ask(tmp_path, f"SELECT count(*) AS n FROM {t}", None, reading) == [{"n": 0}]


def test_the_named_queries_run_on_an_empty_warehouse(tmp_path: Path) -> None:
    con = R.open_tables(R.locate(str(tmp_path)), TABLES, native=False)
    since = {"since": datetime(2026, 1, 1, tzinfo=UTC), "since_date": "2026-01-01"}
    for b in Q.GOODPUT_BY:
        assert R.run_sql(con, Q.goodput_sql(b), since).num_rows == 0
    assert R.run_sql(con, Q.NODES_SQL, since).num_rows == 0
    assert R.run_sql(con, Q.TREND_SQL, {"job": "*", "op": "x"}).num_rows == 0


@pytest.mark.parametrize(
    ("sql", "says"),
    [
        ("SELECT * FROM read_csv('/etc/passwd')", "Permission Error"),
        ("SELECT * FROM 'x.parquet'", "Permission Error"),
        ("SELECT * FROM secret_rows", "does not exist"),  # a Python variable: not a table
        ("INSTALL httpfs", "got LOAD"),
        ("PRAGMA version", "got PRAGMA"),
        ("RESET lock_configuration", "got"),
        ("CREATE TABLE t AS SELECT 1", "got CREATE"),
        ("", "one statement at a time, got 0"),
    ],
)
def test_only_a_select_and_nothing_outside(
    tmp_path: Path, sql: str, says: str, reading: str
) -> None:
    secret_rows = pa.table({"a": [1]})  # noqa: F841 - what a replacement scan would find
    with pytest.raises(R.WarehouseError, match=re.escape(says)):
        ask(tmp_path, sql, None, reading)


def test_configuration_stays_locked() -> None:
    import duckdb

    con = R.locked()
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")


def test_errors_are_one_line_with_their_position() -> None:
    con = R.locked()
    with pytest.raises(R.WarehouseError) as e:
        R.run_sql(con, "SELECT 1\nFROM x WHER a")
    assert str(e.value) == 'Parser Error: syntax error at or near "a" (line 2, column 13)'
    # DuckDB shows a window of a long line; the column is still the line's.
    for tail in ("", ", 2" * 60):
        long = "SELECT " + ", ".join(["1"] * 60) + " FRM x y" + tail
        with pytest.raises(R.WarehouseError) as e:
            R.run_sql(con, long)
        assert str(e.value).endswith(f"(line 1, column {long.index(' x') + 2})")


def columns(rows: pa.Table) -> dict[str, list[Any]]:
    """``rows`` as the daemon sends them: a list per column, a map as a dict."""
    cols: dict[str, list[Any]] = rows.to_pydict()
    return cols


def test_overlays_from_the_daemons_reply() -> None:
    rows = incidents("x1", "x2")
    got = R.overlays_from_reply(
        [{"table": "incidents", "part": "2026-03-01", "stem": A, "columns": columns(rows)}]
    )
    assert got == [Overlay("incidents", "2026-03-01", A, rows)]
    bad = [
        (
            {"table": "nope", "part": "2026-03-01", "stem": A, "columns": columns(rows)},
            "unknown table",
        ),
        ({"table": "incidents", "part": "2026-03-01", "stem": A, "columns": b"junk"}, "unreadable"),
        (
            {
                "table": "incidents",
                "part": "2026-03-01",
                "stem": A,
                "columns": {**columns(rows), "step": ["x", "y"]},
            },
            "unreadable",
        ),
        (
            {
                "table": "incidents",
                "part": "2026-03-01",
                "stem": A,
                "columns": columns(rows.drop(["id"])),
            },
            "lack ['id']",
        ),
        (
            {"table": "incidents", "part": "2026-03-01/02", "stem": A, "columns": columns(rows)},
            "part",
        ),
    ]
    for item, says in bad:
        with pytest.raises(R.WarehouseError, match=re.escape(says)):
            R.overlays_from_reply([item])


def test_locate_refuses_relative_paths_and_other_schemes() -> None:
    for url in ("warehouse", "gs://b/p", "s3://"):
        with pytest.raises(R.WarehouseError):
            R.locate(url)


# --- docs/warehouse.md against the code -------------------------------------------------------


def doc_columns() -> dict[str, list[str]]:
    """Each "### table" section's column table in docs/warehouse.md: its first column."""
    out: dict[str, list[str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        m = re.match(r"^### `(\w+)`", line)
        if m:
            current = m.group(1)
            out[current] = []
            continue
        if line.startswith("#"):
            current = None
        m = re.match(r"^\| `(\w+)` \|", line)
        if current and m:
            out[current].append(m.group(1))
    return out


def test_docs_list_every_tables_columns() -> None:
    assert doc_columns() == {t: [*SCHEMAS[t].names, "date"] for t in TABLES}


def test_docs_hold_the_queries_the_commands_run() -> None:
    text = DOC.read_text()
    for name, sql in Q.all_sql().items():
        assert f"```sql\n{sql}\n```" in text, name


def test_docs_hold_the_ddl_built_from_the_schemas() -> None:
    from profd.warehouse import ddl

    text = DOC.read_text()
    for engine, make in ddl.ENGINES.items():
        for t in TABLES:
            assert f"```sql\n{make(t)}\n```" in text, (engine, t)


def test_the_local_reader_is_allowed_the_warehouse_and_nothing_else(tmp_path: Path) -> None:
    wh = tmp_path / "wh"
    put(wh, "incidents", "2026-03-01", A, incidents("a1"))
    # A Parquet file beside the warehouse, and one reached by climbing out of it.
    put(tmp_path / "other", "incidents", "2026-03-01", A, incidents("secret"))
    other = tmp_path / "other" / object_key("incidents", "2026-03-01", A)
    climb = f"{wh}/incidents/../../other/{object_key('incidents', '2026-03-01', A)}"
    for path in (str(other), climb):
        with pytest.raises(R.WarehouseError, match="Permission Error"):
            ask(wh, f"SELECT * FROM read_parquet('{path}')")
    assert ask(wh, "SELECT id FROM incidents") == [{"id": "a1"}]


def fleet_layout(wh: Path) -> dict[tuple[str, str], int]:
    """``job_minutes`` with one writer's sealed day (its hourly objects still there), another
    writer's unsealed day, the first writer's next day, still open, and three dates with
    fleet objects. 2026-03-03: the chosen fleet object (serial 2) holds A's day, B's day and
    C's hours 06 and 07, an older one (serial 1) rows of all of them and of D; A still has its
    day object (and a superseded hour), C its hour 07 (written again: a late row) and 08, B
    nothing. 2026-03-04: only a fleet object (serial 1, chosen there). 2026-03-05 (open): the
    fleet object holds A's hours 01 and 02 and B's 01; A sealed the day since, B still has its
    hour 01 (inside the grace period). Each row's ``node`` names its writer; the rows each
    date should read, by node."""
    put(wh, "job_minutes", "2026-03-01/05", A, jm_rows(2, "A"))
    put(wh, "job_minutes", "2026-03-01/06", A, jm_rows(3, "A"))
    put(wh, "job_minutes", "2026-03-01", A, jm_rows(5, "A"))  # A sealed the day: 5 rows, once
    put(wh, "job_minutes", "2026-03-01/05", B, jm_rows(4, "B"))  # B did not
    put(wh, "job_minutes", "2026-03-02/00", A, jm_rows(1, "A"))
    jm_fleet(wh, "2026-03-03", 1, {A: 10, B: 10, C: 10, D: 10})  # not chosen: ignored
    jm_fleet(wh, "2026-03-03", 2, {A: 3, B: 4, f"{C}~06": 2, f"{C}~07": 6})
    put(wh, "job_minutes", "2026-03-03", A, jm_rows(5, "A"))  # read in place of A's fleet rows
    put(wh, "job_minutes", "2026-03-03/07", A, jm_rows(7, "A"))  # superseded by A's day
    put(wh, "job_minutes", "2026-03-03/07", C, jm_rows(2, "C"))  # read in place of C~07's rows
    put(wh, "job_minutes", "2026-03-03/08", C, jm_rows(1, "C"))  # not in the fleet yet
    jm_fleet(wh, "2026-03-04", 1, {A: 2, B: 3})
    jm_fleet(wh, "2026-03-05", 1, {f"{A}~01": 1, f"{A}~02": 2, f"{B}~01": 4})
    put(wh, "job_minutes", "2026-03-05", A, jm_rows(6, "A"))  # A's whole day so far
    put(wh, "job_minutes", "2026-03-05/01", B, jm_rows(4, "B"))
    put(wh, "job_minutes", "2026-03-05/03", B, jm_rows(1, "B"))
    return {
        ("2026-03-01", "A"): 5,
        ("2026-03-01", "B"): 4,
        ("2026-03-02", "A"): 1,
        ("2026-03-03", "A"): 5,
        ("2026-03-03", "B"): 4,
        ("2026-03-03", "C"): 5,
        ("2026-03-04", "A"): 2,
        ("2026-03-04", "B"): 3,
        ("2026-03-05", "A"): 6,
        ("2026-03-05", "B"): 5,
    }


def fleet(wh: Path, table: str, date: str, serial: int, rows: dict[str, pa.Table]) -> None:
    """A fleet object: the ``rows`` of each source (a writer's object), named in
    ``_source``."""
    stems = [stem for stem, part in rows.items() for _ in range(part.num_rows)]
    whole = pa.concat_tables(rows.values()).append_column(SOURCE, pa.array(stems, pa.string()))
    path = wh / fleet_key(table, date, serial)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(whole, path)


def incidents_fleet(wh: Path) -> None:
    """``incidents`` (one object a day): A's own object is read in place of its rows in the
    fleet object, B's rows there are read: ids a1, a2, b1."""
    put(wh, "incidents", "2026-03-03", A, incidents("a1", "a2"))
    fleet(wh, "incidents", "2026-03-03", 1, {A: incidents("a1"), B: incidents("b1")})


def jm_fleet(wh: Path, date: str, serial: int, rows: dict[str, int]) -> None:
    made = {s: jm_rows(n, NODE[stem_of(s) or s]) for s, n in rows.items()}
    fleet(wh, "job_minutes", date, serial, made)


@pytest.mark.parametrize("engine", ["trino", "spark"])
def test_the_engines_views_read_each_row_once(tmp_path: Path, engine: str) -> None:
    """The views' rule, run on DuckDB: Trino's and Spark's view text with the engine's path
    column and regex test spelt as DuckDB spells them, over :func:`fleet_layout` (whose
    objects, with and without ``_source``, DuckDB reads by name as the engines' declared
    ``_objects`` tables do)."""
    from profd.warehouse import ddl

    wh = tmp_path / "wh"
    want = fleet_layout(wh)
    incidents_fleet(wh)
    con = R.locked([str(wh)])
    path, test = {"trino": ('"$path"', "regexp_like("), "spark": ("input_file_name()", None)}[
        engine
    ]
    for table in ("job_minutes", "incidents"):
        con.execute(
            f"CREATE VIEW {table}_objects AS SELECT * FROM read_parquet("
            f"'{wh}/{table}/*/*.parquet', hive_partitioning = true, "
            "hive_types = {'date': VARCHAR}, filename = true, union_by_name = true)"
        )
        text = ddl.ENGINES[engine](table)
        view = text[text.index("CREATE VIEW") :].replace(path, "filename")
        view = view.replace("hive.profd.", "").replace("`", '"')
        if test:
            view = view.replace(test, "regexp_matches(")
        else:
            view = re.sub(r"filename RLIKE ('[^']*')", r"regexp_matches(filename, \1)", view)
        con.execute(view)
        cols = con.sql(f"SELECT * FROM {table} LIMIT 0").columns
        assert cols == [*SCHEMAS[table].names, "date"]
    got = con.sql("SELECT date, node, count(*) FROM job_minutes GROUP BY ALL ORDER BY ALL")
    assert {(d, n): c for d, n, c in got.fetchall()} == want
    got = con.sql("SELECT id FROM incidents ORDER BY id")
    assert got.fetchall() == [("a1",), ("a2",), ("b1",)]


@pytest.mark.parametrize("native", [True, False], ids=["duckdb", "pyarrow"])
def test_profds_reader_reads_each_row_once(tmp_path: Path, native: bool) -> None:
    """profctl's own reading (DuckDB's reader on local disk, pyarrow's as from S3) over
    :func:`fleet_layout`, and with a node's unflushed rows of an hour in place of that
    hour's object: they stand for that hour's rows, not for the writer's other hours."""
    wh = tmp_path / "wh"
    want = fleet_layout(wh)
    sql = "SELECT date, node, count(*) AS n FROM job_minutes GROUP BY ALL ORDER BY ALL"
    loc = R.locate(str(wh))

    def read(overlays: list[Overlay]) -> dict[tuple[str, str], int]:
        con = R.open_tables(loc, TABLES, overlays, native=native)
        return {(r["date"], r["node"]): r["n"] for r in R.run_sql(con, sql).to_pylist()}

    assert read([]) == want
    # C's hour 08 unflushed: its merged hour 06 still counts from the fleet object.
    over = [Overlay("job_minutes", "2026-03-03/08", C, jm_rows(9, "C"))]
    assert read(over) == {**want, ("2026-03-03", "C"): 13}


def test_polars_reads_each_row_once(tmp_path: Path) -> None:
    """tests/warehouse_polars.py's scan (the second engine of tests/test_warehouse_query.py)
    over :func:`fleet_layout`."""
    import warehouse_polars as WP

    wh = tmp_path / "wh"
    want = fleet_layout(wh)
    df = WP.scan(str(wh), "job_minutes").collect()
    assert df.columns == [*SCHEMAS["job_minutes"].names, "date"]
    got = df.group_by("date", "node").len().rows()
    assert {(str(d), n): c for d, n, c in got} == want
    incidents_fleet(wh)
    ids = WP.scan(str(wh), "incidents").collect()["id"].sort().to_list()
    assert ids == ["a1", "a2", "b1"]


def jm_rows(n: int, node: str = "n") -> pa.Table:
    t = datetime(2026, 3, 1, 5, tzinfo=UTC)
    cols: dict[str, list[Any]] = {f.name: [None] * n for f in SCHEMAS["job_minutes"]}
    cols.update(job=["j"] * n, role=["r"] * n, minute=[t] * n, node=[node] * n)
    return pa.table(cols, schema=SCHEMAS["job_minutes"])


def test_a_query_that_fails_with_its_objects_unchanged_runs_once(tmp_path: Path) -> None:
    """A query runs again only when an object it read changed since its listing (deleted,
    or rewritten: tests/unit/test_warehouse_fleet.py), told by listing again, never by what
    the error says: here the query's own error quotes what a missing object's read says."""
    put(tmp_path, "incidents", "2026-03-01", A, incidents("a1"))
    said: list[str] = []
    sql = "SELECT CAST('No such file or directory: Parquet magic bytes not found' AS INTEGER)"
    with pytest.raises(R.WarehouseError, match="Could not convert string"):
        R.query(R.locate(str(tmp_path)), ["incidents"], [], sql + " FROM incidents", None,
                said.append)  # fmt: skip
    assert said.count("querying") == 1, said


def test_a_query_whose_object_went_while_it_ran_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An object deleted between the listing and the read fails the read (whatever the
    engine says of it): the tables are listed again, and the query runs on what is there."""
    put(tmp_path, "incidents", "2026-03-01", A, incidents("a1"))
    put(tmp_path, "incidents", "2026-03-01", B, incidents("b1"))
    said: list[str] = []
    real = R.run_sql
    gone = tmp_path / object_key("incidents", "2026-03-01", B)

    def delete_then_run(con: Any, sql: str, params: Any = None) -> pa.Table:
        if gone.exists():  # after the first listing, before its read: as a hand-over would
            gone.unlink()
        return real(con, sql, params)

    monkeypatch.setattr(R, "run_sql", delete_then_run)
    got = R.query(R.locate(str(tmp_path)), ["incidents"], [], "SELECT id FROM incidents",
                  None, said.append)  # fmt: skip
    assert got.to_pylist() == [{"id": "a1"}]
    assert said.count("querying") == 2, said


def test_an_object_gone_before_its_view_is_made_is_listed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On local disk DuckDB opens the objects as their view is made, before the query: an
    object deleted between the listing and then fails there, and is listed again too."""
    put(tmp_path, "incidents", "2026-03-01", A, incidents("a1"))
    put(tmp_path, "incidents", "2026-03-01", B, incidents("b1"))
    gone = tmp_path / object_key("incidents", "2026-03-01", B)
    real = R.native_view
    views: list[str] = []

    def delete_then_view(con: Any, loc: Any, table: str, *rest: Any) -> None:
        views.append(table)
        if gone.exists():
            gone.unlink()
        real(con, loc, table, *rest)

    monkeypatch.setattr(R, "native_view", delete_then_view)
    got = R.query(R.locate(str(tmp_path)), ["incidents"], [], "SELECT id FROM incidents")
    assert got.to_pylist() == [{"id": "a1"}]
    assert views == ["incidents", "incidents"]
