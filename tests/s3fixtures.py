"""A real S3 endpoint for tests: moto's standalone server as a subprocess.

A subprocess (not moto's in-process mock) so the daemon talks to it over HTTP like it would
to MinIO or AWS, and so a test can stop it and start it again on the same port to simulate
an outage. moto keeps its state in memory: a restart empties it, so ``start()`` recreates
the bucket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from daemonproc import free_port
from harness import wait_for

# Distinctive fake credentials: the tests grep logs and status output for them.
ACCESS_KEY = "AKIAPROFDTEST7QX2ZK4W"
SECRET_KEY = "profd-test-secret/Zq9xW3vT7mR2pL8kN5hJ"
REGION = "us-east-1"
BUCKET = "profd-test"


def credentials_env(tmp: Path) -> dict[str, str]:
    """Only these fake credentials: no host credential files, no instance metadata."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": str(tmp / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@dataclass
class MotoServer:
    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.root / "moto.log"

    def env(self) -> dict[str, str]:
        """What a daemon or profctl needs to reach this server."""
        return {**credentials_env(self.root), "PROFD_S3_ENDPOINT_URL": self.endpoint}

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def start(self) -> MotoServer:
        logf = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=logf,
            stderr=logf,
            env={**os.environ, **credentials_env(self.root)},
        )
        wait_for(self._answers, 60, "moto server to answer", every=0.2)
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        wait_for(lambda: not self._answers(), 15, "moto server to stop answering")

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name=REGION
        ).client(
            "s3",
            endpoint_url=self.endpoint,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def objects(self, prefix: str = "") -> dict[str, int]:
        """Every complete object under ``prefix``: key -> size."""
        out: dict[str, int] = {}
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
        return out

    def get(self, key: str) -> bytes:
        body: bytes = self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return body


@pytest.fixture
def moto_server(tmp_path: Path) -> Iterator[MotoServer]:
    root = tmp_path / "moto"
    root.mkdir()
    srv = MotoServer(root).start()
    try:
        yield srv
    finally:
        srv.stop()
