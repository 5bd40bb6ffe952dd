"""profctl keys new: a CURVE key pair in pyzmq's certificate format, for an operator or a
daemon (``NAME.key`` public, ``NAME.key_secret`` secret, 0600)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from profd.ctl.errors import BadUsage, CtlError
from profd.ctl.main import Env, command
from profd.ctl.render import emit_json, say


@click.group()
def keys() -> None:
    """CURVE keys for TCP control (--cluster)."""


@keys.command("new")
@click.argument("name")
@click.option(
    "--dir",
    "directory",
    default=".",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where to write NAME.key and NAME.key_secret.",
)
@click.pass_obj
@command
def new(env: Env, name: str, directory: str) -> None:
    """Write NAME.key (public: give it to daemons' authorized_keys, or to profctl as
    --server-key) and NAME.key_secret (secret, mode 0600: keep it where it is used)."""
    import zmq

    if not name or "/" in name or name.startswith("."):
        raise BadUsage(f"bad key name {name!r}: a plain file name")
    d = Path(directory)
    public_file, secret_file = d / f"{name}.key", d / f"{name}.key_secret"
    for p in (public_file, secret_file):
        if p.exists():
            # A lost secret key locks its operator out of every daemon that trusted it.
            raise CtlError(f"{p} exists: remove it first or choose another name")
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    _write(secret_file, certificate(name, public, secret), 0o600)
    _write(public_file, certificate(name, public), 0o644)
    if env.json:
        emit_json(
            {
                "name": name,
                "public": str(public_file.resolve()),
                "secret": str(secret_file.resolve()),
                "public_key": public.decode("ascii"),
            }
        )
    else:
        say(f"wrote {public_file} (public) and {secret_file} (secret, 0600)")


def certificate(name: str, public: bytes, secret: bytes | None = None) -> str:
    """pyzmq's certificate format (ZPL), as ``zmq.auth.load_certificate`` reads it."""
    kind = "secret" if secret else "public"
    text = (
        f"#   ****  profd CURVE {kind} key: {name}  ****\n"
        "#   made by profctl keys new; zmq.auth certificate format\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{public.decode("ascii")}"\n'
    )
    if secret:
        text += f'    secret-key = "{secret.decode("ascii")}"\n'
    return text


def _write(path: Path, text: str, mode: int) -> None:
    # Created with its final mode before anything is in it: a secret is never readable by
    # others, whatever the umask; O_EXCL: never through a planted link.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
