"""Which nsys can write reports, and what it left for an output path (pure file layout)."""

from __future__ import annotations

import os
from pathlib import Path

from profd import nsys


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_nsight_systems_layouts_have_their_importer(tmp_path: Path) -> None:
    root = tmp_path / "opt" / "nvidia" / "nsight-systems" / "2025.3.1"
    imp = _exe(root / "host-linux-x64" / nsys.IMPORTER)
    for binary in (root / "target-linux-x64" / "nsys", root / "bin" / "nsys"):
        _exe(binary)
        assert nsys.importer(str(binary)) == imp
        assert nsys.import_problem(str(binary)) is None
    # Found through a link on PATH, as the packages install it.
    link = tmp_path / "usr" / "local" / "bin" / "nsys"
    link.parent.mkdir(parents=True)
    link.symlink_to(root / "bin" / "nsys")
    assert nsys.importer(str(link)) == imp


def test_the_nsys_inside_nsight_compute_cannot_import(tmp_path: Path) -> None:
    ncu = tmp_path / "nsight-compute" / "2025.3.1"
    _exe(ncu / "ncu")
    binary = _exe(ncu / "host" / "target-linux-x64" / "nsys")
    assert nsys.importer(str(binary)) is None
    why = nsys.import_problem(str(binary))
    assert why is not None and str(binary) in why and "Nsight Compute" in why
    # An importer that is not executable does not count.
    (ncu / "host" / "linux-desktop-glibc_2_11_3-x64").mkdir()
    (ncu / "host" / "linux-desktop-glibc_2_11_3-x64" / nsys.IMPORTER).write_text("")
    assert nsys.importer(str(binary)) is None


def test_lone_streams_are_raw_captures_without_a_report(tmp_path: Path) -> None:
    base = tmp_path / "profd-ab12"
    for name in ("profd-ab12.qdstrm", "profd-ab12.2.nsys-rep", "profd-ab12.2.qdstrm",
                 "profd-ab12.3.qdstrm", "other.qdstrm"):  # fmt: skip
        (tmp_path / name).write_text("x")
    # Range 2 is being converted (both files); ranges 1 and 3 have only their stream.
    assert nsys.lone_streams(base) == [
        tmp_path / "profd-ab12.qdstrm",
        tmp_path / "profd-ab12.3.qdstrm",
    ]
    assert nsys.reports(base) == []
    os.unlink(tmp_path / "profd-ab12.2.qdstrm")
    assert nsys.reports(base) == [tmp_path / "profd-ab12.2.nsys-rep"]


def test_left_only_is_one_line_saying_what_was_left_why_and_what_to_install() -> None:
    stream = Path("/spool/.incoming/j/s/nsys/profd-ab12.qdstrm")
    for why in (None, "/x/nsys has no QdstrmImporter near it"):
        line = nsys.left_only(stream, why)
        assert "\n" not in line
        assert line.startswith(f"nsys left only {stream} ")
        assert "no profd-ab12.nsys-rep" in line
        assert "Nsight Compute" in line or (why and why in line)
        assert "install Nsight Systems (the nsight-systems package" in line


def test_an_importer_that_cannot_load_a_library_is_named_with_the_library(tmp_path: Path) -> None:
    # TEST DOUBLE: the loader's words of Nsight Compute's importer without elfutils' libdw.
    host = tmp_path / "ncu" / "host"
    binary = host / "target-linux-x64" / "nsys"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    imp = host / "linux-desktop-glibc_2_11_3-x64" / nsys.IMPORTER
    imp.parent.mkdir()
    imp.write_text(
        '#!/bin/sh\necho "$0: error while loading shared libraries: libdw.so.1: cannot open'
        ' shared object file: No such file or directory" >&2\nexit 127\n'
    )
    imp.chmod(0o755)
    why = nsys.import_problem(str(binary))
    assert why is not None and "libdw.so.1 is missing" in why and "apt install libdw1" in why
    # Mended in place (a new file): asked again, not answered from the cache.
    imp.write_text("#!/bin/sh\necho QdstrmImporter 2025.3\n")
    os.utime(imp, (1, 1))
    assert nsys.import_problem(str(binary)) is None


def test_an_importer_that_answers_with_an_error_of_its_own_is_not_called_broken(
    tmp_path: Path,
) -> None:
    # Only what certainly stops it counts: an unknown flag's exit 1 is no proof.
    binary = tmp_path / "host-linux-x64" / "nsys"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    imp = binary.parent / nsys.IMPORTER
    imp.write_text("#!/bin/sh\necho 'unknown option --version' >&2\nexit 1\n")
    imp.chmod(0o755)
    assert nsys.import_problem(str(binary)) is None
