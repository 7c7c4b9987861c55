"""A real S3 API on 127.0.0.1 (moto in server mode) for the storage-URI tests: pyarrow,
Ray and boto3 reach it as they reach S3, through ``AWS_ENDPOINT_URL``, with dummy
credentials."""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class S3Server:
    """A running moto server: its endpoint and the environment that points clients at it."""

    endpoint: str

    @property
    def env(self) -> dict[str, str]:
        """What a process (this one, or a subprocess) needs to use the server as S3."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        import boto3

        env = self.env
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self) -> str:
        """A fresh, empty bucket's name (a bucket per test: nothing shared)."""
        name = f"hiertx-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        """Every file's key in ``bucket``, sorted: not the empty ``<folder>/`` objects
        pyarrow leaves to keep a folder whose last file it deleted (a rename is a copy and
        a delete on S3)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        keys = (o["Key"] for page in pages for o in page.get("Contents", []))
        return sorted(k for k in keys if not k.endswith("/"))

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def put(self, bucket: str, key: str, content: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=content)


def running() -> Iterator[S3Server]:
    """A moto S3 server on a free port of 127.0.0.1 while the generator is open."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request, else
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield S3Server(f"http://{host}:{port}")
    finally:
        server.stop()


def serve_until(port: int, stop: Path) -> None:
    """A moto S3 server on 127.0.0.1:``port`` until the file ``stop`` exists: for clients
    this process cannot reach, as in a cluster's network namespace
    (``python -m tests.s3_server PORT STOP`` started there)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        while not stop.exists():
            time.sleep(0.2)
    finally:
        server.stop()


if __name__ == "__main__":
    serve_until(int(sys.argv[1]), Path(sys.argv[2]))
