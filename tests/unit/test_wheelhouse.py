"""``python3 dev.py wheelhouse``: the platform tags it asks pip for, and what it holds.

``pip download --platform TAG`` takes only wheels that carry TAG itself, so the list must name
the tags real wheels of profd's dependencies carry. The file names below are what PyPI served
for them (py-spy publishes ``manylinux1``/``manylinux_2_5`` wheels only, which a list holding
just ``manylinux_2_28`` missed); the rule checked after them keeps a new dependency's older
tag from being missed the same way.
"""

from __future__ import annotations

import re
import sys

from devpy import dev

#: Binary wheels PyPI served for profd's dependencies (x86_64 Linux), as named there.
SERVED = (
    "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl",
    "psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl",
    "msgpack-1.2.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl",
    # Older py-spy releases: the same old tags only.
    "py_spy-0.3.14-py2.py3-none-manylinux_2_5_x86_64.manylinux1_x86_64.whl",
)

#: The legacy manylinux names and the glibc each stands for (PEP 600).
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def glibc(tag: str) -> tuple[int, int]:
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag)
    if m:
        return int(m[1]), int(m[2])
    return LEGACY[tag.removesuffix("_x86_64")]


def platform_tags(wheel: str) -> set[str]:
    return set(wheel.removesuffix(".whl").split("-")[-1].split("."))


def test_every_served_wheel_carries_a_tag_the_wheelhouse_asks_for() -> None:
    for wheel in SERVED:
        assert platform_tags(wheel) & set(dev.WHEEL_PLATFORMS), wheel


def test_the_tags_run_from_torchs_glibc_down_to_manylinux1_in_both_spellings() -> None:
    tags = dev.WHEEL_PLATFORMS
    levels = [glibc(t) for t in tags]
    # torch 2.6+ needs glibc 2.28: a machine with it accepts every older level too.
    assert levels[0] == (2, 28) and levels == sorted(levels, reverse=True)
    assert min(levels) == LEGACY["manylinux1"]
    for legacy, level in LEGACY.items():
        # A wheel may carry either spelling alone; pip matches the one it is given.
        assert f"{legacy}_x86_64" in tags
        assert "manylinux_{}_{}_x86_64".format(*level) in tags
    assert len(set(tags)) == len(tags)


def test_pip_download_gets_one_platform_option_per_tag_and_only_binary_wheels() -> None:
    cmd = dev.download_command("3.12", ["py-spy>=0.3.14"])
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    given = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--platform"]
    assert given == list(dev.WHEEL_PLATFORMS)
    assert "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[-1] == "py-spy>=0.3.14"


def test_test_gpu_installs_every_runtime_dependency_but_the_warehouses() -> None:
    import tomllib

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in reqs}

    wanted: set[str] = set()
    for project in dev.PROJECTS:
        wanted |= names(
            tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
        )
    # fill_wheelhouse downloads and ensure_gpu_env installs this list; the daemon wheel goes
    # in with --no-deps, so everything else it needs must be on it.
    assert names(dev.gpu_dependencies()) == wanted - {"profd-client", *dev.WAREHOUSE_DEPS}
    assert {"pyarrow", "duckdb"} <= wanted
    assert dev.BUILD_REQS[0] == "setuptools>=77"  # the license as an SPDX string needs 77
