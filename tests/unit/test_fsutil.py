"""atomic_write / atomic_path: all or nothing, flushed, with the permissions open() gives."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from profd import fsutil


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_atomic_write_bytes_and_text(tmp_path: Path) -> None:
    p = tmp_path / "session.json"
    fsutil.atomic_write(p, b"\x00old")
    assert p.read_bytes() == b"\x00old"
    fsutil.atomic_write(p, "néw")
    assert p.read_text(encoding="utf-8") == "néw"
    assert os.listdir(tmp_path) == ["session.json"]


def test_default_and_explicit_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        fsutil.atomic_write(tmp_path / "a", "x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a") == 0o640
    fsutil.atomic_write(tmp_path / "key_secret", "x", mode=0o600)
    assert _mode(tmp_path / "key_secret") == 0o600


def test_failure_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "trace.json.gz"
    p.write_text("old")
    with pytest.raises(RuntimeError), fsutil.atomic_path(p) as tmp:
        tmp.write_text("half")
        raise RuntimeError("download failed")
    assert p.read_text() == "old"
    assert os.listdir(tmp_path) == ["trace.json.gz"]


def test_temp_name_is_a_hidden_sibling(tmp_path: Path) -> None:
    p = tmp_path / "main-r0.pt.trace.json.gz"
    with fsutil.atomic_path(p) as tmp:
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(".main-r0.pt.trace.json.gz.tmp-")
        tmp.write_text("x")
    assert p.read_text() == "x"


def test_writer_that_renames_over_the_temp(tmp_path: Path) -> None:
    # boto3's download_file writes its own temporary file and renames it onto the name given.
    p = tmp_path / "f"
    with fsutil.atomic_path(p) as tmp:
        other = tmp_path / "other"
        other.write_text("downloaded")
        os.replace(other, tmp)
    assert p.read_text() == "downloaded"


def test_file_and_directory_are_flushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = fsutil.fsync_path

    def spy(path: fsutil.StrPath) -> None:
        synced.append(os.fspath(path))
        real(path)

    monkeypatch.setattr(fsutil, "fsync_path", spy)
    fsutil.atomic_write(tmp_path / "f", "x")
    assert len(synced) == 2
    assert Path(synced[0]).parent == tmp_path and ".tmp-" in synced[0]
    assert synced[1] == os.fspath(tmp_path)


def test_temporary_names_are_recognisable(tmp_path: Path) -> None:
    # What each writer makes while it writes (a killed daemon leaves these behind), and what
    # the spool holds for good, which the start-up clean-up must never take for one.
    seen: list[str] = []
    with fsutil.atomic_path(tmp_path / "session.json") as tmp:
        seen.append(tmp.name)
    with fsutil.atomic_path(tmp_path / ("r" * 250)) as tmp:
        seen.append(tmp.name)
    seen.append(f"{fsutil.temp_prefix('main-r0.pt.trace.json.gz')}{os.getpid()}")
    assert all(fsutil.is_temp_name(n) for n in seen), seen
    for final in ("session.json", "main-r0.pt.trace.json.gz", "w-r1.summary.txt", ".incoming",
                  "c0", ".tmp-abc", "x.tmp-abcd1234", ".x.tmp-", ".x.tmp-ABC/"):  # fmt: skip
        assert not fsutil.is_temp_name(final), final
