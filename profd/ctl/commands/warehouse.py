"""profctl query, goodput, nodes, trend: SQL over the warehouse (every node's exported rows).

Without ``--warehouse`` the local daemon names the warehouse and sends the rows it has not
flushed yet (control request ``warehouse``), which are read in place of its objects for
those partitions: what this node indexed a moment ago is in the answer. With
``--warehouse URL`` (or ``PROFD_WAREHOUSE``) no daemon is needed: the objects are all there is.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from profd.ctl.commands.history import parse_when
from profd.ctl.errors import BadUsage, CtlCode, CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import Column, document, emit_json, say, table
from profd.warehouse import queries as Q

F = TypeVar("F", bound=Callable[..., Any])
#: The control request that returns the warehouse's URL and this node's unflushed rows.
WAREHOUSE_REQUEST = "warehouse"


def warehouse_options(f: F) -> F:
    f = click.option(
        "--warehouse",
        "url",
        envvar="PROFD_WAREHOUSE",
        metavar="URL",
        help="Read this warehouse (an absolute path or s3://bucket/prefix) without asking"
        " the daemon; PROFD_WAREHOUSE sets it too.",
    )(f)
    return click.option("--csv", "as_csv", is_flag=True, help="Print the rows as CSV.")(f)


def _progress(text: str) -> None:
    if sys.stderr.isatty():
        say(f"profctl: {text}", err=True)


def _s3_settings() -> Any:
    from profd.config import ConfigError, load
    from profd.warehouse.reader import S3Settings

    try:
        cfg = load().s3
    except ConfigError:
        return S3Settings()
    return S3Settings(endpoint_url=cfg.endpoint_url, region=cfg.region)


def _from_daemon(env: Env) -> tuple[str, list[Any]]:
    from profd.ctl.connection import Connection
    from profd.warehouse.reader import WarehouseError, overlays_from_reply

    conn = Connection(env.runtime_dir, timeout_ms=30_000)
    try:
        data = conn.request(WAREHOUSE_REQUEST)
    finally:
        conn.close()
    try:
        return str(data["url"]), overlays_from_reply(data.get("overlays") or [])
    except (KeyError, TypeError, ValueError) as exc:
        raise CtlError(
            f"bad warehouse reply from the daemon: {exc}", code=CtlCode.PROTOCOL
        ) from None
    except WarehouseError as exc:
        raise CtlError(str(exc), code=CtlCode.PROTOCOL) from None


def run_query(
    env: Env,
    url: str | None,
    sql: str,
    params: dict[str, Any] | None = None,
    tables: frozenset[str] | None = None,
) -> Any:
    """``sql`` over the warehouse (see the module docstring for which), as an Arrow table.
    Only ``tables`` (by default: those ``sql`` names) are listed; the others are empty."""
    if env.standalone:
        # profctl's own process: pandas would cost this command ~0.4 s for nothing, numpy
        # (at pyarrow's import) ~0.15 s (profd/warehouse/lean.py).
        from profd.warehouse.lean import refuse

        refuse(("pandas", "numpy"), "profctl's warehouse commands")
    from profd.warehouse import reader as R

    if env.cluster_spec:
        raise BadUsage("the warehouse holds every node's rows: query it without --cluster")
    try:
        # A connection of its own, locked: the statement is checked before anything is read.
        check = R.locked()
        R.check_select(check, sql)
        if tables is None:
            tables = frozenset(R.tables_of(check, sql))
        check.close()
    except R.WarehouseError as exc:
        raise CtlError(str(exc), code=CtlCode.SQL) from None
    overlays: list[Any] = []
    ask = not url
    if ask:
        url, overlays = _from_daemon(env)
    assert url is not None
    t0 = time.monotonic()
    try:
        loc = R.locate(url, _s3_settings() if url.startswith("s3://") else None)
        for attempt in range(R.QUERY_TRIES):
            try:
                result = R.query(loc, tables, overlays, sql, params, _progress)
                break
            except R.StaleOverlay:
                # The node sealed a day between its answer and the listing: its answer now
                # sends that day whole.
                if not ask or attempt == R.QUERY_TRIES - 1:
                    raise
                _, overlays = _from_daemon(env)
    except R.WarehouseError as exc:
        raise CtlError(str(exc), code=CtlCode.SQL) from None
    except OSError as exc:
        raise CtlError(f"reading {url}: {' '.join(str(exc).split())}", code=CtlCode.IO) from None
    _progress(f"{result.num_rows} rows in {time.monotonic() - t0:.1f}s")
    return result


def _cell(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    if isinstance(v, list | dict):
        return str(v)
    return "-" if v is None else v


def _json_value(v: Any) -> Any:
    if isinstance(v, datetime):
        return v.astimezone(UTC).isoformat()
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def _csv_value(v: Any) -> Any:
    if isinstance(v, list | dict):
        return json.dumps(_json_value(v), sort_keys=True)
    return _json_value(v)


def show(env: Env, result: Any, as_csv: bool) -> None:
    """The rows as a table, CSV or (``--json``) one JSON list of objects."""
    rows: list[dict[str, Any]] = result.to_pylist()
    names: list[str] = list(result.column_names)
    if env.json:
        emit_json([{k: _json_value(v) for k, v in r.items()} for r in rows])
        return
    if as_csv:
        # A file's contents for a pipe, like ``report -o -``: CSV quotes its own fields.
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(names)
        for r in rows:
            w.writerow([_csv_value(r[n]) for n in names])
        document(buf.getvalue())
        return
    columns: list[Column] = [(n.upper(), _getter(n)) for n in names]
    say(table(rows, columns))


def _getter(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: _cell(r[name])


def _since(text: str) -> dict[str, Any]:
    t = parse_when(text, "--since")
    when = datetime.fromtimestamp(t, UTC)
    return {"since": when, "since_date": when.strftime("%Y-%m-%d")}


@click.command()
@click.argument("sql")
@warehouse_options
@click.pass_obj
@command
def query(env: Env, sql: str, url: str | None, as_csv: bool) -> None:
    """Run one SELECT (or WITH) over the warehouse's tables: captures, rank_steps,
    operators, job_minutes, rank_minutes, incidents (docs/warehouse.md has their columns).
    Nothing else runs: no other statement, no file or network access."""
    show(env, run_query(env, url, sql), as_csv)


def _named(env: Env, sql: str, print_sql: bool) -> bool:
    if print_sql:
        if env.json:
            emit_json({"sql": sql})
        else:
            say(sql)
    return print_sql


@click.command()
@click.option("--since", default="30d", show_default=True, help="Incidents detected since.")
@click.option(
    "--by",
    type=click.Choice(Q.GOODPUT_BY),
    default="job",
    show_default=True,
    help="Group the lost rank-hours by this.",
)
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL and run nothing.")
@warehouse_options
@click.pass_obj
@command
def goodput(env: Env, since: str, by: str, print_sql: bool, url: str | None, as_csv: bool) -> None:
    """Rank-hours lost to incidents detected in the window (their lost_rank_s / 3600),
    per job, node (the one that recorded the incident), kind or incident; most lost first."""
    sql = Q.goodput_sql(by)
    if not _named(env, sql, print_sql):
        show(env, run_query(env, url, sql, _since(since), Q.GOODPUT_TABLES), as_csv)


@click.command()
@click.option("--since", default="30d", show_default=True, help="The window.")
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL and run nothing.")
@warehouse_options
@click.pass_obj
@command
def nodes(env: Env, since: str, print_sql: bool, url: str | None, as_csv: bool) -> None:
    """Nodes that incidents' suspects ran on: incidents, rank-hours the node hosted,
    incidents per 1,000 of them, and the jobs hit; repeat offenders first."""
    if not _named(env, Q.NODES_SQL, print_sql):
        show(env, run_query(env, url, Q.NODES_SQL, _since(since), Q.NODES_TABLES), as_csv)


@click.command()
@click.option("--job", "pattern", required=True, help="Jobs, as a glob: 'train-*'.")
@click.option("--op", required=True, help="The operator's name, exactly: aten::mm.")
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL and run nothing.")
@warehouse_options
@click.pass_obj
@command
def trend(env: Env, pattern: str, op: str, print_sql: bool, url: str | None, as_csv: bool) -> None:
    """One row per capture of the matching jobs, oldest first: the operator's self time per
    step averaged over the capture's ranks, and its fastest and slowest rank."""
    if _named(env, Q.TREND_SQL, print_sql):
        return
    if not pattern.strip() or not op.strip():
        raise BadUsage("--job and --op must not be empty")
    params = {"job": pattern, "op": op}
    show(env, run_query(env, url, Q.TREND_SQL, params, Q.TREND_TABLES), as_csv)
