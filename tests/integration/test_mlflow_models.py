"""Registry versions are MLflow Models: tiny exports logged as core/hf_pyfunc.py models on a real `mlflow server`,
registered with an alias, loaded back by `mlflow.pyfunc.load_model("models:/<name>@<alias>")` and served once by
`mlflow models serve --env-manager local`; a bad `finetune.init=models:/...` is one message. Run inside the
loopback-only namespace: nothing can reach a hub. (Fine-tuning from a version the pretrain stage registered runs
through `python -m pipeline.run` in tests/integration/test_pipeline_cli.py.)

The vocabulary is real (the vocab stage's trainer on real news text); the model weights are random (a trained model
is not needed to check that what the registry serves is exactly what we exported).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from deberta import hf
from deberta.config import debug
from deberta.heads import DebertaForSequenceClassification
from deberta.model import DebertaForMaskedLM, DebertaModel
from core.config import VocabConfig
from core.lineage import EXPERIMENT_KIND, TAG_EXPERIMENT_KIND, Lineage
from core.tokenizer import MODEL_FILE, SPECIAL_FILE, Tokenizer
from stages.finetune.kinds.base import code_tree
from stages.finetune.registry import export_onnx
from stages.vocab import train_model
from tests.integration.mlflow_serve import fill_mask_reference, serve_once

ROWS = 1_100  # 1,000 pieces + [MASK], padded as padded_vocab_size does
LABELS = ("rotten", "fresh")
REVIEWS = ["A warm, funny and beautifully acted film.", "Dull, overlong and badly written.",
           "The plot makes no sense, but the music is wonderful.", "I left halfway through."]
PAIRS = pd.DataFrame({"sentence1": ["A man is playing a guitar.", "Stocks fell sharply on Monday."],
                      "sentence2": ["Someone plays music.", "Markets rose in early trading."]})
REPO = Path(__file__).resolve().parents[2]
SERVING_RECORDS = [{"sentence1": "A man is playing a guitar.", "sentence2": "Someone plays music."}]
"""docs/serving.md's `dataframe_records` example (test_serving_records_are_the_docs_example keeps the two equal)."""


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


