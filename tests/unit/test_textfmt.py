"""The one byte-count format, and that it reads back as a config size."""

from __future__ import annotations

import pytest

from profd.config import _size
from profd.textfmt import human_bytes, printable


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


HOSTILE = [
    ("\x1b]52;c;SGVsbG8=\x07", "\\x1b]52;c;SGVsbG8=\\x07"),  # OSC 52: a clipboard write
    ("a\nforged row", "a\\x0aforged row"),
    ("a\rb\tc\x00\x7f", "a\\x0db\\x09c\\x00\\x7f"),
    ("\x9b2J\x85", "\\x9b2J\\x85"),  # C1: CSI, NEL
    ("abc\u202edef\u2066\u2069", "abc\\u202edef\\u2066\\u2069"),  # bidi override, isolate
    ("zero\u200bwidth\ufeff", "zero\\u200bwidth\\ufeff"),
    ("\u2028\u2029", "\\u2028\\u2029"),  # line and paragraph separators
    ("tag\U000e0041", "tag\\U000e0041"),  # an invisible tag character
    ("\ud800", "\\ud800"),  # a lone surrogate: not even encodable
]


@pytest.mark.parametrize(("text", "shown"), HOSTILE)
def test_printable_escapes_what_a_terminal_would_act_on(text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(shown) == shown  # what it writes is plain text


@pytest.mark.parametrize(
    "text", ["node-1", "ünïcödé 名前 ✓ 🚀", "a b\u00a0c\u3000d", "back\\slash", ""]
)
def test_printable_keeps_printable_text_and_spaces_as_they_are(text: str) -> None:
    assert printable(text) == text


def test_printable_keeps_newlines_of_a_block_only_when_asked() -> None:
    assert printable("a\nb\x1b[2Jc\r", newlines=True) == "a\nb\\x1b[2Jc\\x0d"
    assert printable("a\nb") == "a\\x0ab"


def test_every_c0_c1_and_del_is_escaped() -> None:
    for n in [*range(0x20), *range(0x7F, 0xA0)]:
        assert printable(chr(n)) == f"\\x{n:02x}", n
