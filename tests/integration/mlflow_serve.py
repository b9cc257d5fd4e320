"""For the tests of registry versions (not a test module): `mlflow models serve` as a user starts it, and the
answer a fill-mask version owes, from our own model's logits."""

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
import torch

from tests.conftest import free_port


@dataclass(frozen=True)
class Served:
    predictions: list[dict]
    """The `predictions` of the one POST /invocations."""
    seconds_to_ping: float
    """From starting `mlflow models serve` to its first answer on /ping."""
    seconds_to_answer: float
    """From starting it to the answer of the first POST /invocations."""
    record_predictions: list[dict] | None = None
    """The `predictions` of the POST with `dataframe_records`, when records were given."""


def serve_once(model_uri: str, tracking_uri: str, frame: pd.DataFrame, log: Path, timeout: float = 180,
               records: list[dict] | None = None) -> Served:
    """`mlflow models serve -m URI --env-manager local` on 127.0.0.1 in a child process; one POST /invocations
    with the frame as `dataframe_split` (docs/serving.md's first curl line), then, given `records`, one with them as
    `dataframe_records` (its second); the server is stopped after."""
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
        predictions = _invoke(port, {"dataframe_split": frame.to_dict(orient="split", index=False)})
        answered = time.monotonic()
        from_records = None if records is None else _invoke(port, {"dataframe_records": records})
        return Served(predictions, pinged - started, answered - started, from_records)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def _invoke(port: int, payload: dict) -> list[dict]:
    """POST /invocations with a JSON body, as `curl -H 'Content-Type: application/json' -d ...` does."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["predictions"]


def fill_mask_reference(model, tok, texts: list[str]) -> tuple[list[int], list[float]]:
    """Our MLM's own answer at each text's [MASK], as its HF export computes it: all L layers and the head without
    the EMD (HF has no place for it), softmax over the tokenizer's ids (the export's LM-head bias shuts the padding
    rows past them, deberta.hf.NOT_A_TOKEN_BIAS). `tok`: a transformers tokenizer. Returns the best id and its
    probability per text."""
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model.eval()(enc["input_ids"], enc["attention_mask"], use_emd=False)["logits"]  # (B, T, V)
    rows, cols = (enc["input_ids"] == tok.mask_token_id).nonzero(as_tuple=True)
    assert rows.tolist() == list(range(len(texts))), "one [MASK] per text"
    probs = logits[rows, cols, :len(tok)].softmax(-1)  # (B, len(tok))
    best = probs.max(-1)
    return best.indices.tolist(), best.values.tolist()
