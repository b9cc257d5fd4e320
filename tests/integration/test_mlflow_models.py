"""Registry versions are MLflow Models: tiny exports logged with the `transformers` flavor on a real `mlflow server`,
registered with an alias, loaded back by `mlflow.pyfunc.load_model("models:/<name>@<alias>")`, served once by
`mlflow models serve --env-manager local`. Run inside the loopback-only namespace: nothing can reach a hub.

The vocabulary is real (the vocab stage's trainer on real news text); the model weights are random (a trained model
is not needed to check that what the registry serves is exactly what we exported).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch

from deberta import hf
from deberta.config import debug
from deberta.model import DebertaForMaskedLM, DebertaForSequenceClassification
from pipeline.config import VocabConfig
from pipeline.lineage import EXPERIMENT_KIND, TAG_EXPERIMENT_KIND, Lineage
from pipeline.tokenizer import MODEL_FILE, SPECIAL_FILE, Tokenizer
from stages.vocab import train_model

pytest.importorskip("transformers")
mlflow = pytest.importorskip("mlflow")

ROWS = 1_100  # 1,000 pieces + [MASK], padded as padded_vocab_size does
LABELS = ("rotten", "fresh")
REVIEWS = ["A warm, funny and beautifully acted film.", "Dull, overlong and badly written.",
           "The plot makes no sense, but the music is wonderful.", "I left halfway through."]
PAIRS = pd.DataFrame({"text": ["A man is playing a guitar.", "Stocks fell sharply on Monday."],
                      "text_pair": ["Someone plays music.", "Markets rose in early trading."]})


@pytest.fixture(scope="module")
def vocab_dir(news_jsonl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vocab")
    with open(news_jsonl) as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(300), f)]
    lines = [p.strip() for d in docs for p in d.splitlines() if p.strip()]
    (out.parent / "sample.txt").write_text("\n".join(lines) + "\n")
    train_model(VocabConfig(vocab_size=1_000), out.parent / "sample.txt", out, num_threads=1)
    (out / SPECIAL_FILE).write_text(json.dumps(Tokenizer.load(out / MODEL_FILE).special_ids))
    return out


def _random(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _ours(model, tok, texts, pairs=None) -> torch.Tensor:
    enc = tok(list(texts), None if pairs is None else list(pairs), padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(enc["input_ids"], enc["attention_mask"])["logits"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_uri: str, tracking_uri: str, frame: pd.DataFrame, log: Path) -> list[dict]:
    """`mlflow models serve` in a child process; one POST /invocations; the server is stopped after."""
    port = _free_port()
    # the server runs `uvicorn` by name: the venv's bin directory must be on PATH
    env = dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"mlflow models serve exited: {log.read_text()[-3000:]}"
            assert time.time() < deadline, f"mlflow models serve did not answer /ping: {log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"dataframe_split": frame.to_dict(orient="split")}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=60).read())["predictions"]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def registered(mlflow_server, vocab_dir, tmp_path_factory):
    """Three exports (a 2-label classifier, a pair regression, the MLM) logged on a stage run and registered
    @champion; yields (tracker, exported models by key, HF directories by key, logged-model URIs by key)."""
    root = tmp_path_factory.mktemp("registered")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        tracker = Lineage(root / "wd").start("test", {"preset": "debug"}, ["finetune"]).child("finetune")
        cfg = debug(vocab_size=ROWS)
        models = {"clf": _random(DebertaForSequenceClassification(cfg, num_labels=2, classifier_dropout=0.1)),
                  "sts": _random(DebertaForSequenceClassification(cfg, num_labels=1, classifier_dropout=0.0)),
                  "mlm": _random(DebertaForMaskedLM(cfg))}
        dirs = {"clf": hf.save_pretrained(models["clf"], root / "clf", vocab_dir=vocab_dir, labels=LABELS,
                                          model_max_length=64),
                "sts": hf.save_pretrained(models["sts"], root / "sts", vocab_dir=vocab_dir, model_max_length=64),
                "mlm": hf.save_pretrained(models["mlm"], root / "mlm", vocab_dir=vocab_dir)}
        uris = {
            "clf": tracker.log_hf_model(dirs["clf"], task="text-classification",
                                        input_example=pd.DataFrame({"text": REVIEWS[:2]}), tags={"task": "rt"}),
            "sts": tracker.log_hf_model(dirs["sts"], task="text-classification", input_example=PAIRS),
            "mlm": tracker.log_hf_model(dirs["mlm"], task="fill-mask",
                                        input_example={"text": ["The president of the United [MASK] said."]}),
        }
        for key, uri in uris.items():
            assert tracker.register_model(f"deberta-debug-{key}", model_uri=uri, alias="champion",
                                          tags={"sweep": "test"}) == "1"
        yield tracker, models, dirs, uris


def test_registry_holds_logged_models_of_the_run(mlflow_server, registered):
    tracker, _, dirs, uris = registered
    client = mlflow.MlflowClient(mlflow_server)
    assert client.get_experiment(tracker.experiment_id).tags[TAG_EXPERIMENT_KIND] == EXPERIMENT_KIND
    # MLflow 3 logged models, in the pipeline's experiment, linked to the stage run; versions point at them
    for key, uri in uris.items():
        logged = client.get_logged_model(uri.removeprefix("models:/"))
        assert logged.source_run_id == tracker.run_id and logged.experiment_id == tracker.experiment_id
        assert logged.status == mlflow.entities.LoggedModelStatus.READY
        version = client.get_model_version_by_alias(f"deberta-debug-{key}", "champion")
        assert version.source == uri and version.run_id == tracker.run_id
    run = client.get_run(tracker.run_id)
    assert {o.model_id for o in run.outputs.model_outputs} >= {u.removeprefix("models:/") for u in uris.values()}
    with pytest.raises(ValueError, match="task='ner'"):
        tracker.log_hf_model(dirs["clf"], task="ner", input_example={"text": ["x"]})
    with pytest.raises(FileNotFoundError, match="lacks config.json or tokenizer.json"):
        tracker.log_hf_model(dirs["clf"].parent, task="fill-mask", input_example={"text": ["x"]})
    with pytest.raises(ValueError, match="give `text`"):
        tracker.log_hf_model(dirs["clf"], task="text-classification", input_example={"sentence": ["x"]})
    with pytest.raises(ValueError, match="exactly one of model_uri"):
        tracker.register_model("deberta-debug-clf", "model", model_uri=uris["clf"])


def test_pyfunc_predicts_what_we_exported(mlflow_server, registered, vocab_dir, monkeypatch):
    _, models, dirs, _ = registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    tok = hf.build_tokenizer(vocab_dir, model_max_length=64)
    loaded = mlflow.pyfunc.load_model("models:/deberta-debug-clf@champion")
    assert loaded.metadata.get_input_schema().input_names() == ["text"]
    got = loaded.predict(pd.DataFrame({"text": REVIEWS}))
    probs = _ours(models["clf"], tok, REVIEWS).softmax(-1)
    assert list(got["label"]) == [LABELS[i] for i in probs.argmax(-1)]
    assert got["score"].tolist() == pytest.approx(probs.max(-1).values.tolist(), abs=1e-5)

    got = mlflow.pyfunc.load_model("models:/deberta-debug-sts@champion").predict(PAIRS)
    want = _ours(models["sts"], tok, PAIRS.text, PAIRS.text_pair).view(-1)
    assert got["score"].tolist() == pytest.approx(want.tolist(), abs=1e-5)  # regression: raw, no sigmoid

    masked = ["The president of the United [MASK] said.", "It rained on [MASK]."]
    filled = mlflow.pyfunc.load_model("models:/deberta-debug-mlm@champion").predict(pd.DataFrame({"text": masked}))
    assert list(filled) == _fill_mask(dirs["mlm"], masked)  # the registry's model is the export, token for token


def test_mlflow_models_serve_answers_pairs(mlflow_server, registered, vocab_dir, tmp_path):
    _, models, _, _ = registered
    served = _serve("models:/deberta-debug-sts@champion", mlflow_server, PAIRS, tmp_path / "serve.log")
    want = _ours(models["sts"], hf.build_tokenizer(vocab_dir, 64), PAIRS.text, PAIRS.text_pair).view(-1)
    assert [p["score"] for p in served] == pytest.approx(want.tolist(), abs=1e-5)


def _fill_mask(path: Path, texts: list[str]) -> list[str]:
    import transformers

    fill = transformers.pipeline("fill-mask", model=str(path))
    return [fill(t, top_k=1)[0]["token_str"] for t in texts]
