"""The one byte-count format, and that it reads back as a config size."""

from __future__ import annotations

import pytest

from profd.config import _size
from profd.textfmt import human_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (1536, "1.5KiB"),
        ((1 << 20) - 1, "1.0MiB"),  # not 1024.0KiB
        (5 << 20, "5.0MiB"),
        (3 << 30, "3.0GiB"),
        (2 << 40, "2.0TiB"),
        (5000 << 40, "5000.0TiB"),
        (-1536, "-1.5KiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_digits() -> None:
    assert human_bytes(1234567, digits=2) == "1.18MiB"
    assert human_bytes(100, digits=2) == "100B"


@pytest.mark.parametrize("n", [512, 1 << 10, 20 << 30, 3 << 40])
def test_pastes_into_config(n: int) -> None:
    assert _size(human_bytes(n), "max_spool_bytes") == n