def _random(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _ours(model, tok, texts, pairs=None) -> torch.Tensor:
    enc = tok(list(texts), None if pairs is None else list(pairs), padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(enc["input_ids"], enc["attention_mask"])["logits"]


LABEL = [{"type": "string", "name": "label", "required": True}]
SCORE = [{"type": "double", "name": "score", "required": True}]


def _sequence_kind(code: Path) -> dict:
    """log_hf_model's arguments for a classifier: the sequence kind answers for it (one prediction path)."""
    return {"kind": "stages.finetune.kinds.sequence", "code_paths": tuple(code_tree(code)),
            "auto": "AutoModelForSequenceClassification"}


@pytest.fixture(scope="module")
def registered(mlflow_server, vocab_dir, tmp_path_factory):
    """Four exports (a 2-label classifier, a pair regression, the MLM, a bare encoder as an RTD discriminator is)
    logged on a stage run and registered @champion; yields (tracker, exported models by key, HF directories by
    key, logged-model URIs by key)."""
    root = tmp_path_factory.mktemp("registered")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        tracker = Lineage(root / "wd").start("test", {"preset": "debug"}, ["finetune"]).child("finetune")
        cfg = debug(vocab_size=ROWS)
        models = {"clf": _random(DebertaForSequenceClassification(cfg, num_labels=2, classifier_dropout=0.1)),
                  "sts": _random(DebertaForSequenceClassification(cfg, num_labels=1, classifier_dropout=0.0)),
                  "mlm": _random(DebertaForMaskedLM(cfg)), "enc": _random(DebertaModel(cfg))}
        dirs = {"clf": hf.save_pretrained(models["clf"], root / "clf", vocab_dir=vocab_dir, labels=LABELS,
                                          model_max_length=64),
                "sts": hf.save_pretrained(models["sts"], root / "sts", vocab_dir=vocab_dir, model_max_length=64),
                "mlm": hf.save_pretrained(models["mlm"], root / "mlm", vocab_dir=vocab_dir),
                "enc": hf.save_pretrained(models["enc"], root / "enc", vocab_dir=vocab_dir)}
        # the classifier's version carries its ONNX export too, as the finetune stage's champion does
        ids = np.array(AutoTokenizer.from_pretrained(str(dirs["clf"]))(REVIEWS, padding=True)["input_ids"])
        assert export_onnx(dirs["clf"], root / "clf-export" / "onnx", ids).startswith("model.onnx: logits within ")
        seq = _sequence_kind(root / "code")
        uris = {
            "clf": tracker.log_hf_model(dirs["clf"], task="text-classification",
                                        input_example=pd.DataFrame({"sentence1": REVIEWS[:2]}), tags={"task": "rt"},
                                        outputs=LABEL + SCORE, onnx_dir=root / "clf-export" / "onnx", **seq),
            "sts": tracker.log_hf_model(dirs["sts"], task="text-classification", input_example=PAIRS,
                                        outputs=SCORE, **seq),
            "mlm": tracker.log_hf_model(dirs["mlm"], task="fill-mask",
                                        input_example={"text": ["The president of the United [MASK] said."]}),
            "enc": tracker.log_hf_model(dirs["enc"], task="feature-extraction", input_example={"text": REVIEWS[:1]}),
        }
        for key, uri in uris.items():
            assert tracker.register_model(f"deberta-debug-{key}", model_uri=uri, alias="champion",
                                          tags={"sweep": "test"}) == "1"
        yield tracker, models, dirs, uris


@pytest.fixture(scope="module")
def second_store(vocab_dir, tmp_path_factory):
    """A second `mlflow server` (its own sqlite and artifacts) holding another classifier as deberta-debug-clf/1
    @champion, as a second team's registry or a registry recreated after a wipe does; yields (its tracking URI, the
    version's logged-model URI)."""
    from tests.conftest import MlflowServer

    root = tmp_path_factory.mktemp("second-store")
    server = MlflowServer(root)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", server.uri)
        tracker = Lineage(root / "wd").start("test", {"preset": "debug"}, ["finetune"]).child("finetune")
        model = _random(DebertaForSequenceClassification(debug(vocab_size=ROWS), num_labels=2,
                                                         classifier_dropout=0.1), seed=2)
        clf = hf.save_pretrained(model, root / "clf", vocab_dir=vocab_dir, labels=LABELS, model_max_length=64)
        uri = tracker.log_hf_model(clf, task="text-classification", outputs=LABEL + SCORE,
                                   input_example=pd.DataFrame({"sentence1": REVIEWS[:2]}),
                                   **_sequence_kind(root / "code"))
        assert tracker.register_model("deberta-debug-clf", model_uri=uri, alias="champion") == "1"
    yield server.uri, uri
    server.stop()


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
    with pytest.raises(ValueError, match=re.escape("takes ['text']")):
        tracker.log_hf_model(dirs["mlm"], task="fill-mask", input_example={"sentence1": ["x"]})
    with pytest.raises(ValueError, match="a fine-tuned model names its kind"):  # a classifier answers through its kind
        tracker.log_hf_model(dirs["clf"], task="text-classification", input_example={"sentence1": ["x"]})
    with pytest.raises(ValueError, match="needs kind, code_paths, auto and outputs together"):
        tracker.log_hf_model(dirs["clf"], task="text-classification", input_example={"sentence1": ["x"]},
                             kind="stages.finetune.kinds.sequence")
    with pytest.raises(ValueError, match="exactly one of model_uri"):
        tracker.register_model("deberta-debug-clf", "model", model_uri=uris["clf"])


def test_pyfunc_predicts_what_we_exported(mlflow_server, registered, vocab_dir, monkeypatch):
    _, models, dirs, _ = registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    tok = hf.build_tokenizer(vocab_dir, model_max_length=64)
    loaded = mlflow.pyfunc.load_model("models:/deberta-debug-clf@champion")
    assert loaded.metadata.get_input_schema().input_names() == ["sentence1"]
    got = loaded.predict(pd.DataFrame({"sentence1": REVIEWS}))
    probs = _ours(models["clf"], tok, REVIEWS).softmax(-1)
    assert list(got["label"]) == [LABELS[i] for i in probs.argmax(-1)]
    assert got["score"].tolist() == pytest.approx(probs.max(-1).values.tolist(), abs=1e-5)
    with pytest.raises(mlflow.exceptions.MlflowException, match="missing inputs.*sentence1"):
        loaded.predict(pd.DataFrame({"text": REVIEWS}))  # the signature names the columns

    sts = mlflow.pyfunc.load_model("models:/deberta-debug-sts@champion")
    assert sts.metadata.get_input_schema().input_names() == ["sentence1", "sentence2"]
    got = sts.predict(PAIRS)
    want = _ours(models["sts"], tok, PAIRS.sentence1, PAIRS.sentence2).view(-1)
    assert list(got.columns) == ["score"] and got["score"].dtype == "float64"  # regression: floats, no label
    assert got["score"].tolist() == pytest.approx(want.tolist(), abs=1e-5)  # raw, no sigmoid

    masked = ["The president of the United [MASK] said.", "It rained on [MASK]."]
    filled = mlflow.pyfunc.load_model("models:/deberta-debug-mlm@champion").predict(pd.DataFrame({"text": masked}))
    ids, probs = fill_mask_reference(models["mlm"], tok, masked)  # the registry's model is the export: our own logits
    assert [t.strip() for t in filled["token"]] == [Tokenizer.load(vocab_dir / MODEL_FILE).decode([i]).strip()
                                                   for i in ids]
    assert filled["score"].tolist() == pytest.approx(probs, abs=1e-5)

    embedded = mlflow.pyfunc.load_model("models:/deberta-debug-enc@champion").predict(pd.DataFrame({"text": REVIEWS}))
    enc = tok(REVIEWS, padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = models["enc"](enc["input_ids"], enc["attention_mask"])["last_hidden_state"][:, 0]  # (B, H)
    assert np.asarray(embedded["embedding"].tolist()) == pytest.approx(cls.numpy(), abs=1e-5)


def test_mlflow_models_serve_answers_pairs(mlflow_server, registered, vocab_dir, tmp_path):
    _, models, _, _ = registered
    served = serve_once("models:/deberta-debug-sts@champion", mlflow_server, PAIRS, tmp_path / "serve.log",
                        records=SERVING_RECORDS)
    print(f"mlflow models serve: /ping after {served.seconds_to_ping:.1f} s, first answer after "
          f"{served.seconds_to_answer:.1f} s")
    tok = hf.build_tokenizer(vocab_dir, 64)
    want = _ours(models["sts"], tok, PAIRS.sentence1, PAIRS.sentence2).view(-1)
    assert [p["score"] for p in served.predictions] == pytest.approx(want.tolist(), abs=1e-5)
    # docs/serving.md's `dataframe_records` example, sent as written there: one pair in, one raw score out
    records = pd.DataFrame(SERVING_RECORDS)
    want = _ours(models["sts"], tok, records.sentence1, records.sentence2).view(-1)
    assert [set(p) for p in served.record_predictions] == [{"score"}]
    assert [p["score"] for p in served.record_predictions] == pytest.approx(want.tolist(), abs=1e-5)


def test_serving_records_are_the_docs_example():
    """The records the serving test sends are the ones docs/serving.md shows (a user copies that line)."""
    docs = (REPO / "docs" / "serving.md").read_text()
    (payload,) = re.findall(r"-d '(\{\"dataframe_records\".*?)'", docs)
    assert json.loads(payload) == {"dataframe_records": SERVING_RECORDS}


def test_unknown_registry_version_is_one_message(mlflow_server, registered, tmp_path, monkeypatch, capsys):
    """An unknown version, alias or model, or a malformed URI: one `error:` line, exit 2, nothing downloaded (the
    entry point called in this process; tests/integration/test_pipeline_cli.py fine-tunes a version through it)."""
    from pipeline.run import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    for uri, fragment in [("models:/deberta-debug-mlm/9", "'deberta-debug-mlm' has no version 9 (versions: 1"),
                          ("models:/deberta-debug-mlm@best", "has no alias 'best' (versions: 1; aliases: champion)"),
                          ("models:/deberta-debug-nope/1", "no registered model 'deberta-debug-nope'"),
                          ("models:/deberta-debug-mlm", "expected models:/NAME/VERSION (a number) or models:/NAME@")]:
        assert main(["--pretrained", uri, "--workdir", str(tmp_path / "wd"), "--dry-run"]) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: finetune.init={uri}: ") and fragment in lines[0], err
    assert not (tmp_path / "wd" / "registry").exists()


@pytest.mark.ray
def test_batch_predictions_are_the_registered_models(mlflow_server, registered, second_store, news_subset, ray_local,
                                                     tmp_path, monkeypatch, capsys):
    """`python -m pipeline.predict` over 300 real news articles with the registered classifier (the entry point
    called in this process, on the session's Ray): every record answered, a sample equal to the registered model's
    own `pyfunc.predict`, the logged model named in the output and the version in an MLflow run, and the re-run a
    no-op. With a second store's deberta-debug-clf/1 and the same --cache, the answers are that store's model's, and
    the first store's output is not taken for them; a cached copy whose files changed is downloaded again."""
    from core.artifacts import file_digest
    from core.registry import download_model
    from pipeline.predict import build_parser, main, plan
    from pipeline.predictor import Predictor, read_rows

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    corpus, out = news_subset(300), tmp_path / "predictions"
    argv = ["models:/deberta-debug-clf@champion", "--input", str(corpus), "--output", str(out),
            "--column", "sentence1=text", "--batch-size", "64", "--actors", "1",
            "--cache", str(tmp_path / "cache")]
    assert main(argv) == 0, capsys.readouterr().err
    got = pd.read_parquet(out)  # the marker and manifest are `_` files, which Parquet readers skip
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert sorted(got["index"]) == list(range(len(texts))) and got["reason"].isna().all()
    assert set(got["model_version"]) == {registered[3]["clf"]}  # models:/<model_id>: what the model is
    sample = got.sort_values("index").iloc[::15]
    served = mlflow.pyfunc.load_model("models:/deberta-debug-clf@champion").predict(
        pd.DataFrame({"sentence1": [texts[i] for i in sample["index"]]}))
    assert list(sample["label"]) == list(served["label"])
    assert sample["score"].tolist() == pytest.approx(served["score"].tolist(), abs=1e-6)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["rows"] == manifest["answered"] == len(texts) and (out / "_SUCCESS").is_file()
    runs = mlflow.MlflowClient(mlflow_server).search_runs(
        [registered[0].experiment_id], "tags.`pipeline.stage` = 'predict'")
    assert [r.data.tags["pipeline.model_version"] for r in runs] == ["models:/deberta-debug-clf/1"]
    assert {d.dataset.source for d in runs[0].inputs.dataset_inputs} >= {json.dumps({"uri": str(corpus)}),
                                                                          json.dumps({"uri": "models:/deberta-debug-clf/1"})}
    shards = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert main(argv) == 0 and "nothing to do" in capsys.readouterr().out  # the same input and model: reused
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == shards
    # --backend onnx: onnxruntime over the version's own onnx/model.onnx (logged beside hf/), the same answers
    assert main([*argv[:4], str(tmp_path / "onnx"), *argv[5:], "--backend", "onnx"]) == 0
    assert re.search(r"onnx: \S+/artifacts/onnx/model.onnx, the version's own", capsys.readouterr().out)
    by_onnx, by_torch = pd.read_parquet(tmp_path / "onnx").sort_values("index"), got.sort_values("index")
    assert list(by_onnx["label"]) == list(by_torch["label"])
    assert by_onnx["score"].tolist() == pytest.approx(by_torch["score"].tolist(), abs=1e-5)

    other_uri, other_model = second_store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other_uri)
    capsys.readouterr()
    assert main(argv) == 2 and "holds predictions of another input or model" in capsys.readouterr().err
    job = plan(build_parser().parse_args([*argv[:4], str(tmp_path / "other"), *argv[5:]]))
    rows = next(read_rows(pa.table({"path": [str(corpus)]}), job.ref, 16))  # the actors' own calls, without Ray
    answers = Predictor(job.ref)(rows).to_pandas()
    mlflow.set_tracking_uri(other_uri)  # the env var yields to a URI another test of the session set
    served = mlflow.pyfunc.load_model("models:/deberta-debug-clf@champion").predict(
        pd.DataFrame({"sentence1": texts[:16]}))
    mlflow.set_tracking_uri(mlflow_server)
    assert list(answers["label"]) == list(served["label"])
    assert answers["score"].tolist() == pytest.approx(served["score"].tolist(), abs=1e-6)
    assert set(answers["model_version"]) == {other_model}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    first = download_model("models:/deberta-debug-clf@champion", mlflow_server, tmp_path / "cache")
    (first.hf / "model.safetensors").write_bytes(b"rewritten in place")
    capsys.readouterr()
    again = download_model("models:/deberta-debug-clf@champion", mlflow_server, tmp_path / "cache")
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cache: ")]
    assert len(said) == 1 and "model.safetensors no longer matches the digest" in said[0], said
    assert file_digest(again.hf / "model.safetensors") == file_digest(registered[2]["clf"] / "model.safetensors")
    # finetune.init=models:/NAME/VERSION's download (one per workdir) is each store's own weights too
    from core.registry import download_registered_model

    inits = {}
    for store in (other_uri, mlflow_server):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
        inits[store] = file_digest(download_registered_model("models:/deberta-debug-clf/1", tmp_path / "wd").path
                                   / "model.safetensors")
    assert inits[mlflow_server] == file_digest(registered[2]["clf"] / "model.safetensors") != inits[other_uri]


def test_batch_prediction_refusals_are_one_line(mlflow_server, registered, news_subset, tmp_path, monkeypatch,
                                                capsys):
    """What a user gets wrong stops `pipeline.predict` before Ray starts: one `error:` line, exit 2, nothing
    written."""
    from pipeline.predict import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    corpus, out = str(news_subset(300)), tmp_path / "predictions"
    base = ["--input", corpus, "--output", str(out), "--cache", str(tmp_path / "cache")]
    for argv, fragment in [
        (["models:/deberta-debug-clf@champion", *base], "no field 'sentence1' of text; the model reads ['sentence1']: "
                                                        "name the input's field with --column sentence1=FIELD"),
        (["models:/deberta-debug-clf@champion", *base, "--column", "label=text"],
         "the model does not read a column 'label'; it reads ['sentence1']"),
        ([str(registered[2]["clf"]), *base, "--column", "label=text"],  # an HF directory: its kind's columns
         "it reads ['sentence1'] (and optionally ['sentence2'])"),
        (["models:/deberta-debug-clf/7", *base], "'deberta-debug-clf' has no version 7"),
        (["models:/deberta-debug-mlm@champion", *base], "is a pretrained model (fill-mask), which answers no task"),
        (["models:/deberta-debug-clf@champion", *base[:1], str(tmp_path / "none.jsonl"), *base[2:]],
         "does not exist; check the path"),
    ]:
        assert main(argv) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]  # after MLflow's download bar
        assert [ln for ln in err if "error" in ln.lower()] == err[-1:] and err[-1].startswith("error: "), err
        assert fragment in err[-1], err
    assert not out.exists()
