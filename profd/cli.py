"""``profd``: the daemon's command line (``profd run``)."""

from __future__ import annotations

import logging
import sys

import click

from profd import __version__
from profd.config import ConfigError, load
from profd.daemon.runtime.rundir import RuntimeDirError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="profd")
def main() -> None:
    """profd: per-node profiling daemon for distributed PyTorch jobs."""


@main.command()
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="TOML config file.")
@click.option("--runtime-dir", help="Socket dir (PROFD_RUNTIME_DIR).")
@click.option("--state-dir", help="Index dir (PROFD_STATE_DIR).")
@click.option("--spool-dir", help="Trace spool (PROFD_SPOOL_DIR).")
@click.option("--s3-url", help="s3://bucket/prefix to upload to (PROFD_S3_URL).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def run(
    config_file: str | None,
    runtime_dir: str | None,
    state_dir: str | None,
    spool_dir: str | None,
    s3_url: str | None,
    verbose: bool,
) -> None:
    """Run the daemon in the foreground (the systemd unit runs this)."""
    try:
        cfg = load(
            config_file,
            runtime_dir=runtime_dir,
            state_dir=state_dir,
            spool_dir=spool_dir,
            s3_url=s3_url,
        )
    except ConfigError as exc:
        click.echo(f"profd: {exc}", err=True)
        sys.exit(2)
    level = logging.DEBUG if verbose else getattr(logging, cfg.log_level.upper(), logging.INFO)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from profd.daemon.loop import Daemon
    from profd.reactor import Reactor

    make_uploads = None
    if cfg.s3.enabled:
        from profd.store.uploads import Uploads

        def make_uploads(reactor: Reactor) -> Uploads:
            return Uploads(cfg, reactor)

    from profd.store.index import IndexSchemaError

    try:
        Daemon(cfg, make_uploads).run()
    except (RuntimeDirError, ConfigError, IndexSchemaError, OSError) as exc:
        click.echo(f"profd: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
