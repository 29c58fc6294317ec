"""Checkpoint roots as users write them: a local path, or ``s3://bucket/prefix``.

Pure: parsing and naming, no I/O. :func:`parse_root` turns what a user gave
(``default_local_dir``, a command-line argument) into a :class:`Root`; any other
URL scheme, and a string that looks like a mistyped URL (``s3:/bucket``,
``s3:bucket``), is refused with an :class:`UnsupportedStoreError` rather than
taken for a local directory of that odd name.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import unquote

from obsckpt.store.errors import UnsupportedStoreError

__all__ = [
    "Root",
    "is_remote",
    "join_key",
    "joined_url_scheme",
    "local_root",
    "parse_root",
    "refuse_unsupported",
    "root_or_url",
]

LOCAL = "file"
S3 = "s3"
SUPPORTED_FORMS = "a local path (/ckpt, ./ckpt, file:///ckpt) or s3://bucket/prefix"
# ``scheme://rest``, as RFC 3986 spells a scheme.
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
# Schemes of storage URLs: ``<one of these>:`` without ``//`` is a mistyped URL, not a
# relative path (a directory named ``s3:bucket`` is never what was meant).
_KNOWN_SCHEMES = frozenset(
    {
        "s3", "s3a", "s3n", "gs", "gcs", "hdfs", "webhdfs", "viewfs", "file", "http",
        "https", "az", "abfs", "abfss", "wasb", "wasbs", "adl", "oss", "cos", "cosn",
        "obs", "r2", "ftp", "sftp", "hf", "swift", "minio",
    }
)  # fmt: skip
_MISTYPED_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(?!//)", re.DOTALL)
# S3 bucket naming rules: 3-63 characters of lowercase letters, digits, dots and
# hyphens, starting and ending with a letter or digit.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", re.ASCII)
_RESERVED_BUCKET_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
# What to say for schemes people reach for, beyond naming the supported forms.
_HINTS = {
    "gs": (
        "for Google Cloud Storage use its S3 interoperability endpoint: s3://bucket/prefix "
        "with AWS_ENDPOINT_URL=https://storage.googleapis.com and an HMAC key in "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    ),
    "s3a": "s3a:// and s3n:// are Hadoop's names for S3: write s3://bucket/prefix",
    "hdfs": "copy committed steps to HDFS with a tool of your own",
}
_HINTS["gcs"] = _HINTS["gs"]
_HINTS["s3n"] = _HINTS["s3a"]


@dataclass(frozen=True, slots=True)
class Root:
    """A parsed checkpoint root.

    Attributes:
        scheme: ``"file"`` for a local directory, ``"s3"`` for an S3 bucket.
        bucket: the S3 bucket ("" for a local root).
        prefix: the key prefix inside the bucket, without leading or trailing
            slashes ("" for the whole bucket, and for a local root).
        path: the local directory as given, relative or absolute ("" for S3).
    """

    scheme: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    @property
    def is_remote(self) -> bool:
        return self.scheme != LOCAL

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under this root's prefix: ``prefix/a/b``."""
        return join_key(self.prefix, *parts)

    def __str__(self) -> str:
        if self.scheme == LOCAL:
            return self.path
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def joined_url_scheme(value: str) -> str | None:
    """The scheme of a URL that a host joined to a local directory, or made absolute
    (``os.path.join(os.getcwd(), "s3://bucket/run")`` is ``/work/s3:/bucket/run``):
    a directory of ``value`` named ``<scheme>:``. None for an ordinary path."""
    for part in value.split("/")[1:]:  # a first part "s3:" is a mistyped URL (above)
        if part.endswith(":") and part[:-1].lower() in _KNOWN_SCHEMES:
            return part[:-1].lower()
    return None


def _refuse_joined_url(value: str, what: str) -> None:
    """Refuse a path holding a joined URL (:func:`joined_url_scheme`): taken as a path,
    it would commit into a directory named ``s3:``."""
    scheme = joined_url_scheme(value)
    if scheme is not None:
        _refuse(
            value,
            what,
            f"its directory '{scheme}:' is what is left of a URL ({scheme}://...) joined to "
            "a local directory, not a directory to create",
        )


