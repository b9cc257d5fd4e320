"""`mlflow models serve` as a user starts it, for the tests that serve a registry version (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from tests.conftest import free_port


@dataclass(frozen=True)
class Served:
    predictions: list[dict]
    """The `predictions` of the one POST /invocations."""
    seconds_to_ping: float
    """From starting `mlflow models serve` to its first answer on /ping."""
    seconds_to_answer: float
    """From starting it to the answer of the first POST /invocations."""


def serve_once(model_uri: str, tracking_uri: str, frame: pd.DataFrame, log: Path, timeout: float = 180) -> Served:
    """`mlflow models serve -m URI --env-manager local` on 127.0.0.1 in a child process; one POST /invocations
    with the frame as `dataframe_split` (what the README's curl line sends); the server is stopped after."""
    port = free_port()
    # the server runs `uvicorn` by name: the venv's bin directory must be on PATH
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
           "--host", "127.0.0.1", "--port", str(port)]
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            assert proc.poll() is None, f"mlflow models serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < started + timeout, f"no answer on /ping: {log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                time.sleep(0.25)
        pinged = time.monotonic()
        body = json.dumps({"dataframe_split": frame.to_dict(orient="split", index=False)}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        predictions = json.loads(urllib.request.urlopen(request, timeout=120).read())["predictions"]
        return Served(predictions, pinged - started, time.monotonic() - started)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
