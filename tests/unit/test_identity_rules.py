"""Identity detection (``client/profd_client/identity.py``): the pure rules, no launcher.

``detect`` takes the environment, the process group's view (``DistInfo``) and Ray's
(``RayInfo``) as arguments, so each launcher's case is a table row here; the real launchers
run in ``tests/test_identity.py``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from profd_client import protocol as P
from profd_client.identity import (
    DistInfo,
    RayInfo,
    detect,
    probe_dist,
    probe_ray,
    safe_name,
    snake_case,
)


@pytest.mark.parametrize(
    ("cls", "role"),
    [
        ("DTensorPolicyWorker", "dtensor_policy_worker"),
        ("VllmGenerationWorker", "vllm_generation_worker"),
        ("MegatronPolicyWorker", "megatron_policy_worker"),
        ("ActorRolloutRefWorker", "actor_rollout_ref_worker"),
        ("WorkerDict", "worker_dict"),
        ("HTTPServer", "http_server"),
        ("FSDPWorker", "fsdp_worker"),
        ("PolicyWorkerV2", "policy_worker_v2"),
        ("Worker2Gen", "worker2_gen"),
        ("worker", "worker"),
        ("My_Worker", "my_worker"),
        ("Ärger", "_rger"),
    ],
)
def test_snake_case(cls: str, role: str) -> None:
    assert snake_case(cls) == role
    P.safe_name(snake_case(cls), "role")


def test_safe_name_makes_one_path_component() -> None:
    assert safe_name("train-fe80::1%eth0-29500", "x") == "train-fe80::1_eth0-29500"
    assert safe_name("../etc", "x") == "_etc"
    assert safe_name("", "x") == "x"
    assert len(safe_name("a" * 500, "x")) == P.MAX_NAME


def d(env: dict[str, str], argv0: str = "/x/train.py", rank_pid: int = 0, **kw: Any) -> Any:
    return detect(env, argv0=argv0, pid=1000 + rank_pid, ppid=77, **kw)


def test_lone_process_is_its_own_job_not_its_parents() -> None:
    a = d({}, rank_pid=1)
    b = d({}, rank_pid=2)
    # Two unrelated `python train.py` started from one shell share the parent.
    assert a.job == "train-1001" and b.job == "train-1002"
    assert a.sources["job"] == "process"
    assert (a.rank, a.world_size, a.local_rank, a.role) == (0, 1, 0, "main")
    assert a.sources["rank"] == "default" and a.sources["role"] == "default"


def test_rendezvous_address_is_the_job_of_every_rank() -> None:
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    ranks = [d({**env, "RANK": str(r)}, rank_pid=r) for r in range(4)]
    assert {i.job for i in ranks} == {"train-10.0.0.1-29500"}
    assert ranks[0].sources["job"] == "env:MASTER_ADDR+MASTER_PORT"
    assert [i.rank for i in ranks] == [0, 1, 2, 3]
    other = d({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"})
    assert other.job != ranks[0].job


def test_process_group_wins_over_launcher_variables() -> None:
    # Lightning's child: LOCAL_RANK and WORLD_SIZE, no RANK; then the group says rank 1.
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "LOCAL_RANK": "1"}
    before = d({**env, "WORLD_SIZE": "2"})
    assert (before.rank, before.world_size, before.local_rank) == (0, 2, 1)
    after = d({**env, "WORLD_SIZE": "2"}, dist=DistInfo(1, 2, "127.0.0.1:4242"))
    assert (after.rank, after.world_size, after.local_rank) == (1, 2, 1)
    assert after.sources["rank"] == after.sources["world_size"] == "torch.distributed"
    # The store the group met at: the same job the variables gave.
    assert after.job == before.job == "train-127.0.0.1-4242"
    assert after.sources["job"] == "torch.distributed"


def test_job_from_the_store_when_no_variables_name_it() -> None:
    # mp.spawn with init_method="tcp://..." or variables set only in the child.
    before = d({})
    after = d({}, dist=DistInfo(3, 4, "localhost:12355"))
    assert before.job == "train-1000"
    assert after.job == "train-localhost-12355" and after.rank == 3
    assert after.local_rank == 3 and after.sources["local_rank"] == "rank"


def test_launcher_ids_and_explicit_values_keep_precedence() -> None:
    dist = DistInfo(5, 8, "h:1")
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "2", "WORLD_SIZE": "8"}
    assert d({**env, "TORCHELASTIC_RUN_ID": "rdzv7"}, dist=dist).job == "rdzv7"
    assert d({**env, "TORCHELASTIC_RUN_ID": "none"}, dist=dist).job == "train-h-1"
    slurm = d({**env, "SLURM_JOB_ID": "99", "SLURM_STEP_ID": "3"}, dist=dist)
    assert slurm.job == "99.3" and slurm.sources["job"] == "env:SLURM_JOB_ID"
    mine = d({**env, "PROFD_JOB": "mine", "PROFD_RANK": "7", "PROFD_ROLE": "actor"}, dist=dist)
    assert (mine.job, mine.rank, mine.role) == ("mine", 7, "actor")
    assert mine.sources == {
        "job": "env:PROFD_JOB",
        "role": "env:PROFD_ROLE",
        "rank": "env:PROFD_RANK",
        "world_size": "torch.distributed",
        "local_rank": "rank",
    }
    arg = d({**env, "PROFD_JOB": "mine"}, job="j", rank=1, world_size=2, role="r", dist=dist)
    assert (arg.job, arg.rank, arg.world_size, arg.role) == ("j", 1, 2, "r")
    assert {arg.sources[k] for k in ("job", "rank", "world_size", "role")} == {"arg"}


def test_launcher_without_a_job_id_falls_back_to_the_launcher() -> None:
    # mpirun without PMIx: the local ranks share mpirun as parent.
    i = d({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert i.job == "train-77" and i.sources["job"] == "launcher"
    assert d({"PMIX_NAMESPACE": "prterun-n1-123@1"}).job == "prterun-n1-123@1"


def test_ray_actor_job_role_and_ignored_slurm_variables() -> None:
    ray = RayInfo("01000000", "session_2026-01-01_00-00-00_000000_1", "DTensorPolicyWorker")
    env = {"SLURM_JOB_ID": "55", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    a = d(env, ray=ray)
    assert a.job.startswith("ray-01000000-") and a.sources["job"] == "ray"
    assert a.role == "dtensor_policy_worker" and a.sources["role"] == "ray"
    # The raylet's SLURM task, not the actor's rank.
    assert (a.rank, a.world_size) == (0, 1)
    other_cluster = d(env, ray=RayInfo("01000000", "session_b", "DTensorPolicyWorker"))
    assert other_cluster.job != a.job
    # The framework's own variables (verl, NeMo RL set these) and the group still count.
    b = d({**env, "RANK": "1", "WORLD_SIZE": "2"}, ray=ray)
    assert (b.rank, b.world_size) == (1, 2)
    c = d(env, ray=ray, dist=DistInfo(2, 4, "x:1"))
    assert (c.rank, c.world_size, c.job) == (2, 4, a.job)
    assert d({**env, "PROFD_ROLE": "policy"}, ray=ray).role == "policy"
    driver = d(env, ray=RayInfo("02000000", None, None))
    assert driver.job == "ray-02000000" and driver.role == "main"


def test_every_detected_identity_is_a_valid_hello() -> None:
    for ident in (
        d({"MASTER_ADDR": "fe80::1%eth0", "MASTER_PORT": "1"}),
        d({}, argv0="my script (1).py"),
        d({}, ray=RayInfo("01000000", "s", "Ünicode")),
    ):
        P.encode(
            P.HELLO,
            pid=ident.pid,
            host=ident.host,
            job=ident.job,
            role=ident.role,
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            step=0,
            step_mode="manual",
            allowed=True,
            client_version=P.RELEASE,
            identity_source=dict(ident.sources),
        )


def test_probes_never_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert probe_ray() is None
    assert "ray" not in sys.modules
    fake = types.ModuleType("torch.distributed")
    fake.is_available = lambda: True  # type: ignore[attr-defined]
    fake.is_initialized = lambda: False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    assert probe_dist() is None
    monkeypatch.delitem(sys.modules, "torch.distributed")
    assert probe_dist() is None


def test_the_public_identity_is_the_function_not_the_module() -> None:
    # A fresh interpreter: the lazy API import must not leave profd_client.identity bound to
    # the identity submodule, whichever public name is used first.
    import subprocess

    for first in ("attach", "identity", "step"):
        code = (
            "import profd_client\n"
            f"profd_client.{first}\n"
            "assert callable(profd_client.identity), profd_client.identity\n"
            "assert profd_client.identity() is None\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, (first, r.stderr)


def test_client_submodules_import_directly_in_a_fresh_interpreter() -> None:
    # bench/simclients.py and the daemon import submodules first; ``from . import protocol``
    # inside agent.py asks the package's __getattr__, which must not load the API from there.
    import subprocess

    for first in ("profd_client.agent", "profd_client.protocol", "profd_client.steps"):
        code = (
            f"import {first}\n"
            "import profd_client\n"
            "assert callable(profd_client.attach) and callable(profd_client.identity)\n"
            "assert profd_client.identity() is None\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, (first, r.stderr)
