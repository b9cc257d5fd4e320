"""Named corpus sources: `NAME=PATH_OR_URI[:weight=W|:epochs=E]`, as `--corpus` and `corpus.sources` take them.

The corpus section of the config (`core.config.CorpusConfig.sources`) holds them as written; this module parses and
checks them, with one ConfigError naming the source and the fix for each bad one.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from core.errors import ConfigError


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


SOURCE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
SOURCE_OPTION = re.compile(r":([A-Za-z_]+)=([^:/]*)$")
SOURCE_OPTIONS = ("weight", "epochs")
MIN_SHARE = 1e-4  # the smallest weight, as a share of all weights
MAX_SOURCES = 256  # a source's rank is the first byte of its documents' ids (stages.corpus.ingest.doc_digest)


@dataclass(frozen=True)
class CorpusSource:
    """One named source of a blended corpus, written `NAME=PATH_OR_URI[:weight=W|:epochs=E]`.

    Its share of the training tokens is set either by `weight` (every source has one: shares are the weights,
    normalised) or by `epochs` (no source has a weight: shares are in proportion to epochs x tokens, 1 pass when
    not given, the shares files have when pooled). How pretraining turns these into a read order is
    `stages.pretrain.data`'s.
    """

    name: str
    """What the source is called in the corpus artifact (the `source_name` column), the lineage and `val_loss.NAME`."""
    path: str
    """A file, directory, glob or pyarrow.fs URI, as `--corpus PATH` takes it."""
    weight: float | None = None
    """Share of the training tokens, relative to the other weights (0.5/0.5 and 1/1 blend alike); > 0."""
    epochs: float | None = None
    """Passes over the source's tokens; > 0. Never together with `weight`."""

    @staticmethod
    def is_named(text: str) -> bool:
        """Whether a `--corpus` argument names its source (`NAME=...`): the part before the first `=` is a name
        (a letter, then letters, digits, `_` or `-`; no `/` or `:`, so `s3://b/k=v` is a path) and the whole
        argument is not an existing file or directory (so a local `year=2024/` stays a path)."""
        head, sep, _ = text.partition("=")
        return bool(sep) and SOURCE_NAME.fullmatch(head) is not None and not os.path.exists(text)

    @classmethod
    def parse(cls, text: str) -> "CorpusSource":
        """`NAME=PATH_OR_URI[:weight=W|:epochs=E]` -> CorpusSource; ConfigError naming the source and the fix."""
        if not cls.is_named(text):
            raise ConfigError(f"corpus source {text!r}: expected NAME=PATH_OR_URI[:weight=W|:epochs=E], e.g. "
                              f"news=data/news.jsonl:weight=0.5 (NAME: a letter, then letters, digits, _ or -)")
        name, rest = text.split("=", 1)
        options: dict[str, float] = {}
        while (m := SOURCE_OPTION.search(rest)) is not None:
            key, value = m.group(1), m.group(2)
            _check(key in SOURCE_OPTIONS, f"corpus source {name!r}: unknown option :{key}=; a source takes "
                                          f":weight=W (share of training tokens) or :epochs=E (passes over it)")
            _check(key not in options, f"corpus source {name!r}: :{key}= given twice; give it once")
            try:
                options[key] = float(value)
            except ValueError:
                raise ConfigError(f"corpus source {name!r}: :{key}={value} is not a number; e.g. "
                                  f"{name}=PATH:{key}=0.5") from None
            rest = rest[:m.start()]
        _check(bool(rest), f"corpus source {name!r}: no path; write {name}=PATH_OR_URI[:weight=W|:epochs=E]")
        return cls(name, rest, options.get("weight"), options.get("epochs"))

    def check(self) -> None:
        if self.weight is not None and self.epochs is not None:
            raise ConfigError(f"corpus source {self.name!r}: weight={self.weight:g} and epochs={self.epochs:g} both "
                              f"given; a source's share is set by one of them: keep :weight= or :epochs=")
        for key in SOURCE_OPTIONS:
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"corpus source {self.name!r}: {key}={value:g} must be > 0; give it a positive "
                                  f"{key} or drop the source")

    def spec(self) -> str:
        """The source as written on the command line."""
        option = (f":weight={self.weight:g}" if self.weight is not None else
                  f":epochs={self.epochs:g}" if self.epochs is not None else "")
        return f"{self.name}={self.path}{option}"


def check_sources(sources: tuple[CorpusSource, ...]) -> None:
    """Each source's own rules, then across them: names unique, at most MAX_SOURCES."""
    for source in sources:
        source.check()
    seen: set[str] = set()
    for source in sources:
        _check(source.name not in seen, f"corpus source name {source.name!r} is given twice; name each source "
                                        f"once (one source may be a directory or a glob of many files)")
        seen.add(source.name)
    _check(len(sources) <= MAX_SOURCES, f"corpus.sources: {len(sources)} sources; at most {MAX_SOURCES}")
    total = sum(s.weight or 0.0 for s in sources)
    for s in sources:  # the read order keeps shares to about a millionth (stages.pretrain.data.PERIOD)
        if s.weight is not None and s.weight < MIN_SHARE * total:
            raise ConfigError(f"corpus source {s.name!r}: weight={s.weight:g} is under {MIN_SHARE:g} of the weights' "
                              f"sum {total:g}; raise it, or drop the source")
    weighted = [s.name for s in sources if s.weight is not None]
    others = [s.name for s in sources if s.weight is None]
    if weighted and others:  # a weight is a share of the whole run, epochs a number of passes: not both in one blend
        raise ConfigError(f"corpus sources {', '.join(map(repr, weighted))} have a weight and "
                          f"{', '.join(map(repr, others))} none; give every source a :weight=, or none of them "
                          f"(then each is read :epochs= times, 1 by default, in proportion)")
