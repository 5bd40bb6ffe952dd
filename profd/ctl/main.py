"""``profctl``: trigger captures, list attached processes and sessions, query and pull traces."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import wraps
from typing import Any, NoReturn, TypeVar

import click

from profd import __version__
from profd.ctl.connection import LocalDaemon
from profd.ctl.errors import CtlError
from profd.ctl.flags import user_text
from profd.ctl.nodes import Gathered, NodeLike, NodeSet
from profd.ctl.render import emit_json, say

F = TypeVar("F", bound=Callable[..., Any])


class Env:
    """What every command is given: the options of ``profctl`` itself, and the daemons."""

    # A plain class, not a dataclass: ``dataclasses`` (with ``inspect``) is ~8 ms of every
    # command's start-up, and ``profctl ps`` needs nothing else of it (nodes.py neither).
    def __init__(
        self,
        runtime_dir: str | None,
        json: bool,
        cluster_spec: str | None = None,
        key_file: str | None = None,
        server_key_file: str | None = None,
        node_timeout: float = 5.0,
    ) -> None:
        self.runtime_dir, self.json = runtime_dir, json
        #: ``--cluster``: the nodes to talk to over TCP instead of the local unix socket.
        self.cluster_spec = cluster_spec
        self.key_file, self.server_key_file = key_file, server_key_file
        self.node_timeout = node_timeout
        self._nodes: NodeSet | None = None
        #: Every request's outcome: the command wrapper names the nodes that did not answer.
        self.gathered: list[Gathered] = []
        #: Run as the ``profctl`` program (:func:`main`), a process of its own, rather than
        #: called in another program's process (a test's): a command may then refuse modules
        #: it never uses.
        self.standalone = STANDALONE

    @property
    def nodes(self) -> NodeSet:
        """The daemons this command talks to: the local one over its unix socket, or the
        ``--cluster`` nodes over TCP (the cluster code loads only then)."""
        if self._nodes is None:
            if self.cluster_spec:
                from profd.ctl.cluster import TcpNodes

                self._nodes = TcpNodes(
                    self.cluster_spec, self.key_file, self.server_key_file, self.node_timeout
                )
            else:
                self._nodes = LocalDaemon(self.runtime_dir)
        return self._nodes

    def gather(
        self,
        t: str,
        nodes: Sequence[NodeLike] | None = None,
        each: Callable[[NodeLike], Mapping[str, Any]] | None = None,
        **fields: Any,
    ) -> Gathered:
        """Ask every node (or ``nodes``) with ``fields`` (or ``each(node)``); at least one
        must answer (else CtlError)."""
        g = Gathered(self.nodes.ask(t, each or fields, nodes))
        self.gathered.append(g)
        g.require_some()
        return g

    def close(self) -> None:
        if self._nodes is not None:
            self._nodes.close()

    def rows(self, t: str, **fields: Any) -> list[dict[str, Any]]:
        """A listing request's rows from every node, each naming its node."""
        return self.gather(t, **fields).rows()

    def per_node(self, rows: list[dict[str, Any]]) -> Any:
        """A document every node answers with, as ``--json`` prints it: the local daemon's
        own document, or (``--cluster``) one row per node."""
        return rows if self.nodes.remote else rows[0]


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
            try:
                result = f(*args, **kwargs)
            finally:
                if env is not None:
                    env.close()
        except CtlError as exc:
            message = user_text(str(exc))
            if env is not None and env.json:
                emit_json({"error": message, "code": exc.code})
            say(f"profctl: {message}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            sys.exit(130)
        if env is not None and env.gathered:
            _missing_nodes(env)
        return result

    return json_option(wrapper)  # type: ignore[return-value]


def _missing_nodes(env: Env) -> None:
    """After a cluster command's output: the nodes that did not answer, once each, and the
    exit code that tells scripts the output is partial."""
    seen: dict[str, str] = {}
    code = 0
    for g in env.gathered:
        code = max(code, g.exit_code)
        for a in g.missing:
            seen.setdefault(a.node.address, a.why)
    for why in seen.values():
        say(f"profctl: {why}", err=True)
    if code:
        n = len(env.nodes.nodes)
        say(f"profctl: {len(seen)} of {n} node(s) did not answer", err=True)
        sys.exit(code)


class LazyGroup(click.Group):
    """Imports a command's module only when it is invoked (or listed by --help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from profd.ctl.commands import COMMANDS

        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        import importlib

        from profd.ctl.commands import COMMANDS

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
@click.option(
    "--cluster",
    "cluster_spec",
    envvar="PROFD_CLUSTER",
    metavar="NODES",
    help="Talk to these nodes' daemons over TCP: host[:port],..., @FILE or slurm[:JOBID].",
)
@click.option(
    "--key", "key_file", envvar="PROFD_CLIENT_KEY", help="profctl's secret key (.key_secret)."
)
@click.option(
    "--server-key",
    "server_key_file",
    envvar="PROFD_SERVER_KEY",
    help="The daemons' public key (.key).",
)
@click.option(
    "--node-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="With --cluster: seconds to wait for each node.",
)
@click.pass_context
def cli(
    ctx: click.Context,
    runtime_dir: str | None,
    config_file: str | None,
    as_json: bool,
    cluster_spec: str | None,
    key_file: str | None,
    server_key_file: str | None,
    node_timeout: float,
) -> None:
    """profctl: control the node's profd daemon, or with --cluster every node's.

    The daemon is found the way `profd run` places it: --runtime-dir, else PROFD_RUNTIME_DIR,
    else [daemon] runtime_dir in the config file, else the defaults. With --cluster
    (PROFD_CLUSTER) profctl talks to each node's daemon over TCP with CURVE; keys come from
    --key/--server-key, else PROFD_CLIENT_KEY/PROFD_SERVER_KEY, else [cluster] key and
    server_key in the config file.

    Exit codes: 0 ok; 1 refused or failed; 2 bad usage; 3 no daemon; 4 some nodes did not
    answer; 5 a node refused the key; 6 start --wait --timeout gave up (the session goes on).
    A SESSION may be given as any unique part of its id.
    """
    need_keys = bool(cluster_spec) and not (key_file and server_key_file)
    if runtime_dir is None or need_keys:
        # Only the file's reader for a runtime dir: the settings' schema (profd.config) is a
        # fifth of `profctl ps`'s start-up, and only the cluster keys need it.
        from profd.config_file import ConfigError, configured_runtime_dir

        try:
            if runtime_dir is None:
                runtime_dir = configured_runtime_dir(config_file)
            if need_keys:
                from profd.config import configured_cluster

                keys = configured_cluster(config_file)
                key_file = key_file or (str(keys.key) if keys.key else None)
                server_key_file = server_key_file or (
                    str(keys.server_key) if keys.server_key else None
                )
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
    ctx.obj = Env(
        runtime_dir=runtime_dir,
        json=as_json,
        cluster_spec=cluster_spec or None,
        key_file=key_file,
        server_key_file=server_key_file,
        node_timeout=node_timeout,
    )


#: Set by :func:`main`, the ``profctl`` program's entry point.
STANDALONE = False


def main() -> None:
    """``profctl``: the command line, then the exit, without the interpreter's teardown."""
    global STANDALONE
    STANDALONE = True
    try:
        cli()  # click's standalone mode: always ends in SystemExit
    except SystemExit as exc:
        _exit(exc.code)
    _exit(0)


def _exit(code: object) -> NoReturn:
    # The command's work is done and written. The interpreter's teardown would free every
    # module and every row of the reply, one by one (~10 ms of `profctl ps` at 1,024
    # processes), and wait for threads still asking a node that timed out. What else it would
    # do is done here: flush what was written. Commands close their sockets and the files
    # they write before they return, and an error escaping a command (a traceback) does not
    # come here.
    if code is None or isinstance(code, int):
        status = code or 0
    else:
        say(str(code), err=True)  # sys.exit("why"), as the interpreter would
        status = 1
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with the descriptor closed
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # a reader that left (`| head`): nothing more to say
            pass
        except (OSError, ValueError):
            # Output that could not be written (a full disk): not a success, as the
            # interpreter's own exit says with 120.
            if stream is sys.stdout and status == 0:
                status = 120
    os._exit(status)


if __name__ == "__main__":
    main()
