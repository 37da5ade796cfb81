"""A real S3-compatible server (moto) on the loopback address, for tests of object storage."""

from __future__ import annotations

import socket

import pytest

S3_OPTIONS = {"key": "testing", "secret": "testing"}


def start_s3_server(bucket: str):
    """A started moto server holding ``bucket``: (server, endpoint URL). Skips the calling
    test when moto or s3fs is missing."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3 = s3fs.S3FileSystem(**S3_OPTIONS, client_kwargs={"endpoint_url": endpoint})
    if not s3.exists(bucket):  # moto keeps its buckets per process, across servers
        s3.mkdir(bucket)
    return server, endpoint
