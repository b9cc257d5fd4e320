"""A tiny real pretrained checkpoint, for the benches and the fine-tuning tests (minutes on 2 CPUs).

A SentencePiece model trained with the vocab stage's trainer on the given real text, then a
`deberta.config.debug()` MLM trained for a few hundred plain-torch steps (the pipeline's engine) on the same
text, saved in the pretrain artifact's layout (model/ + tokenizer/).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from training.engine import OptimSpec, build
from deberta import checkpoint
from deberta.config import debug, padded_vocab_size
from deberta.model import DebertaForMaskedLM
from core.artifacts import Artifact
from core.config import VocabConfig
from core.tokenizer import MODEL_FILE, SPECIAL_FILE, Tokenizer
from stages.vocab import train_model

PIECES = 2_000
SEQ = 64


def build_tiny_pretrained(root: Path, texts: list[str], steps: int = 200, seed: int = 0) -> tuple[Artifact, Artifact]:
    """A real (tiny) pretrained artifact: SentencePiece on `texts`, then `steps` MLM steps of debug()."""
    from deberta.masking import SpanMasker

    vocab_dir, model_root = root / "vocab", root / "pretrain"
    vocab_dir.mkdir(parents=True)
    sample = root / "sample.txt"
    sample.write_text("\n".join(texts) + "\n")  # one paragraph per line, as the vocab stage writes it
    train_model(VocabConfig(vocab_size=PIECES), sample, vocab_dir, num_threads=2)
    tok = Tokenizer.load(vocab_dir / MODEL_FILE)
    (vocab_dir / SPECIAL_FILE).write_text(json.dumps(tok.special_ids))

    stream = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in tok.encode(texts)])  # packed, no framing
    body = SEQ - 2
    rows = stream[: len(stream) // body * body].reshape(-1, body)
    seqs = np.concatenate([np.full((len(rows), 1), tok.cls_id), rows, np.full((len(rows), 1), tok.sep_id)], 1)
    cfg = debug(vocab_size=padded_vocab_size(len(tok)))
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # the 2 cores are shared: one thread is faster than two contending ones
    engine = build(lambda: DebertaForMaskedLM(cfg), OptimSpec(lr=2e-3, warmup_steps=30, total_steps=steps))
    masker = SpanMasker(len(tok), tok.mask_id, tok.special_ids.values(),
                        torch.from_numpy(tok.word_start_mask()), seed=seed)
    rng = np.random.default_rng(seed)
    losses = []
    for step in range(steps):
        batch = torch.from_numpy(seqs[rng.integers(0, len(seqs), 32)])  # (32, SEQ)
        inputs, labels = masker(batch, step=step)
        loss = engine(inputs, torch.ones_like(inputs), labels=labels)["loss"]
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    if not np.mean(losses[-20:]) < np.mean(losses[:20]) - 1.0:
        raise RuntimeError(f"the tiny MLM did not learn: loss {np.mean(losses[:20]):.2f} -> {np.mean(losses[-20:]):.2f}")
    checkpoint.save(engine.module, cfg, model_root / "model")
    shutil.copytree(vocab_dir, model_root / "tokenizer")
    return Artifact("pretrain", "tiny-pretrain", model_root), Artifact("vocab", "tiny-vocab", vocab_dir)




def tiny_pretrained_dir(workdir: Path) -> Path:
    """The tiny checkpoint of the benches under `workdir`, built on first use from the rotten-tomatoes reviews and
    1,500 news articles (the pretrain artifact's layout: model/ + tokenizer/)."""
    from core.datasets import materialize_corpus
    from stages.finetune.tasks import resolve_task

    target = workdir / "tiny" / "pretrain"
    if (target / "model" / checkpoint.WEIGHTS_FILE).is_file():
        return target
    shutil.rmtree(workdir / "tiny", ignore_errors=True)
    news = materialize_corpus("news", workdir / "news")
    texts = list(resolve_task("rotten-tomatoes").train.text_a)
    texts += [json.loads(line)["text"] for line in news.read_text().splitlines()[:1500]]
    return build_tiny_pretrained(workdir / "tiny", texts)[0].path
