"""profctl run: launch a job the way profd can profile it (under nsys with --nsys).

Nsight Systems cannot attach to a running process: a job that may need an nsys capture must
start under ``nsys launch``. ``profctl run --nsys -- CMD`` does that with a fresh nsys session
and tells the job's clients its name, so ``profctl start --backend nsys`` can later capture
exactly the requested steps. Without ``--nsys`` it only points the job at this daemon.

The job stays a child of this command: its output is this command's output, Ctrl-C reaches
it, and profctl exits with its exit code. With ``--json`` the job's stdout goes to stderr, so
stdout holds only the JSON document printed at the end.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from typing import Any

import click

from profd import nsys
from profd.ctl.errors import CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say
from profd_client import protocol as P

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@click.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--nsys",
    "use_nsys",
    is_flag=True,
    help="Run under `nsys launch` so `profctl start --backend nsys` can capture it.",
)
@click.option(
    "--nsys-trace", default=nsys.DEFAULT_TRACE, show_default=True, help="nsys --trace value."
)
@click.option(
    "--nsys-opt",
    "nsys_opts",
    multiple=True,
    metavar="OPT",
    help="Extra `nsys launch` option, e.g. --nsys-opt=--cuda-memory-usage=true; repeatable.",
)
@click.option("--nsys-bin", envvar="PROFD_NSYS", help="nsys binary [default: nsys on PATH].")
@click.option("--job", help="Job name for the launched processes (PROFD_JOB).")
@click.option("--role", help="Role for the launched processes (PROFD_ROLE).")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
@command
def run(env: Env, /, **kw: Any) -> None:
    """Run CMD (after --) as a job profd can capture; exits with CMD's exit code."""
    cmd: list[str] = list(kw["cmd"])
    child_env = dict(os.environ)
    if env.runtime_dir:
        child_env["PROFD_RUNTIME_DIR"] = env.runtime_dir  # the daemon this profctl talks to
    for name, key in (("job", "PROFD_JOB"), ("role", "PROFD_ROLE")):
        if kw[name]:
            try:
                child_env[key] = P.safe_name(kw[name], f"--{name}")
            except P.ProtocolError as exc:
                raise CtlError(str(exc)) from None
    session = None
    argv = cmd
    if kw["use_nsys"]:
        binary = nsys.find(kw["nsys_bin"])
        if binary is None:
            where = kw["nsys_bin"] or "nsys on PATH"
            raise CtlError(f"nsys not found ({where}): install Nsight Systems or set PROFD_NSYS")
        why = nsys.import_problem(binary)
        if why is not None:
            # Still launched: the job runs and capture ranges open, but every cycle will fail
            # with only a .qdstrm left; said now rather than at the first capture.
            say(f"profctl: warning: {why}; {nsys.INSTALL}", err=True)
        session = f"profd-{secrets.token_hex(4)}"
        child_env[P.NSYS_SESSION_ENV] = session
        argv = nsys.launch_argv(binary, session, cmd, kw["nsys_trace"], kw["nsys_opts"])
        say(
            f"profctl: nsys session {session}; capture with"
            " `profctl start --backend nsys --steps A:B ...`",
            err=True,
        )
    rc = _run(argv, child_env, stdout=sys.stderr if env.json else None)
    if env.json:
        emit_json({"exit_code": rc, "nsys_session": session, "command": cmd})
    sys.exit(rc)


def _run(argv: list[str], child_env: dict[str, str], stdout: Any) -> int:
    try:
        proc = subprocess.Popen(argv, env=child_env, stdout=stdout)
    except OSError as exc:
        raise CtlError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc
