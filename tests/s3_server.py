"""A real S3 server on loopback for the tests: `cluster.local_s3` (SeaweedFS's `weed mini`, installed by the dev
extra), which checks credentials as AWS does. Started once per test module by the `s3_server` fixture and stopped
after it, so that its fixed ports are free for the next module."""

from __future__ import annotations

import pytest

from cluster.local_s3 import S3Server, serve

__all__ = ["S3Server", "s3_server"]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> S3Server:
    with serve(tmp_path_factory.mktemp("s3")) as server:
        yield server
