"""Checkpoint roots on S3: root parsing, the S3 client, the probe and the commit pointer.

Everything but the parsing runs against a real SeaweedFS S3 server (``tests/seaweed.py``),
reached through the standard AWS variables as a user's job would. Misbehaving servers
and lost answers are hand-made: a wrapper client that drops a condition, and botocore
event hooks that lose an answer before or after the request reached the server.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, ReadTimeoutError
from seaweed import BUCKET, SeaweedServer

from obsckpt.errors import ObsckptError, RootLockLostError
from obsckpt.store import (
    ConditionalWritesUnsupportedError,
    FencedError,
    ManifestConflictError,
    ObjectNotFoundError,
    PointerFormatError,
    PreconditionFailed,
    RootPointer,
    StoreError,
    StoreUnavailableError,
    UnsupportedStoreError,
    is_remote,
    parse_root,
    probe_conditional_writes,
    read_pointer,
    refuse_unsupported,
)
from obsckpt.store.client import Blob, ObjectInfo
from obsckpt.store.pointer import POINTER_NAME
from obsckpt.store.s3 import MIN_PART_SIZE, S3Client, S3Options

FAST = S3Options(connect_timeout_s=2.0, read_timeout_s=10.0, max_attempts=2)


class TestParseRoot:
    """A root is a local path or s3://bucket/prefix; anything else is refused in one line."""

    @pytest.mark.parametrize(
        ("value", "path"),
        [
            ("/ckpt/run", "/ckpt/run"),
            ("ckpt", "ckpt"),
            ("./a:b", "./a:b"),
            ("run:7", "run:7"),
            ("file:///ckpt/my%20run", "/ckpt/my run"),
            ("file://localhost/ckpt", "/ckpt"),
            ("file:/ckpt", "/ckpt"),
            # A colon inside a directory's name, or a name that is no scheme, is a path.
            ("/data/run:1/ckpt", "/data/run:1/ckpt"),
            ("/data/stage2:/ckpt", "/data/stage2:/ckpt"),
        ],
    )
    def test_local(self, value: str, path: str) -> None:
        root = parse_root(value)
        assert (root.scheme, root.path, root.is_remote) == ("file", path, False)
        assert not is_remote(value)

    def test_pathlike_is_local(self, tmp_path: Path) -> None:
        assert parse_root(tmp_path) == parse_root(str(tmp_path))

    @pytest.mark.parametrize(
        ("value", "bucket", "prefix", "text"),
        [
            ("s3://my-bucket", "my-bucket", "", "s3://my-bucket"),
            ("s3://my-bucket/", "my-bucket", "", "s3://my-bucket"),
            ("s3://my-bucket//runs///a/", "my-bucket", "runs/a", "s3://my-bucket/runs/a"),
            ("S3://data.lake.1/x", "data.lake.1", "x", "s3://data.lake.1/x"),
        ],
    )
    def test_s3(self, value: str, bucket: str, prefix: str, text: str) -> None:
        root = parse_root(value)
        assert (root.scheme, root.bucket, root.prefix) == ("s3", bucket, prefix)
        assert str(root) == text
        assert root.key("global_step_3", "manifest.json") == "/".join(
            p for p in (prefix, "global_step_3", "manifest.json") if p
        )
        assert is_remote(value)

    @pytest.mark.parametrize(
        ("value", "says"),
        [
            ("gs://bucket/ckpt", "AWS_ENDPOINT_URL=https://storage.googleapis.com"),
            ("hdfs://nn:8020/ckpt", "hdfs:// is not supported"),
            ("s3a://bucket/ckpt", "write s3://bucket/prefix"),
            ("http://host/ckpt", "http:// is not supported"),
            ("az://container/ckpt", "az:// is not supported"),
            ("s3:/bucket/ckpt", "mistyped s3:// URL"),
            ("s3:bucket", "mistyped s3:// URL"),
            ("gs:bucket/x", "mistyped gs:// URL"),
            ("file:ckpt", "mistyped file:// URL"),
            ("file://otherhost/ckpt", "file:///ckpt"),
            ("s3:///ckpt", "no bucket"),
            ("s3://ab/x", "not an S3 bucket name"),
            ("s3://My-Bucket/x", "not an S3 bucket name"),
            ("s3://my_bucket/x", "not an S3 bucket name"),
            ("s3://-bucket/x", "not an S3 bucket name"),
            ("s3://a..b/x", "two adjacent dots"),
            ("s3://192.168.1.1/x", "IP address"),
            ("s3://xn--bucket/x", "reserves"),
            ("s3://bucket/a/../b", "'..'"),
            (" s3://bucket/x", "whitespace"),
            # A URL a host made absolute (os.path.join(os.getcwd(), url)), as Trinity-RFT's
            # config check does with checkpoint_root_dir: never a directory named "s3:".
            ("/work/s3:/bucket/run/project/group/name", "URL (s3://...) joined to a local"),
            ("ckpt/gs:/bucket/x", "URL (gs://...) joined to a local"),
        ],
    )
    def test_refused_in_one_line(self, value: str, says: str) -> None:
        with pytest.raises(UnsupportedStoreError) as info:
            parse_root(value, what="default_local_dir")
        message = str(info.value)
        assert says in message
        assert f"default_local_dir={value!r}" in message
        assert "s3://bucket/prefix" in message
        assert "\n" not in message
        assert isinstance(info.value, ValueError) and isinstance(info.value, ObsckptError)

    def test_gcs_hint_names_hmac_keys(self) -> None:
        with pytest.raises(UnsupportedStoreError, match="HMAC"):
            parse_root("gs://bucket/ckpt")

    def test_empty_or_not_a_path(self) -> None:
        with pytest.raises(ValueError, match="empty"):
            parse_root("")
        with pytest.raises(ValueError, match="path or an s3:// URL"):
            parse_root(7)  # type: ignore[arg-type]

    def test_refuse_unsupported_names_the_argument(self) -> None:
        assert refuse_unsupported("/ckpt").path == "/ckpt"
        assert refuse_unsupported("s3://bucket/x").bucket == "bucket"
        with pytest.raises(UnsupportedStoreError, match="^default_hdfs_dir='gs://b/x'"):
            refuse_unsupported("gs://b/x", "default_hdfs_dir")
        with pytest.raises(UnsupportedStoreError, match="takes a local path"):
            refuse_unsupported("s3://bucket/x", allow_s3=False)


