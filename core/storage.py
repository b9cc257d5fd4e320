"""The file-system seam: a storage location is a local path or a URI (`s3://bucket/prefix`), and every path under
it is built here, as strings, never with pathlib — `Path("s3://b/x")` collapses the `//` into `s3:/b/x`.

Credentials and endpoints come from the standard AWS environment as pyarrow reads it (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, profiles); nothing of them is kept in configs or lineage."""
from __future__ import annotations

import os
from pathlib import Path


def is_uri(location: str | Path) -> bool:
    """True for `scheme://...` locations (object stores, remote file systems); False for local paths."""
    return "://" in str(location)


def split_uri(location: str | Path) -> tuple[str, str]:
    """(scheme, the rest after `://`) of a URI, ("", the path) of a local path: `s3://b/x` -> ("s3", "b/x")."""
    scheme, sep, rest = str(location).partition("://")
    return (scheme, rest) if sep else ("", str(location))


def filesystem(location: str | Path):
    """(pyarrow filesystem, path in it) of a location: `FileSystem.from_uri` for a URI (s3://, gs://, hdfs://,
    file://), the local file system and the absolute path otherwise. The one place a location is opened."""
    import pyarrow.fs as pafs

    if is_uri(location):
        return pafs.FileSystem.from_uri(str(location))
    return pafs.LocalFileSystem(), str(Path(location).absolute())


def s3_filesystem(endpoint: str, access_key: str, secret_key: str):
    """A pyarrow S3 file system with explicit credentials and endpoint (a server's own client, e.g. the local S3
    server's: `cluster.local_s3`), rather than the AWS environment `filesystem` reads."""
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(access_key=access_key, secret_key=secret_key, endpoint_override=endpoint)


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


_STORE_FIXES = (
    (("ACCESS_DENIED", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden", "403"),
     "the credentials were refused: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"),
    (("NO_SUCH_BUCKET", "NoSuchBucket"), "the bucket does not exist: check its name, or create it"),
    (("connect", "NETWORK_CONNECTION", "curlCode", "resolve host", "timed out"),
     "the endpoint cannot be reached: check AWS_ENDPOINT_URL (or the region) and the network"),
)
"""Object-store failures a user can cause, by the words of pyarrow's error, and the fix to print."""


CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                      "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")
"""Environment variables through which the AWS client finds credentials (besides ~/.aws/credentials)."""


def credentials_missing() -> bool:
    """True when nothing tells the AWS client where credentials are: none of CREDENTIAL_SOURCES and no
    ~/.aws/credentials (an instance role is still possible, which is why this only adds a hint)."""
    return not any(os.environ.get(v) for v in CREDENTIAL_SOURCES) and not Path("~/.aws/credentials").expanduser().exists()


def store_fix(error: BaseException) -> str:
    """The fix for an object-store error a user can cause, then what the store said: its whole first line (a cut
    one loses the host name that tells a typo from a network fault)."""
    text = str(error)
    fix = next((f for words, f in _STORE_FIXES if any(w.lower() in text.lower() for w in words)),
               "check the URI, the credentials and the endpoint (AWS_* environment variables)")
    if credentials_missing():
        fix = ("no AWS credentials are set (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
               f"~/.aws/credentials), so the store was asked anonymously; set them, and {fix}")
    said = " ".join(text.split("\n")[0].split()) if text else type(error).__name__
    return f"{fix} (the store said: {said})"


def check_writable(uri: str) -> None:
    """Write and delete one small object under `uri`; OSError (pyarrow's, worded by the store) when that fails. A
    bucket that does not exist is said so: an object store answers a write into one with a generic error."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    bucket = path.strip("/").split("/", 1)[0]
    if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
        raise OSError(f"NoSuchBucket: {bucket}")
    probe = f"{path.rstrip('/')}/.write-test-{os.getpid()}"
    with fs.open_output_stream(probe, compression=None) as out:
        out.write(b"")
    fs.delete_file(probe)
