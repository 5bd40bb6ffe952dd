"""``profctl``: trigger captures, list attached processes and sessions, query and pull traces."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import Any, TypeVar

import click

from .. import __version__
from .connection import Connection
from .errors import CtlError
from .render import emit_json

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Env:
    runtime_dir: str | None
    json: bool
    _conn: Connection | None = None

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            self._conn = Connection(self.runtime_dir)
        return self._conn


def json_option(f: F) -> F:
    """``--json`` after the command as well as before it."""

    def set_json(ctx: click.Context, _p: click.Parameter, value: bool) -> None:
        if value:
            ctx.find_object(Env).json = True  # type: ignore[union-attr]

    return click.option(
        "--json",
        "json_",
        is_flag=True,
        expose_value=False,
        callback=set_json,
        help="Print one JSON document on stdout.",
    )(f)


def command(f: F) -> F:
    """Run a command with the shared error handling: one line on stderr, exit code."""

    @wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        env = click.get_current_context().find_object(Env)
        try:
            return f(*args, **kwargs)
        except CtlError as exc:
            if env is not None and env.json:
                emit_json({"error": str(exc), "code": exc.code})
            click.echo(f"profctl: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            sys.exit(130)

    return json_option(wrapper)  # type: ignore[return-value]


class LazyGroup(click.Group):
    """Imports a command's module only when it is invoked (or listed by --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from .commands import COMMANDS

        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        import importlib

        from .commands import COMMANDS

        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        cmd: click.Command = getattr(
            importlib.import_module(f".commands.{module}", __package__), attr
        )
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="profctl")
@click.option("--runtime-dir", envvar="PROFD_RUNTIME_DIR", help="The daemon's socket dir.")
@click.option(
    "--config", "config_file", envvar="PROFD_CONFIG", help="profd.toml to read runtime_dir from."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.pass_context
def cli(
    ctx: click.Context, runtime_dir: str | None, config_file: str | None, as_json: bool
) -> None:
    """profctl: control the node's profd daemon.

    The daemon is found the way `profd run` places it: --runtime-dir, else PROFD_RUNTIME_DIR,
    else [daemon] runtime_dir in the config file, else the defaults.
    """
    if runtime_dir is None:
        from ..config import ConfigError, configured_runtime_dir

        try:
            runtime_dir = configured_runtime_dir(config_file)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    ctx.obj = Env(runtime_dir=runtime_dir, json=as_json)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
