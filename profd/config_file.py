"""Which config file profd reads, and reading it: all ``profctl`` needs of the config on its
way to a local daemon (``[daemon] runtime_dir``), without the settings' schema
(``profd.config``, a fifth of a ``profctl ps``'s imports)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/profd/profd.toml")


class ConfigError(ValueError):
    pass


def config_path(config_file: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    """The file to read: the argument, ``PROFD_CONFIG``, else the default one if it exists."""
    if config_file:
        return Path(config_file)
    if env.get("PROFD_CONFIG"):
        return Path(env["PROFD_CONFIG"])
    if DEFAULT_CONFIG.exists():
        return DEFAULT_CONFIG
    return None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except OSError as exc:  # a directory, no permission: one line, not a traceback
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None


def profctl_config(config_file: str | None) -> dict[str, Any]:
    """The config file profd would read (``config_file``, ``PROFD_CONFIG``, the default), as
    parsed TOML; empty when there is none."""
    path = config_path(config_file, os.environ)
    return read_toml(path) if path is not None else {}


def configured_runtime_dir(config_file: str | None = None) -> str | None:
    """``[daemon] runtime_dir`` from the config file profd would read, for profctl."""
    daemon = profctl_config(config_file).get("daemon", {})
    value = daemon.get("runtime_dir") if isinstance(daemon, dict) else None
    return str(value) if value else None
