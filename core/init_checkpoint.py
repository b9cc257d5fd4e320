"""A released checkpoint a stage starts from: `pretrain.init`, `pretrain.generator_init` and `finetune.init`.

Each names an HF DeBERTa-v2/v3 directory (what `save_pretrained` writes and what people download: config.json,
model.safetensors or pytorch_model.bin, and the spm.model its tokenizer was built from) or a registry version
(models:/NAME/VERSION, models:/NAME@ALIAS) whose HF export is downloaded into the workdir. All three are resolved
here, on the driver before Ray starts, by one code path: a bad one fails in a second with one message naming the
setting and the fix, and the digest resolved here is the id of the stage input it becomes.

Only the config and the tokenizer are read here; the weights are read by the stage that loads them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import storage
from core.errors import StageInputError
from core.tokenizer import MODEL_FILE

if TYPE_CHECKING:
    from deberta.config import DebertaConfig


@dataclass(frozen=True)
class ExternalCheckpoint:
    """A DeBERTa checkpoint that is not this pipeline's artifact: an HF DeBERTa-v2 directory on disk, or a registry
    version's export downloaded into the workdir."""

    path: str
    """The local HF directory the stage reads."""
    id: str
    """Its digest: of every file's (name, size, modification time) for a directory, so an edit gives a new id like
    a corpus file; of the version and its source for a registry version (which never changes)."""
    source: str
    """What the lineage names: the directory, or the registry version (models:/NAME/VERSION)."""
    key: str = "finetune.init"
    """The setting it came from, for messages."""

    def config(self) -> "DebertaConfig":
        """Our [model] section from its config.json (StageInputError naming the unsupported field)."""
        from transformers import DebertaV2Config

        from deberta import hf

        try:
            return hf.from_hf_config(DebertaV2Config.from_pretrained(self.path, local_files_only=True),
                                     source=f"{self.source}/config.json")
        except ValueError as e:
            raise StageInputError(f"{self.key}={self.source}: {e}") from None

    def tokenizer_length(self) -> int:
        """SentencePiece pieces + [MASK] (the id layout `core.tokenizer` reads)."""
        from sentencepiece import SentencePieceProcessor

        return SentencePieceProcessor(model_file=str(Path(self.path) / MODEL_FILE)).vocab_size() + 1


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _listing_digest(root: Path) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return _digest([(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in files])


def resolve_checkpoint(path: str, source: str | None = None, digest: str | None = None,
                       key: str = "finetune.init") -> ExternalCheckpoint:
    """An HF DeBERTa-v2 directory, checked as far as it can be without reading the weights: the files a stage
    reads, the architecture (`deberta.hf.from_hf_config`), and its tokenizer against the model's vocabulary.
    StageInputError naming `key` and the fix otherwise."""
    from deberta import hf

    given = source or path
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise StageInputError(f"{key}={given}: no such directory; give an HF DeBERTa-v2 directory (what "
                              f"save_pretrained writes), models:/NAME/VERSION or models:/NAME@ALIAS")
    config_file = root / "config.json"
    try:
        model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    except (ValueError, AttributeError):
        model_type = "(not a JSON object)"
    if model_type != "deberta-v2":
        found = f"config.json says model_type={model_type!r}" if config_file.is_file() else "no config.json there"
        raise StageInputError(f"{key}={given}: not a DeBERTa-v2/v3 model ({found}); point at an HF "
                              f"DebertaV2 directory (config.json with model_type 'deberta-v2', weights, spm.model)")
    if not any((root / name).is_file() for name in hf.WEIGHT_FILES):
        raise StageInputError(f"{key}={given}: no weights there (looked for {', '.join(hf.WEIGHT_FILES)}); "
                              f"point at a directory written by save_pretrained")
    if not (root / MODEL_FILE).is_file():
        has_json = (root / "tokenizer.json").is_file()
        raise StageInputError(f"{key}={given}: no {MODEL_FILE} there{' (only tokenizer.json)' if has_json else ''}; "
                              f"the pipeline tokenises with the model's SentencePiece model: copy the spm.model its "
                              f"tokenizer was built from into the directory (released DeBERTa-v2/v3 directories "
                              f"ship it)")
    ckpt = ExternalCheckpoint(str(root), digest or _listing_digest(root), given, key)
    try:  # the tokenizer check reads only the config and the tokenizer files; the weights load in the stage
        hf._check_tokenizer(hf.ImportedBackbone(ckpt.config(), {}, root))
    except ValueError as e:
        raise StageInputError(f"{key}={given}: {e}") from None
    return ckpt


def resolve_init(value: str, workdir: Path, key: str = "finetune.init") -> ExternalCheckpoint:
    """`key`=value: a directory, or a registry URI whose export is downloaded into the workdir first (on the
    driver, before Ray starts; once per version)."""
    if not value.startswith("models:/"):
        if storage.is_uri(value) or value.startswith(("runs:/", "models:")):
            raise StageInputError(f"{key}={value}: only local directories and registry URIs (models:/NAME/VERSION, "
                                  f"models:/NAME@ALIAS) are read; download the checkpoint first")
        return resolve_checkpoint(value, key=key)
    from core.registry import download_registered_model

    try:
        export = download_registered_model(value, workdir)
    except ValueError as e:
        raise StageInputError(f"{key}={value}: {e}") from None
    print(f"[{key.split('.')[0]}] {key}={value}: {export.uri} ({export.source}) in {export.path}", flush=True)
    return resolve_checkpoint(str(export.path), source=export.uri, digest=_digest((export.uri, export.source)),
                              key=key)


def model_section(ckpt: ExternalCheckpoint) -> dict[str, Any]:
    """The [model] section of an external checkpoint, from its config.json (StageInputError if unsupported)."""
    return ckpt.config().to_dict()
