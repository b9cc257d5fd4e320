"""The file-system seam: a storage location is a local path or a URI (`s3://bucket/prefix`), and every path under
it is built here, as strings, never with pathlib — `Path("s3://b/x")` collapses the `//` into `s3:/b/x`.

Credentials and endpoints come from the standard AWS environment as pyarrow reads it (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, profiles); nothing of them is kept in configs or lineage."""
from __future__ import annotations

from pathlib import Path


def is_uri(location: str | Path) -> bool:
    """True for `scheme://...` locations (object stores, remote file systems); False for local paths."""
    return "://" in str(location)


def join(base: str | Path, *parts: str) -> str:
    """`base/part/...` for a local path or a URI, keeping the URI's scheme and `//` intact."""
    if not is_uri(base):
        return str(Path(base).joinpath(*parts))
    out = str(base).rstrip("/")
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = f"{out}/{part}"
    return out
