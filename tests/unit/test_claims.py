"""Processes that claim one identity: who they are, what they are named, what is said."""

from __future__ import annotations

from profd import claims


def test_only_identities_claimed_twice_are_claimants() -> None:
    procs = [(("j", "main", 0), 12), (("j", "main", 0), 7), (("j", "main", 1), 9)]
    procs += [(("k", "main", 0), 5), (("j", "main", 0), 12)]  # the same process twice: once
    assert claims.claimants(procs) == {("j", "main", 0): [7, 12]}
    assert claims.claimants([(("j", "main", 1), 9)]) == {}


def test_a_unique_identity_keeps_the_name_hta_reads() -> None:
    assert claims.stem("main", 0) == "main-r0"
    assert claims.stem("rollout", 12, 4242) == "rollout-r12-p4242"


def test_notes_name_every_claimant_and_its_files() -> None:
    targets = [
        ("main", 0, 200, "main-r0-p200"),
        ("main", 1, 300, "main-r1"),
        ("main", 0, 100, "main-r0-p100"),
        ("actor", 0, 400, "actor-r0"),
    ]
    assert claims.notes(targets) == [
        "2 processes claim main rank 0 (pids 100, 200): their files are main-r0-p100, main-r0-p200"
    ]
    assert claims.notes(targets[1:2]) == []