def join_key(*parts: str) -> str:
    """``parts`` joined by single slashes, empty parts left out: ``join_key("", "a/", "b")`` is ``a/b``."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def parse_root(value: str | os.PathLike[str], *, what: str = "checkpoint root") -> Root:
    """The :class:`Root` that ``value`` names.

    A path (``str`` or ``os.PathLike``, relative or absolute) and a ``file://`` URL
    are local; ``s3://bucket/prefix`` is S3 (repeated slashes in the prefix are
    collapsed, leading and trailing ones dropped; the bucket must follow S3's
    naming rules). ``what`` names the argument in error messages.

    Raises:
        UnsupportedStoreError: another scheme (gs://, hdfs://, s3a://, http://, ...),
            a mistyped URL (``s3:/bucket``, ``s3:bucket``), a malformed bucket or
            prefix; one line naming the value and the supported forms.
        ValueError: ``value`` is empty or not a string or path.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a path or an s3:// URL, got {value!r}")
    if not value:
        raise ValueError(f"{what} is empty; give {SUPPORTED_FORMS}")
    stripped = value.strip()
    match = _URL_RE.match(stripped)
    if match is None:
        mistyped = _MISTYPED_RE.match(stripped)
        if mistyped is not None and stripped.lower().startswith("file:/") and stripped == value:
            return Root(scheme=LOCAL, path=unquote(value[len("file:") :]))  # RFC 8089's file:/path
        if mistyped is not None and mistyped.group(1).lower() in _KNOWN_SCHEMES:
            scheme = mistyped.group(1).lower()
            _refuse(value, what, f"it looks like a mistyped {scheme}:// URL")
        _refuse_joined_url(value, what)
        return Root(scheme=LOCAL, path=value)
    if stripped != value:
        _refuse(value, what, "a URL with whitespace around it")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == LOCAL:
        return Root(scheme=LOCAL, path=_file_url_path(value, rest, what))
    if scheme == S3:
        return _s3_root(value, rest, what)
    hint = _HINTS.get(scheme)
    _refuse(value, what, f"{scheme}:// is not supported" + (f"; {hint}" if hint else ""))


def is_remote(value: str | os.PathLike[str]) -> bool:
    """Whether ``value`` names a root on an object store (``s3://``), not a local path.

    Raises what :func:`parse_root` raises for a value that is neither.
    """
    return parse_root(value).is_remote


def refuse_unsupported(
    value: str | os.PathLike[str], what: str = "default_local_dir", *, allow_s3: bool = True
) -> Root:
    """``value`` parsed, for a caller that takes a root as argument ``what``.

    With ``allow_s3=False`` (a caller that writes only to local directories so far)
    an ``s3://`` root is refused too.

    Raises:
        UnsupportedStoreError: naming ``what``, the value and the forms it takes.
        ValueError: ``value`` is empty or not a string or path.
    """
    root = parse_root(value, what=what)
    if root.is_remote and not allow_s3:
        raise UnsupportedStoreError(
            f"{what}={os.fspath(value)!r}: {what} takes a local path (/ckpt, ./ckpt, "
            "file:///ckpt) only; s3:// roots are not supported there"
        )
    return root


_LOCAL_ONLY = (
    "give a local path on a filesystem every node shares (/ckpt, ./ckpt, file:///ckpt; NFS, "
    "Lustre, a shared volume) and copy committed global_step_<N> directories to object "
    "storage once an iteration file names them"
)


def local_root(value: str | os.PathLike[str], what: str = "default_local_dir") -> str:
    """``value`` as an absolute local directory, for a caller that writes to a
    filesystem (the monitor's commit, the command line's status, verify and repair).

    A URL is never taken for a relative path: ``s3://ckpt/run`` would otherwise make
    a directory named ``s3:`` in the working directory and commit there.

    Raises:
        UnsupportedStoreError: ``value`` is a URL (an ``s3://`` root included, whose
            commit these callers do not run yet) or a mistyped one; one line naming
            ``what``, the value and what to give instead.
        ValueError: ``value`` is empty or not a string or path.
    """
    try:
        root = parse_root(value, what=what)
    except UnsupportedStoreError:
        text = os.fspath(value)
        m = _URL_RE.match(text) or _MISTYPED_RE.match(text)
        scheme = m.group(1).lower() if m else ""
        if scheme == S3 and _URL_RE.match(text) is None:
            raise  # a mistyped s3:// URL: parse_root's own words say so
        raise UnsupportedStoreError(
            f"{what}={text!r}: {scheme}:// is not a filesystem path; {_LOCAL_ONLY}"
        ) from None
    if root.is_remote:
        raise UnsupportedStoreError(
            f"{what}={os.fspath(value)!r}: {what} takes a local directory, as what writes "
            "there writes files itself; s3:// roots are taken by the monitor "
            "(CheckpointMonitor.get_actor) with saves through save_state_dict_async, and by "
            f"obsckpt status/verify. Here: {_LOCAL_ONLY}"
        )
    return os.path.abspath(root.path)


def root_or_url(value: str | os.PathLike[str], what: str = "default_local_dir") -> str:
    """``value`` as a monitor keeps it: an absolute local directory, or ``s3://bucket/prefix``
    normalised (slashes collapsed) for a root on S3.

    Raises:
        UnsupportedStoreError: another scheme, or a mistyped URL (see :func:`local_root`).
        ValueError: ``value`` is empty or not a string or path.
    """
    try:
        root = parse_root(value, what=what)
    except UnsupportedStoreError:
        return local_root(value, what)  # its one line names what to give instead
    return str(root) if root.is_remote else os.path.abspath(root.path)


def _refuse(value: str, what: str, reason: str) -> NoReturn:
    raise UnsupportedStoreError(f"{what}={value!r}: {reason}; give {SUPPORTED_FORMS}")


def _file_url_path(value: str, rest: str, what: str) -> str:
    """The path of ``file:///path`` or ``file://localhost/path``."""
    host, slash, path = rest.partition("/")
    if host not in ("", "localhost") or not slash:
        _refuse(value, what, "a file:// URL names an absolute path: file:///ckpt")
    return unquote("/" + path)


def _s3_root(value: str, rest: str, what: str) -> Root:
    bucket, _, prefix = rest.partition("/")
    problem = _bucket_problem(bucket)
    if problem is not None:
        _refuse(value, what, problem)
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        _refuse(value, what, "the prefix has a '.' or '..' segment")
    if any(c in prefix for c in "\0\r\n"):
        _refuse(value, what, "the prefix has a control character")
    return Root(scheme=S3, bucket=bucket, prefix="/".join(parts))


def _bucket_problem(bucket: str) -> str | None:
    """What breaks S3's bucket naming rules in ``bucket``, or None."""
    if not bucket:
        return "no bucket: s3://bucket/prefix"
    if not _BUCKET_RE.match(bucket):
        return (
            f"bucket {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, "
            "dots and hyphens, starting and ending with a letter or digit)"
        )
    if ".." in bucket:
        return f"bucket {bucket!r} has two adjacent dots"
    if bucket.startswith(_RESERVED_BUCKET_PREFIXES):
        return f"bucket {bucket!r} starts with a prefix S3 reserves"
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        return None
    return f"bucket {bucket!r} is an IP address, not a bucket name"