# --- against SeaweedFS ----------------------------------------------------------


@pytest.fixture
def aws_env(
    seaweed_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> SeaweedServer:
    """The standard AWS variables name the server; no profile or config file of the host counts."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in seaweed_server.env().items():
        monkeypatch.setenv(name, value)
    return seaweed_server


@pytest.fixture
def client(aws_env: SeaweedServer) -> S3Client:
    return S3Client(BUCKET, options=FAST)


@pytest.fixture
def prefix() -> str:
    return f"runs/{uuid.uuid4().hex[:12]}"


class LostAnswers:
    """botocore hooks that lose a PutObject's answer, on a session the test hands the client.

    ``after`` answers: the request reached the server and was applied, then the
    answer is lost (``after_error`` raised in its place). ``before`` answers: the
    request fails before it is sent. Each counts down per matching request.
    """

    def __init__(self, key_suffix: str) -> None:
        self.session = boto3.session.Session()
        self.key_suffix = key_suffix
        self.after = 0
        self.before = 0
        self.after_error: Exception = ReadTimeoutError(endpoint_url="lost answer")
        self.sent: list[dict[str, Any]] = []
        events = self.session.events
        events.register("before-parameter-build.s3.PutObject", self._mark)
        events.register("before-send.s3.PutObject", self._before_send)
        events.register("after-call.s3.PutObject", self._after_call)

    def _mark(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        if str(params.get("Key", "")).endswith(self.key_suffix) and "IfMatch" in params:
            context["obsckpt_test_cas"] = True
            self.sent.append(dict(params))

    def _before_send(self, request: Any, **_: Any) -> None:
        cas = "If-Match" in request.headers and request.url.endswith(self.key_suffix)
        if cas and self.before:
            self.before -= 1
            raise ReadTimeoutError(endpoint_url=request.url)

    def _after_call(self, context: dict[str, Any], **_: Any) -> None:
        if context.get("obsckpt_test_cas") and self.after:
            self.after -= 1
            raise self.after_error


class TestConditionalWrites:
    """SeaweedFS refuses a create-only PUT over an object and a stale If-Match with 412."""

    def test_create_only(self, client: S3Client, prefix: str) -> None:
        key = f"{prefix}/a"
        etag = client.put_create_only(key, b"one")
        assert client.head(key) == ObjectInfo(size=3, etag=etag, version=None)
        with pytest.raises(PreconditionFailed) as info:
            client.put_create_only(key, b"two")
        assert (info.value.status, info.value.code, info.value.operation) == (
            412,
            "412",
            "put_create_only",
        )
        assert client.get(key) == b"one"

    def test_if_match(self, client: S3Client, prefix: str) -> None:
        key = f"{prefix}/a"
        first = client.put(key, b"one")
        second = client.put_if_match(key, b"two", first)
        assert second != first
        with pytest.raises(PreconditionFailed):
            client.put_if_match(key, b"three", first)
        assert client.read(key) == Blob(data=b"two", info=ObjectInfo(size=3, etag=second))

    def test_missing_objects_and_ranges(self, client: S3Client, prefix: str) -> None:
        key = f"{prefix}/digits"
        assert client.head(key) is None and client.read(key) is None
        with pytest.raises(ObjectNotFoundError) as info:
            client.get(key)
        assert isinstance(info.value, FileNotFoundError) and info.value.status == 404
        client.put(key, b"0123456789")
        assert client.get(key, range=(2, 5)) == b"234"
        assert client.get(key, range=(4, 4)) == b""

    def test_list_and_delete(self, client: S3Client, prefix: str) -> None:
        keys = [f"{prefix}/d/{n}" for n in range(3)]
        for key in keys:
            client.put(key, key.encode())
        assert [o.key for o in client.list(f"{prefix}/d/")] == keys
        client.delete(keys + [f"{prefix}/d/never-there"])
        assert client.list(f"{prefix}/") == []

    def test_store_errors_pickle(self) -> None:
        err = StoreUnavailableError(
            "x", operation="get", key="k", status="timeout", maybe_applied=False
        )
        back = pickle.loads(pickle.dumps(err))
        assert (back.operation, back.key, back.code, back.maybe_applied) == (
            "get",
            "k",
            "timeout",
            False,
        )


class IgnoresCondition:
    """A store that takes conditional PUTs as plain PUTs: a misbehaving server's stand-in."""

    def __init__(self, inner: S3Client, *, if_none_match: bool, if_match: bool) -> None:
        self._inner = inner
        self._ignore_none_match = if_none_match
        self._ignore_match = if_match

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def bucket(self) -> str:
        return self._inner.bucket

    @property
    def endpoint(self) -> str:
        return self._inner.endpoint

    def put_create_only(self, key: str, data: bytes) -> str:
        if self._ignore_none_match:
            return self._inner.put(key, data)
        return self._inner.put_create_only(key, data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        if self._ignore_match:
            return self._inner.put(key, data)
        return self._inner.put_if_match(key, data, etag)


class TestProbe:
    """The probe passes where both conditions are enforced and refuses an endpoint otherwise."""

    def test_passes_on_seaweedfs_and_cleans_up(self, client: S3Client, prefix: str) -> None:
        probe_conditional_writes(client, prefix)
        assert client.list(f"{prefix}/") == []

    @pytest.mark.parametrize(
        ("ignore", "check", "says"),
        [
            ({"if_none_match": True, "if_match": False}, "if_none_match", "If-None-Match: *"),
            ({"if_none_match": False, "if_match": True}, "if_match", "stale ETag"),
        ],
    )
    def test_refuses_a_server_that_ignores_a_condition(
        self, client: S3Client, prefix: str, ignore: dict[str, bool], check: str, says: str
    ) -> None:
        with pytest.raises(ConditionalWritesUnsupportedError) as info:
            probe_conditional_writes(IgnoresCondition(client, **ignore), prefix)
        message = str(info.value)
        assert info.value.check == check and info.value.endpoint == client.endpoint
        assert client.endpoint in message and says in message and "\n" not in message
        assert client.list(f"{prefix}/") == []


def _multipart_etag(data: bytes, part_size: int) -> str:
    digests = b"".join(
        hashlib.md5(data[lo : lo + part_size]).digest() for lo in range(0, len(data), part_size)
    )
    return f'"{hashlib.md5(digests).hexdigest()}-{-(-len(data) // part_size)}"'


class TestTransfers:
    """Multipart uploads and ranged reads run their parts in parallel and round-trip the bytes."""

    def test_multipart_from_a_view_round_trips(self, client: S3Client, prefix: str) -> None:
        data = bytearray(os.urandom(2 * MIN_PART_SIZE + 12_345))
        key = f"{prefix}/weights.bin"
        etag = client.upload_file_multipart(key, memoryview(data), MIN_PART_SIZE, concurrency=3)
        assert etag == _multipart_etag(bytes(data), MIN_PART_SIZE)
        assert client.head(key) == ObjectInfo(size=len(data), etag=etag)
        back = client.get_ranged_parallel(key, len(data), 1024 * 1024, concurrency=4, etag=etag)
        assert back == data
        assert client.list_multipart_uploads(f"{prefix}/") == []

    def test_no_second_copy_of_the_whole(self, client: S3Client, prefix: str) -> None:
        """Parts are read from views of the source; a read lands in one preallocated buffer."""
        data = bytearray(os.urandom(4 * MIN_PART_SIZE))
        key = f"{prefix}/big"
        tracemalloc.start()
        try:
            client.upload_file_multipart(key, data, MIN_PART_SIZE, concurrency=4)
            uploading = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            back = client.get_ranged_parallel(key, len(data), MIN_PART_SIZE, concurrency=4)
            reading = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert back == data
        assert uploading < len(data) / 2, uploading
        assert reading < len(data) * 1.5, reading

    def test_multipart_from_a_file(self, client: S3Client, prefix: str, tmp_path: Path) -> None:
        path = tmp_path / "shard.pt"
        path.write_bytes(os.urandom(300_000))
        key = f"{prefix}/shard.pt"
        with open(path, "rb") as f:
            client.upload_file_multipart(key, f, MIN_PART_SIZE, concurrency=2)
        assert client.get(key) == path.read_bytes()
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        client.upload_file_multipart(f"{prefix}/empty", empty, MIN_PART_SIZE, concurrency=2)
        assert client.get(f"{prefix}/empty") == b""

    def test_a_failed_part_aborts_the_upload(self, aws_env: SeaweedServer, prefix: str) -> None:
        session = boto3.session.Session()

        def fail_part_two(request: Any, **_: Any) -> None:
            if "partNumber=2" in request.url:
                raise ReadTimeoutError(endpoint_url=request.url)

        session.events.register("before-send.s3.UploadPart", fail_part_two)
        client = S3Client(BUCKET, options=FAST, session=session)
        data = os.urandom(MIN_PART_SIZE + 10)
        with pytest.raises(StoreUnavailableError, match="upload_part 2"):
            client.upload_file_multipart(f"{prefix}/x", data, MIN_PART_SIZE, concurrency=2)
        assert client.list_multipart_uploads(f"{prefix}/") == []
        assert client.head(f"{prefix}/x") is None

    def test_list_and_abort_an_unfinished_upload(self, client: S3Client, prefix: str) -> None:
        raw = boto3.session.Session().client("s3")
        upload_id = raw.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/left")["UploadId"]
        found = client.list_multipart_uploads(f"{prefix}/")
        assert [(u.key, u.upload_id) for u in found] == [(f"{prefix}/left", upload_id)]
        client.abort_multipart(f"{prefix}/left", upload_id)
        assert client.list_multipart_uploads(f"{prefix}/") == []

    def test_ranged_read_of_a_replaced_object_fails(self, client: S3Client, prefix: str) -> None:
        key = f"{prefix}/x"
        old = client.put(key, b"a" * 1000)
        client.put(key, b"b" * 1000)
        with pytest.raises(PreconditionFailed):
            client.get_ranged_parallel(key, 1000, 100, concurrency=2, etag=old)


def _manifest(step: int) -> bytes:
    return f'{{"version": 1, "step": {step}, "files": []}}\n'.encode()


class TestPointer:
    """The pointer moves by compare-and-swap under the owner's epoch; a fenced owner commits nothing."""

    def test_commit_moves_pointer_then_iteration_object(
        self, client: S3Client, prefix: str
    ) -> None:
        root = RootPointer(client, prefix)
        assert read_pointer(client, prefix) is None
        lease = root.take_ownership("host-a:1")
        assert lease.epoch == 1
        written = root.commit(lease, "checkpoint", 3, _manifest(3))
        assert written == read_pointer(client, prefix)
        # A full checkpoint commits its state dict too, as on a local root.
        assert (written.checkpoint_step, written.state_dict_step, written.epoch) == (3, 3, 1)
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"3\n"
        assert client.get(f"{prefix}/latest_state_dict_iteration.txt") == b"3\n"
        assert client.get(f"{prefix}/global_step_3/manifest.json") == _manifest(3)
        root.commit(lease, "state_dict", 4, _manifest(4))
        assert client.get(f"{prefix}/latest_state_dict_iteration.txt") == b"4\n"
        assert read_pointer(client, prefix).checkpoint_step == 3  # type: ignore[union-attr]

    def test_takeover_fences_the_old_owner(self, client: S3Client, prefix: str) -> None:
        old, new = RootPointer(client, prefix), RootPointer(client, prefix)
        first = old.take_ownership("host-a:1")
        old.commit(first, "checkpoint", 1, _manifest(1))
        second = new.take_ownership("host-b:2")
        assert (second.epoch, second.pointer.checkpoint_step) == (2, 1)
        with pytest.raises(FencedError) as info:
            old.commit(first, "checkpoint", 2, _manifest(2))
        message = str(info.value)
        assert (info.value.epoch, info.value.new_epoch) == (1, 2)
        assert (
            f"s3://{BUCKET}/{prefix}" in message and "epoch 1" in message and "epoch 2" in message
        )
        assert "\n" not in message and isinstance(info.value, RootLockLostError)
        assert client.head(f"{prefix}/global_step_2/manifest.json") is None
        assert read_pointer(client, prefix).checkpoint_step == 1  # type: ignore[union-attr]
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"1\n"
        with pytest.raises(FencedError):
            old.commit(first, "checkpoint", 3, _manifest(3))
        new.commit(second, "checkpoint", 2, _manifest(2))
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"2\n"

    def test_takeover_between_manifest_and_swap_fences(self, client: S3Client, prefix: str) -> None:
        """The old owner read the pointer before the takeover: its If-Match fails, it is fenced."""
        usurper = RootPointer(client, prefix)

        class TakeoverDuringManifest(IgnoresCondition):
            def put_create_only(self, key: str, data: bytes) -> str:
                if key.endswith("global_step_2/manifest.json"):
                    usurper.take_ownership("host-b:2")
                return super().put_create_only(key, data)

        racing = TakeoverDuringManifest(client, if_none_match=False, if_match=False)
        old = RootPointer(racing, prefix)
        lease = old.take_ownership("host-a:1")
        old.commit(lease, "checkpoint", 1, _manifest(1))
        with pytest.raises(FencedError, match="fenced by epoch 2"):
            old.commit(lease, "checkpoint", 2, _manifest(2))  # taken over after its read
        pointer = read_pointer(client, prefix)
        assert pointer is not None and (pointer.epoch, pointer.checkpoint_step) == (2, 1)
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"1\n"

    def test_steps_never_go_backwards(self, client: S3Client, prefix: str) -> None:
        root = RootPointer(client, prefix)
        lease = root.take_ownership("host-a:1")
        done = root.commit(lease, "checkpoint", 5, _manifest(5))
        with pytest.raises(ValueError, match="steps must not go backwards"):
            root.commit(lease, "checkpoint", 3, _manifest(3))
        assert client.head(f"{prefix}/global_step_3/manifest.json") is None
        assert root.commit(lease, "checkpoint", 5, _manifest(5)) == done  # the same commit: no-op
        assert read_pointer(client, prefix) == done
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"5\n"

    def test_manifest_is_create_only(self, client: S3Client, prefix: str) -> None:
        root = RootPointer(client, prefix)
        lease = root.take_ownership("host-a:1")
        client.put(f"{prefix}/global_step_7/manifest.json", b'{"someone": "else"}')
        with pytest.raises(ManifestConflictError, match="already holds another manifest"):
            root.commit(lease, "checkpoint", 7, _manifest(7))
        assert read_pointer(client, prefix).checkpoint_step is None  # type: ignore[union-attr]
        client.put(f"{prefix}/global_step_8/manifest.json", _manifest(8))  # an earlier try's
        assert root.commit(lease, "checkpoint", 8, _manifest(8)).checkpoint_step == 8

    @pytest.mark.parametrize(
        "lost",
        [
            ReadTimeoutError(endpoint_url="lost answer"),
            ClientError(
                {
                    "Error": {"Code": "ConditionalRequestConflict", "Message": "conflict"},
                    "ResponseMetadata": {"HTTPStatusCode": 409},
                },
                "PutObject",
            ),
        ],
        ids=["timeout", "409"],
    )
    def test_applied_swap_with_lost_answer_is_ours(
        self, aws_env: SeaweedServer, prefix: str, lost: Exception
    ) -> None:
        hooks = LostAnswers(POINTER_NAME)
        root = RootPointer(S3Client(BUCKET, options=FAST, session=hooks.session), prefix)
        lease = root.take_ownership("host-a:1")
        hooks.after, hooks.after_error = 1, lost
        written = root.commit(lease, "checkpoint", 9, _manifest(9))
        assert hooks.after == 0 and len(hooks.sent) == 1  # settled by reading: not sent again
        assert written.checkpoint_step == 9 and lease.pointer == written
        assert root.read() == written

    def test_unapplied_swap_with_lost_answer_is_tried_again(
        self, aws_env: SeaweedServer, prefix: str
    ) -> None:
        hooks = LostAnswers(POINTER_NAME)
        client = S3Client(BUCKET, options=FAST, session=hooks.session)
        root = RootPointer(client, prefix)
        lease = root.take_ownership("host-a:1")
        hooks.before = 1
        written = root.commit(lease, "checkpoint", 4, _manifest(4))
        assert hooks.before == 0 and len(hooks.sent) == 2
        assert root.read() == written and written.checkpoint_step == 4
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"4\n"

    def test_takeover_brings_iteration_objects_up(self, client: S3Client, prefix: str) -> None:
        root = RootPointer(client, prefix)
        lease = root.take_ownership("host-a:1")
        root.commit(lease, "checkpoint", 6, _manifest(6))
        client.delete([f"{prefix}/latest_checkpointed_iteration.txt"])  # died before writing it
        RootPointer(client, prefix).take_ownership("host-b:2")
        assert client.get(f"{prefix}/latest_checkpointed_iteration.txt") == b"6\n"

    def test_a_foreign_pointer_is_refused(self, client: S3Client, prefix: str) -> None:
        client.put(f"{prefix}/{POINTER_NAME}", b"not json")
        with pytest.raises(PointerFormatError, match="is not an obsckpt pointer"):
            read_pointer(client, prefix)


class TestServerDown:
    """A stopped endpoint is one line naming it, the operation and the key; a restart recovers.

    Last in the module: it stops and restarts the session's server.
    """

    @pytest.fixture
    def restarted(self, aws_env: SeaweedServer) -> Iterator[SeaweedServer]:
        try:
            yield aws_env
        finally:
            if aws_env.process is None:
                aws_env.start()

    def test_unavailable_then_back(self, restarted: SeaweedServer, prefix: str) -> None:
        client = S3Client(BUCKET, options=FAST)
        key = f"{prefix}/kept"
        client.put(key, b"kept")
        restarted.stop()
        for call in (lambda: client.head(key), lambda: client.put_create_only(key, b"x")):
            with pytest.raises(StoreUnavailableError) as info:
                call()
            message = str(info.value)
            assert restarted.endpoint in message and f"s3://{BUCKET}/{key}" in message
            assert info.value.operation in message and "\n" not in message
            assert (info.value.code, info.value.maybe_applied) == ("connection", False)
            assert isinstance(info.value, StoreError) and isinstance(info.value, ConnectionError)
        restarted.start()
        assert client.get(key) == b"kept"
        assert client.put_create_only(f"{prefix}/new", b"new")
