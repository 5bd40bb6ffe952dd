"""Human output for profctl: tables, sizes, times. ``--json`` bypasses all of this.

Everything profctl prints for people goes through :func:`say` (and :func:`control` for its
own terminal sequences), and every table cell through :func:`table`: names in replies come
from peers (a host, a region, a function) and may hold any character, so both escape what a
terminal would act on (:func:`profd.textfmt.printable`). A cell is one line whatever it
holds; :func:`line_block` does the same for text made of lines. ``--json`` stays exact (JSON
escapes control characters itself).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import click

from profd.textfmt import human_bytes, printable

Column = tuple[str, Callable[[dict[str, Any]], Any]]


def size(n: int | None) -> str:
    return "-" if n is None else human_bytes(n)


def ago(ts: float | None) -> str:
    if not ts:
        return "-"
    d = max(0.0, time.time() - ts)
    if d < 90:
        return f"{d:.0f}s ago"
    if d < 5400:
        return f"{d / 60:.0f}m ago"
    if d < 129600:
        return f"{d / 3600:.1f}h ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))


def step_cell(r: dict[str, Any]) -> str:
    """A row's step, ``~12345`` when the daemon moved it on at the rank's rate."""
    step = r.get("step")
    if step is None:
        return "-"
    return f"~{step}" if r.get("step_extrapolated") else str(step)


def age_cell(r: dict[str, Any]) -> str:
    """Seconds since the heartbeat that carried the row's step: ``0.4s``, ``12s``, ``3m``."""
    a = r.get("age_s")
    if a is None:
        return "-"
    if a < 10:
        return f"{a:.1f}s"
    if a < 90:
        return f"{a:.0f}s"
    if a < 5400:
        return f"{a / 60:.0f}m"
    return f"{a / 3600:.0f}h"


def opt(v: Any, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def say(text: str = "", err: bool = False, nl: bool = True, eol: str = "") -> None:
    """Write ``text`` for people (stdout, or stderr with ``err``): every character a
    terminal would act on is escaped but the newlines (see the module docstring). ``eol``:
    profctl's own sequence written before each newline (clearing the rest of a line)."""
    out = printable(text, newlines=True)
    if eol:
        out = out.replace("\n", eol + "\n")
    click.echo(out, err=err, nl=nl)


def control(seq: str) -> None:
    """Write one of profctl's own terminal sequences (a constant: never text from a reply)."""
    sys.stdout.write(seq)
    sys.stdout.flush()


def document(text: str) -> None:
    """Write a document as it is (an HTML page to stdout, ``report -o -``): a file's bytes
    for a pipe, escaped by its own format, not text for a terminal."""
    sys.stdout.write(text)
    sys.stdout.flush()


def line_block(items: Iterable[str]) -> str:
    """Lines made of values from replies, one line each whatever a value holds (a newline in
    one is escaped), joined: what :func:`say` prints of them is one line per item."""
    return "\n".join(printable(x) for x in items)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """Rows as aligned columns; each cell on one line, escaped (see the module docstring)."""
    cells = [[str(h) for h, _ in columns]]
    cells += [[printable(str(f(r))) for _, f in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def emit_json(doc: Any) -> None:
    sys.stdout.write(json_text(doc) + "\n")
    sys.stdout.flush()


def json_text(doc: Any) -> str:
    """``--json`` output: a list of rows one row per line, anything else indented."""
    if isinstance(doc, list) and doc and all(isinstance(r, dict) for r in doc):
        # json's indent= runs its pure-Python encoder: at 1,024 processes that was a fifth
        # of `profctl --json ps`. One line per row keeps the C encoder and stays greppable.
        # The whole list in one call, then a line break where one row's "}" meets the next
        # one's "{": a row that holds that text itself (in a string, a list of maps) makes
        # more pieces than there are rows, and is written row by row instead.
        parts = _ENCODE(doc)[1:-1].split(_ROWS_APART)
        if len(parts) == len(doc):
            return "[\n  " + "},\n  {".join(parts) + "\n]"
        return "[\n" + ",\n".join("  " + _ENCODE(r) for r in doc) + "\n]"
    return indented(doc)


_ENCODE: Final = json.JSONEncoder(sort_keys=True, default=str).encode
#: Between two rows of a list of maps, as json writes the list on one line.
_ROWS_APART: Final = "}, {"


def indented(doc: Any) -> str:
    """``json.dumps(doc, indent=2, sort_keys=True, default=str)``, the same text, with each
    container's scalars written by json's C encoder: ``indent`` runs json's pure-Python
    encoder, which was most of ``profctl --json top`` at 1,024 ranks."""
    if not (isinstance(doc, _CONTAINERS) and doc):
        return json.dumps(doc, sort_keys=True, default=str)  # no line breaks to make
    try:
        return _indented(doc, "\n")
    except (_Ambiguous, RecursionError):
        # A string that reads like a hole, or a reference cycle (json's own error then).
        return json.dumps(doc, indent=2, sort_keys=True, default=str)


_CONTAINERS = (list, tuple, dict)
#: What a nested non-empty container is written as while its parent is encoded; the
#: parent's text is then split where it stands. ``ensure_ascii`` writes the NUL escaped, so
#: only another string made of exactly one NUL could read the same, and the count of
#: pieces tells (:class:`_Ambiguous`).
_HOLE = "\x00"
_HOLE_TEXT = json.dumps(_HOLE)


class _Nested:
    __slots__ = ()


_NESTED = _Nested()


class _Ambiguous(Exception):
    pass


def _hole_or_str(o: object) -> str:
    return _HOLE if o is _NESTED else str(o)


@functools.cache
def _level_encoder(newline: str) -> Callable[[Any], str]:
    """The C encoder with the separators ``indent=2`` puts between the items of one level:
    ``newline`` is a line break and that level's indentation."""
    return json.JSONEncoder(
        sort_keys=True, default=_hole_or_str, separators=("," + newline, ": ")
    ).encode


def _indented(o: dict[Any, Any] | list[Any] | tuple[Any, ...], outer: str) -> str:
    """Non-empty ``o`` at the depth whose line break and indentation is ``outer``."""
    inner = outer + "  "
    nested: list[Any]
    flat: Any = o
    if isinstance(o, dict):
        holes = [k for k, v in o.items() if isinstance(v, _CONTAINERS) and v]
        # json writes a dict's items sorted: its nested containers come in that order too.
        holes.sort()
        nested = [o[k] for k in holes]
        if holes:
            flat = dict(o)
            for k in holes:
                flat[k] = _NESTED
    else:
        nested = [v for v in o if isinstance(v, _CONTAINERS) and v]
        if nested:
            flat = [_NESTED if isinstance(v, _CONTAINERS) and v else v for v in o]
    text: str = _level_encoder(inner)(flat)
    if nested:
        parts = text.split(_HOLE_TEXT)
        if len(parts) != len(nested) + 1:
            raise _Ambiguous
        out = [parts[0]]
        for value, after in zip(nested, parts[1:], strict=True):
            out.append(_indented(value, inner))
            out.append(after)
        text = "".join(out)
    # The encoder wrote ``{a,<inner>b}``; indent=2 breaks the line after the opening
    # bracket and before the closing one too.
    return text[0] + inner + text[1:-1] + outer + text[-1]


def steps_text(steps: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3-5,9``."""
    out: list[str] = []
    run: list[int] = []
    for n in steps:
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [n]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)
