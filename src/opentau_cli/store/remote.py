"""The remote half of the storage seam (store/storage.py; docs/ARCHITECTURE.md, "Remote checkpoints"): an object
store at an `s3://bucket/prefix` URL (first-class: boto3's transfer manager, the fastest client measured, see
benchmarks/bench_remote_clients.py) or any other fsspec URL (`file://` for a mounted share, `gs://`, `az://`, ...,
where the user installs that fsspec backend). It offers the `Storage` operations with keys relative to the URL, each
retried with backoff through throttling, 5xx answers and dropped connections, plus `preflight`: one sentence on why
a URL cannot be used, in seconds.

Credentials come only from the client library's standard sources (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY,
AWS_PROFILE and ~/.aws/config / credentials, a role of the instance or pod); the options dict holds only non-secret
settings and refuses anything that looks like a credential. No message of this module holds one: errors are built
from the store's error code and our own words, never from a request or the client's configuration.

Checksums: every object `put_file` / `write_bytes` stores on S3 carries the content's full-object CRC64NVME (sent
with each part, which the store checks, and combined by the store for the whole object); `checksum(key)` reads it
back from the store (HeadObject), or reads the object back and computes it where the store kept none. `put_file`
returns the value computed here from the local file, so comparing the two proves what the store holds, not what the
uploader meant to send.
Other fsspec stores: xxh3_128 (the manifest's hash) of the local file and of the object read back.
"""

from __future__ import annotations

import base64
import os
import random
import re
import time
from pathlib import Path

from opentau_cli.errors import UserError

_PART_MB = 16  # measured: 16 MiB parts x 8 in flight match the best plain-client runs (bench_remote_clients.py)
_CONCURRENCY = 8
# About how long one operation keeps retrying through an outage before it fails (at most about twice that: the
# requests' own retries, then whole tries of the operation).
_RETRY_SECONDS = 120.0
_CHUNK = 8 << 20
_S3_OPTIONS = {"endpoint_url", "region", "profile", "addressing_style", "verify", "part_mb", "concurrency",
               "retry_seconds", "config_kwargs"}  # config_kwargs: botocore's Config (timeouts, proxies, ...)
# An option whose name has one of these is a credential, or may be: refused whatever its value.
_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|session|sas|auth|cert_pass", re.I)
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
              "TooManyRequests", "ServiceUnavailable", "InternalError"}


class RemoteError(Exception):
    """A store operation that failed after its retries: one sentence, with no credentials in it."""


class ObjectChanged(RemoteError):
    """The object is no longer the version asked for (another ETag): it was replaced since it was listed."""


def open_remote(url: str, options: dict | None = None):
    """The store at `url` (S3Remote for s3://, FsspecRemote for any other fsspec URL). Raises UserError with one
    sentence for a URL or options that cannot work (unknown scheme, no bucket, credentials among the options)."""
    options = dict(options or {})
    for name in _names(options):
        if _SECRET_NAME.search(name):
            raise UserError(f"The remote's options may not hold credentials ({name!r}): give them through the storage "
                            f"library's standard sources (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            f"AWS_PROFILE or ~/.aws/credentials, an instance or pod role), which opentau never stores.")
    scheme, sep, rest = str(url).partition("://")
    if not sep or not scheme:
        raise UserError(f"{url} is not a storage URL: write s3://BUCKET/PREFIX, file:///PATH or another fsspec URL.")
    if scheme in ("s3", "s3a"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UserError(f"{url} names no bucket: write s3://BUCKET/PREFIX.")
        unknown = sorted(set(options) - _S3_OPTIONS)
        if unknown:
            raise UserError(f"Unknown option(s) for {url}: {', '.join(unknown)} (known: {', '.join(sorted(_S3_OPTIONS))}).")
        _check_config_kwargs(url, options.get("config_kwargs", {}))
        return S3Remote(url, bucket, prefix.strip("/"), options)
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise UserError(f"{url}: unknown scheme {scheme}://; use s3://BUCKET/PREFIX, file:///PATH or another URL "
                        f"that fsspec knows (gs://, az://, ...).") from None
    except ImportError as e:
        raise UserError(f"{url}: {scheme}:// needs a package that is not installed ({_first_line(e)}).") from None
    retry = float(options.pop("retry_seconds", _RETRY_SECONDS))
    try:
        fs = cls(**options)
    except Exception as e:  # the backend's own check of its options
        raise UserError(f"{url}: the options were refused ({type(e).__name__}: {_first_line(e)}).") from None
    return FsspecRemote(url, fs, cls._strip_protocol(url).rstrip("/"), retry)


def _check_config_kwargs(url: str, given) -> None:
    """S3's `config_kwargs` are botocore Config's own arguments: a name it does not take is said here, once."""
    from botocore.config import Config

    if not isinstance(given, dict):
        raise UserError(f"The option config_kwargs for {url} takes an object of botocore Config's arguments, e.g. "
                        '{"connect_timeout": 5}.')
    unknown = sorted(set(given) - set(Config.OPTION_DEFAULTS))
    if unknown:
        raise UserError(f"Unknown config_kwargs for {url}: {', '.join(unknown)} (botocore's Config takes "
                        f"{', '.join(sorted(Config.OPTION_DEFAULTS))}).")


def _names(options: dict):
    """Every option name, those of nested dicts too (fsspec backends take `client_kwargs={...}`)."""
    for name, value in options.items():
        yield str(name)
        if isinstance(value, dict):
            yield from _names(value)


def preflight(url: str, options: dict | None = None) -> str | None:
    """One sentence on why `url` cannot be used (bad URL or options, unreachable endpoint, no or wrong credentials,
    a missing bucket), or None. Quick: one try per request with short timeouts, no retry loop."""
    try:
        return open_remote(url, options).check()
    except UserError as e:
        return str(e)


def _key(key: str, *, prefix: bool = False) -> str:
    """A key as '/'-separated parts (no '.', '..' or empty part; '' only as a listing prefix)."""
    parts = [p for p in str(key).split("/") if p]
    if any(p in (".", "..") for p in parts) or (not parts and not prefix):
        raise ValueError(f"not a storage key: {key!r}")
    return "/".join(parts)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _attempts(seconds: float) -> int:
    """Tries per request whose pauses (botocore's standard mode: on average 1, 2, 4, 8, then 10 s) add up to about
    `seconds`, at most 10."""
    attempts, total = 1, 0.0
    while attempts < 10 and total < seconds:
        total += min(10.0, 2.0 ** (attempts - 1))
        attempts += 1
    return attempts


def _backoff(attempt: int) -> float:
    return min(30.0, 0.5 * 2 ** attempt) * random.uniform(0.5, 1.0)


def crc64nvme(path: Path | None = None, data: bytes | None = None) -> str:
    """The CRC64NVME of a file's content (or of `data`), base64 as S3 writes it."""
    from awscrt import checksums

    crc = 0
    if data is not None:
        crc = checksums.crc64nvme(data)
    else:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = checksums.crc64nvme(chunk, crc)
    return base64.b64encode(crc.to_bytes(8, "big")).decode()


class S3Remote:
    """s3://bucket/prefix through boto3 (botocore's standard retries per request, ours around each operation)."""

    conditional = True  # If-None-Match / If-Match on PutObject: AWS S3, SeaweedFS (tests/test_lease.py), MinIO, R2, GCS

    def __init__(self, url: str, bucket: str, prefix: str, options: dict):
        import boto3
        import botocore.exceptions
        from boto3.s3.transfer import TransferConfig, create_transfer_manager
        from botocore.config import Config

        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self.bucket, self.prefix = bucket, prefix
        self.retry_seconds = float(options.get("retry_seconds", _RETRY_SECONDS))
        part = self.part_bytes = int(float(options.get("part_mb", _PART_MB)) * (1 << 20))
        concurrency = int(options.get("concurrency", _CONCURRENCY))
        try:
            session = boto3.session.Session(profile_name=options.get("profile"))
        except botocore.exceptions.ProfileNotFound:
            raise UserError(f"{url}: the AWS profile {options.get('profile')!r} is not in ~/.aws/config.") from None
        region = options.get("region") or session.region_name or "us-east-1"
        s3 = {"addressing_style": options["addressing_style"]} if "addressing_style" in options else {}

        given = dict(options.get("config_kwargs") or {})

        def client(**ours):
            return session.client("s3", endpoint_url=options.get("endpoint_url"), region_name=region,
                                  verify=options.get("verify"), config=Config(**ours))

        # botocore retries each request (a multipart upload then resends only the part in flight) about as long
        # as retry_seconds; _retrying repeats a whole operation that still failed, until retry_seconds are spent.
        # The user's config_kwargs go over these, except in the pre-flight's client, which stays one quick try.
        self._client = client(**{"retries": {"mode": "standard", "max_attempts": _attempts(self.retry_seconds)},
                                 "connect_timeout": 10, "read_timeout": 120, "s3": s3,
                                 "max_pool_connections": 2 * concurrency + 2, **given})
        self._quick = client(**{"s3": s3, **given, "retries": {"total_max_attempts": 1}, "connect_timeout": 3,
                                "read_timeout": 10})  # pre-flight: one try, seconds
        self.endpoint = self._client.meta.endpoint_url
        self._uploads, self._cancelled = [], False  # put_files' transfers, for cancel
        self._transfer = create_transfer_manager(self._client, TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=concurrency,
            num_download_attempts=10, preferred_transfer_client="classic"))

    def __repr__(self) -> str:
        return f"S3Remote({self.url!r}, endpoint={self.endpoint!r})"

    def _full(self, key: str) -> str:
        key = _key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    # --- the Storage operations --------------------------------------------------------------------------------
    def put_file(self, local: Path, key: str) -> str:
        """Upload (multipart, parts in parallel) with CRC64NVME checksums, which the store checks part by part and
        keeps for the whole object; returns the file's "crc64nvme:<base64>" as computed here."""
        return self.put_files([(Path(local), key)])[key]

    def put_files(self, pairs: list[tuple[Path, str]], sending=None) -> dict[str, str]:
        """put_file for several files at once, their parts sharing one pool of transfers (a checkpoint's files:
        measured faster than one after another, benchmarks/bench_remote_clients.py); {key: checksum}. The local
        CRCs are computed by a thread of their own while the files are sent (computed first, they cost up to a
        fifth of the upload's time on a busy machine). `sending(n)`: bytes sent, as the transfer threads send them
        (negative when a part is sent again)."""
        from concurrent.futures import ThreadPoolExecutor

        pending = []
        with ThreadPoolExecutor(1) as hasher:
            try:
                for local, key in pairs:
                    local = Path(local)
                    pending.append((key, local, hasher.submit(crc64nvme, local), [self._upload(local, key, sending)]))
                for key, local, _, first in pending:  # a failed file is sent again, whole, by _retrying
                    self._retrying("upload", key, lambda first=first, local=local, key=key: (
                        first.pop() if first else self._upload(local, key, sending)).result())
            except BaseException:
                for _, _, crc, first in pending:
                    crc.cancel()
                    for future in first:
                        future.cancel()
                raise
            finally:
                self._uploads.clear()
            return {key: f"crc64nvme:{crc.result()}" for key, _, crc, _ in pending}

    def _upload(self, local: Path, key: str, sending=None):
        from s3transfer.subscribers import BaseSubscriber

        class Sending(BaseSubscriber):
            def on_progress(self, future, bytes_transferred, **kwargs):
                sending(bytes_transferred)

        if self._cancelled:
            raise RemoteError(f"Upload of {self.url}/{key} was stopped (the run is ending).")
        # CRC64NVME makes a multipart upload's checksum FULL_OBJECT: the whole file's, whatever the part size.
        future = self._transfer.upload(str(local), self.bucket, self._full(key),
                                       extra_args={"ChecksumAlgorithm": "CRC64NVME"},
                                       subscribers=[Sending()] if sending is not None else None)
        self._uploads.append(future)
        return future

    def get_file(self, key: str, local: Path) -> None:
        """Download (ranged GETs in parallel) to a temporary name beside `local`, renamed when complete."""
        self.get_files([(key, Path(local))])

    def get_files(self, pairs: list[tuple[str, Path]]) -> None:
        """get_file for several keys at once, sharing one pool of transfers."""
        pending = []
        try:
            for key, local in pairs:
                Path(local).parent.mkdir(parents=True, exist_ok=True)
                pending.append((key, Path(local), [self._download(key, Path(local))]))
            for key, local, first in pending:
                self._retrying("download", key, lambda first=first, key=key, local=local: (
                    first.pop() if first else self._download(key, local)).result())
        except BaseException:
            for _, _, first in pending:
                for future in first:
                    future.cancel()
            raise

    def _download(self, key: str, local: Path):
        return self._transfer.download(self.bucket, self._full(key), str(local))

    def read_bytes(self, key: str) -> bytes:
        full = self._full(key)
        return self._retrying("read", key, lambda: self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def write_bytes(self, key: str, data: bytes) -> None:
        """One PUT: a reader sees the old object or the whole new one."""
        full, crc = self._full(key), crc64nvme(data=bytes(data))
        self._retrying("write", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data,
                                                                      ChecksumCRC64NVME=crc))

    def read_version(self, key: str) -> tuple[bytes, str, float] | None:
        """The object's content, ETag and age: the store's Date against its Last-Modified (one clock, the store's)."""
        from email.utils import parsedate_to_datetime

        full = self._full(key)

        def get():
            answer = self._client.get_object(Bucket=self.bucket, Key=full)
            data = answer["Body"].read()
            date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
            now = parsedate_to_datetime(date) if date else None
            age = max(0.0, (now - answer["LastModified"]).total_seconds()) if now else 0.0
            return data, answer["ETag"], age
        try:
            return self._retrying("read", key, get)
        except FileNotFoundError:
            return None

    def write_new(self, key: str, data: bytes) -> str | None:
        """PutObject with If-None-Match: * (created only where no object is); its ETag, or None."""
        return self._conditional_put(key, data, IfNoneMatch="*")

    def write_if(self, key: str, data: bytes, version: str) -> str | None:
        """PutObject with If-Match: VERSION (replaced only while the object is that version); its ETag, or None."""
        return self._conditional_put(key, data, IfMatch=version)

    def _conditional_put(self, key: str, data: bytes, **condition) -> str | None:
        import botocore.exceptions as bx

        full, data = self._full(key), bytes(data)

        def put():
            try:
                return self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **condition)["ETag"]
            except bx.ClientError as e:
                # 412: the condition failed; 409: a conditional write raced another (AWS asks to retry: we lost).
                if _code(e)[1] in (409, 412) or _code(e)[0] in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return None
                raise
        try:
            etag = self._retrying("write", key, put)
        except FileNotFoundError:  # If-Match on a missing object: AWS answers 404 where others answer 412
            etag = None
        if etag is None:  # a retried request whose first try was stored: the object holds exactly our content
            found = self.read_version(key)
            if found is not None and found[0] == data:
                return found[1]
        return etag

    def size(self, key: str) -> int | None:
        head = self._head(key)
        return None if head is None else head["ContentLength"]

    def exists(self, key: str) -> bool:
        return self._head(key) is not None

    def checksum(self, key: str) -> str | None:
        """"crc64nvme:<base64>" of the stored object as the store records it; where it recorded none (an object
        written by another tool), computed over the object read back. None when there is no such key."""
        head = self._head(key, ChecksumMode="ENABLED")
        if head is None:
            return None
        if head.get("ChecksumCRC64NVME") and head.get("ChecksumType") != "COMPOSITE":
            return f"crc64nvme:{head['ChecksumCRC64NVME']}"
        full = self._full(key)

        def read_back():
            from awscrt import checksums

            body, crc = self._client.get_object(Bucket=self.bucket, Key=full)["Body"], 0
            while chunk := body.read(_CHUNK):
                crc = checksums.crc64nvme(chunk, crc)
            return base64.b64encode(crc.to_bytes(8, "big")).decode()
        return f"crc64nvme:{self._retrying('read', key, read_back)}"

    def list(self, prefix: str = "") -> list[str]:
        """Every key under the folder `prefix` (recursively), relative to the URL, sorted."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{key: size} of every key under the folder `prefix`: one listing instead of a HEAD per key."""
        return {key: version["size"] for key, version in self.objects(prefix).items()}

    def objects(self, prefix: str = "") -> dict[str, dict]:
        """{key: {"size", "etag", "last_modified"}} of every key under the folder `prefix`, from one listing: what
        identifies the version of each object (a replaced object gets another ETag and time)."""
        rel = _key(prefix, prefix=True)
        base = "/".join(p for p in (self.prefix, rel) if p)
        base = f"{base}/" if base else ""
        cut = len(f"{self.prefix}/") if self.prefix else 0

        def listing():
            out = {}
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for item in page.get("Contents", []):
                    if not item["Key"].endswith("/"):  # a folder marker some tools write, not an object of ours
                        out[item["Key"][cut:]] = {"size": int(item["Size"]), "etag": item["ETag"],
                                                  "last_modified": item["LastModified"].isoformat()}
            return out
        return self._retrying("list", prefix or "/", listing)

    def version(self, key: str) -> dict | None:
        """{"size", "etag", "last_modified"} of the object as the store has it now (HeadObject); None when absent."""
        head = self._head(key)
        if head is None:
            return None
        return {"size": int(head["ContentLength"]), "etag": head["ETag"],
                "last_modified": head["LastModified"].isoformat()}

    def fetch_version(self, key: str, out, etag: str, size: int) -> dict:
        """Write the object `key` into the open binary file `out` (from its start), only as the version `etag` (S3's
        If-Match on every request: ObjectChanged when it was replaced, never a mix of two versions); large objects in
        ranged parts through the transfer pool. Returns what the store said of it ({"version_id"} when versioned)."""
        import botocore.exceptions as bx
        from s3transfer.exceptions import S3DownloadFailedError
        from s3transfer.subscribers import BaseSubscriber

        full = self._full(key)

        class Known(BaseSubscriber):  # the listing's size and ETag: no HEAD, and If-Match on every ranged GET
            def on_queued(self, future, **kwargs):
                future.meta.provide_transfer_size(size)
                future.meta.provide_object_etag(etag)

        def fetch():
            out.seek(0)
            try:
                if size >= self.part_bytes:
                    self._transfer.download(self.bucket, full, out, subscribers=[Known()]).result()
                    return {}
                answer = self._client.get_object(Bucket=self.bucket, Key=full, IfMatch=etag)
                body = answer["Body"]
                while chunk := body.read(_CHUNK):
                    out.write(chunk)
                return {"version_id": answer["VersionId"]} if answer.get("VersionId") else {}
            except S3DownloadFailedError as e:
                if "did not match expected ETag" in str(e):
                    raise ObjectChanged(f"{self.url}/{key} changed in the store (it is no longer {etag}).") from None
                raise
            except bx.ClientError as e:
                if _code(e)[0] == "PreconditionFailed":
                    raise ObjectChanged(f"{self.url}/{key} changed in the store (it is no longer {etag}).") from None
                raise
        got = self._retrying("download", key, fetch)
        out.truncate(size)
        return got

    def delete(self, keys: list[str]) -> None:
        """Delete the keys that exist (1000 per request); a key that does not exist is no error."""
        fulls = [self._full(k) for k in keys]
        for start in range(0, len(fulls), 1000):
            batch = [{"Key": k} for k in fulls[start:start + 1000]]
            answer = self._retrying("delete", keys[start], lambda: self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            if answer.get("Errors"):
                first = answer["Errors"][0]
                key = first.get("Key", "")[len(f"{self.prefix}/") if self.prefix else 0:]
                raise RemoteError(f"Deleting {self.url}/{key} failed ({first.get('Code')}: {first.get('Message')}).")

    def copy(self, src: str, dst: str) -> None:
        """A copy made by the store itself (no bytes through this machine), checksum kept."""
        source = {"Bucket": self.bucket, "Key": self._full(src)}
        full = self._full(dst)
        self._retrying("copy", src, lambda: self._transfer.copy(
            source, self.bucket, full, extra_args={"ChecksumAlgorithm": "CRC64NVME"}).result())

    def cancel(self) -> None:
        """Stop every upload in flight for good: the transfer pool's threads are ones the interpreter waits for at
        exit, and would otherwise send the rest of a queued checkpoint after the run has given up on it. A request
        under way ends first (one part); what was stored stays uncommitted. (Each transfer's own future is
        cancelled: s3transfer 0.19's TransferManager.shutdown(cancel=True) passes its arguments out of order.)"""
        self._cancelled = True
        for future in list(self._uploads):
            future.cancel()

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort the unfinished multipart uploads under `prefix` (what an interrupted upload leaves on the store,
        invisible to readers but holding space); returns how many."""
        rel = _key(prefix, prefix=True)
        base = "/".join(p for p in (self.prefix, rel) if p)
        base = f"{base}/" if base else ""

        def abort():
            count = 0
            for page in self._client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
                for upload in page.get("Uploads", []):
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                        UploadId=upload["UploadId"])
                    count += 1
            return count
        return self._retrying("abort uploads under", prefix or "/", abort)

    def check(self) -> str | None:
        """Pre-flight: the endpoint answers, the credentials are accepted and the bucket exists (one sentence or
        None; one try per request)."""
        import botocore.exceptions as bx

        try:  # one listing: its error codes say more than HeadBucket's bodiless 403 / 404
            self._quick.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except bx.NoCredentialsError:
            return (f"No credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                    f"or run where an instance or pod role provides them.")
        except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError, bx.ConnectionClosedError,
                bx.HTTPClientError) as e:
            return (f"The object store at {self.endpoint} cannot be reached ({type(e).__name__}): check "
                    f"AWS_ENDPOINT_URL (or the endpoint_url option) and the network.")
        except bx.ClientError as e:
            code, status = _code(e)
            if code in ("404", "NoSuchBucket"):
                return f"The bucket {self.bucket!r} does not exist at {self.endpoint}: create it first."
            if status in (401, 403):
                return (f"The object store at {self.endpoint} refused the credentials for {self.url} ({code}): check "
                        f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, and their rights on the bucket.")
            return f"The object store at {self.endpoint} answered {code} (HTTP {status}) for {self.url}."
        except bx.BotoCoreError as e:
            return f"{self.url} cannot be used: {type(e).__name__}: {_first_line(e)}"
        return None

    # --- internals --------------------------------------------------------------------------------------------
    def _head(self, key: str, **kw) -> dict | None:
        import botocore.exceptions as bx

        full = self._full(key)

        def head():
            try:
                return self._client.head_object(Bucket=self.bucket, Key=full, **kw)
            except bx.ClientError as e:
                if _code(e)[1] == 404:
                    return None
                raise
        return self._retrying("look up", key, head)

    def _retrying(self, what: str, key: str, fn):
        """fn(), again after a growing pause while it fails for a passing reason (a dropped connection, throttling,
        a 5xx answer, the store restarting), for up to retry_seconds; then one RemoteError. A missing key is
        FileNotFoundError; other refusals (403, ...) fail at once."""
        deadline, attempt = time.monotonic() + self.retry_seconds, 0
        while True:
            try:
                return fn()
            except ObjectChanged:
                raise
            except Exception as e:
                if _missing(e):
                    raise FileNotFoundError(f"{self.url}/{key} does not exist.") from None
                pause = _backoff(attempt)
                if not _transient(e) or time.monotonic() + pause > deadline:
                    raise RemoteError(f"{what.capitalize()} of {self.url}/{key} failed: {_describe(e)}.") from None
                time.sleep(pause)
                attempt += 1


def _code(e) -> tuple[str, int]:
    response = getattr(e, "response", None) or {}
    return (str(response.get("Error", {}).get("Code", "")),
            int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))


def _missing(e: BaseException) -> bool:
    code, status = _code(e)
    return code in ("NoSuchKey", "404", "NotFound") or status == 404 and code not in ("NoSuchBucket", "NoSuchUpload")


def _transient(e: BaseException) -> bool:
    import botocore.exceptions as bx
    from s3transfer.exceptions import RetriesExceededError

    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.ResponseStreamingError, bx.IncompleteReadError,
                      RetriesExceededError, ConnectionError, TimeoutError)):
        return True
    code, status = _code(e)
    # NoSuchUpload: the store lost a multipart upload under way (it restarted without it): send the file again.
    return status >= 500 or status == 429 or code in _THROTTLED or code == "NoSuchUpload"


def _describe(e: BaseException) -> str:
    """What went wrong, from the error's code or type: never the request, whose headers carry the signature."""
    code, status = _code(e)
    if code:
        message = (getattr(e, "response", {}).get("Error", {}).get("Message") or "").strip()
        return f"{code} (HTTP {status})" + (f": {message[:200]}" if message else "")
    return type(e).__name__


class FsspecRemote:
    """Any other fsspec URL. put_file / write_bytes are atomic for readers on a filesystem (a temporary name, then
    a rename) and on object stores (one upload); checksums are xxh3_128 read back (manifest.hash_file's).
    Conditional writes: on a local filesystem an exclusive create and a lock (store/storage.py); elsewhere fsspec
    offers no condition on a write, so they check, then write: another writer may slip in between the two
    requests (`conditional` is False; docs/ARCHITECTURE.md, "Remote checkpoints")."""

    def __init__(self, url: str, fs, root: str, retry_seconds: float = _RETRY_SECONDS):
        from fsspec.implementations.local import LocalFileSystem

        self.url, self.fs, self.root = str(url).rstrip("/"), fs, root
        self.retry_seconds = retry_seconds
        self._local = isinstance(fs, LocalFileSystem)
        self.conditional = self._local

    def read_version(self, key: str) -> tuple[bytes, str, float] | None:
        from datetime import datetime, timezone

        from opentau_cli.store.local_files import content_version, read_file_version

        if self._local:
            return read_file_version(Path(self._path(key)))
        try:
            data = self.read_bytes(key)
        except FileNotFoundError:
            return None
        when = (self.version(key) or {}).get("last_modified") or ""
        try:
            stamp = datetime.fromisoformat(when)
            stamp = stamp if stamp.tzinfo else stamp.replace(tzinfo=timezone.utc)
            age = max(0.0, (datetime.now(timezone.utc) - stamp).total_seconds())
        except ValueError:
            age = 0.0
        return data, content_version(data), age

    def write_new(self, key: str, data: bytes) -> str | None:
        from opentau_cli.store.local_files import content_version, write_file_new

        if self._local:
            return write_file_new(Path(self._path(key)), data)
        if self.exists(key):
            return None
        self.write_bytes(key, data)
        return content_version(data)

    def write_if(self, key: str, data: bytes, version: str) -> str | None:
        from opentau_cli.store.local_files import content_version, write_file_if

        if self._local:
            return write_file_if(Path(self._path(key)), data, version)
        found = self.read_version(key)
        if found is None or found[1] != version:
            return None
        self.write_bytes(key, data)
        return content_version(data)

    def __repr__(self) -> str:
        return f"FsspecRemote({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{_key(key)}"

    def _temp(self, path: str) -> str:
        head, _, name = path.rpartition("/")
        return f"{head}/.{name}.{os.getpid()}.{random.getrandbits(32):08x}.part"

    def put_file(self, local: Path, key: str) -> str:
        from opentau_cli.store.manifest import HASH_NAME, hash_file

        path = self._path(key)

        def put():
            if not self._local:
                return self.fs.put_file(str(local), path)
            self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
            tmp = self._temp(path)
            try:
                self.fs.put_file(str(local), tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        self._retrying("upload", key, put)
        return f"{HASH_NAME}:{hash_file(Path(local))}"

    def put_files(self, pairs: list[tuple[Path, str]], sending=None) -> dict[str, str]:
        return {key: self.put_file(local, key) for local, key in pairs}

    def get_files(self, pairs: list[tuple[str, Path]]) -> None:
        for key, local in pairs:
            self.get_file(key, local)

    def get_file(self, key: str, local: Path) -> None:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.part")

        def get():
            self.fs.get_file(self._path(key), str(tmp))
            os.replace(tmp, local)
        try:
            self._retrying("download", key, get)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, key: str) -> bytes:
        return self._retrying("read", key, lambda: self.fs.cat_file(self._path(key)))

    def write_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def write():
            from opentau_cli.store.local_files import synced_temp

            if not self._local:
                return self.fs.pipe_file(path, bytes(data))
            tmp = synced_temp(Path(path), bytes(data))
            try:
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        self._retrying("write", key, write)

    def size(self, key: str) -> int | None:
        try:
            info = self._retrying("look up", key, lambda: self.fs.info(self._path(key)))
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def checksum(self, key: str) -> str | None:
        import xxhash

        from opentau_cli.store.manifest import HASH_NAME

        def read_back():
            h = xxhash.xxh3_128()
            with self.fs.open(self._path(key), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            return f"{HASH_NAME}:{h.hexdigest()}"
        try:
            return self._retrying("read", key, read_back)
        except (FileNotFoundError, IsADirectoryError):
            return None

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        return {key: version["size"] for key, version in self.objects(prefix).items()}

    def objects(self, prefix: str = "") -> dict[str, dict]:
        """{key: {"size", "etag", "last_modified"}} as the backend reports them (a filesystem: its size and time)."""
        rel = _key(prefix, prefix=True)
        base = f"{self.root}/{rel}" if rel else self.root
        cut = len(self.fs._strip_protocol(self.root).rstrip("/")) + 1

        def listing():
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
            return {self.fs._strip_protocol(p)[cut:]: _version_of(i) for p, i in found.items()
                    if i.get("type") != "directory" and not p.rpartition("/")[2].endswith(".part")}
        return self._retrying("list", prefix or "/", listing)

    def version(self, key: str) -> dict | None:
        try:
            return _version_of(self._retrying("look up", key, lambda: self.fs.info(self._path(key))))
        except FileNotFoundError:
            return None

    def fetch_version(self, key: str, out, etag: str, size: int) -> dict:
        """Write the object into `out` if it is still the version `etag` (as `objects` reports it), else
        ObjectChanged; checked before and after the copy."""
        path = self._path(key)

        def same() -> None:
            if _version_of(self.fs.info(path))["etag"] != etag:
                raise ObjectChanged(f"{self.url}/{key} changed in the store (it is no longer {etag}).")

        def fetch():
            same()
            out.seek(0)
            with self.fs.open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    out.write(chunk)
            same()
            return {}
        self._retrying("download", key, fetch)
        out.truncate(size)
        return {}

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._retrying("delete", key, lambda k=key: self.fs.rm_file(self._path(k)))
            except FileNotFoundError:
                pass

    def copy(self, src: str, dst: str) -> None:
        if not self._local:
            self._retrying("copy", src, lambda: self.fs.copy(self._path(src), self._path(dst)))
            return
        path = self._path(dst)
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        tmp = self._temp(path)
        try:
            self._retrying("copy", src, lambda: self.fs.cp_file(self._path(src), tmp))
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def cancel(self) -> None:
        """Nothing to wait for: fsspec's transfers run in its daemon thread or in the caller's."""

    def check(self) -> str | None:
        try:
            self.fs.ls(self.root)
        except FileNotFoundError:
            return None  # nothing there yet: the first upload makes it
        except Exception as e:
            return f"{self.url} cannot be used: {type(e).__name__}: {_first_line(e)}"
        return None

    def _retrying(self, what: str, key: str, fn):
        deadline, attempt = time.monotonic() + self.retry_seconds, 0
        while True:
            try:
                return fn()
            except (FileNotFoundError, IsADirectoryError, ObjectChanged):
                raise
            except (ConnectionError, TimeoutError) as e:
                pause = _backoff(attempt)
                if time.monotonic() + pause > deadline:
                    raise RemoteError(f"{what.capitalize()} of {self.url}/{key} failed: {type(e).__name__}.") from None
                time.sleep(pause)
                attempt += 1


def _version_of(info: dict) -> dict:
    """An fsspec entry's size and what identifies its version: the store's ETag where it gives one, else its
    modification time with its size."""
    size = int(info.get("size") or 0)
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or info.get("updated") or ""
    when = when.isoformat() if hasattr(when, "isoformat") else str(when)
    etag = info.get("ETag") or info.get("etag") or f"{size}@{when}"
    return {"size": size, "etag": str(etag), "last_modified": when}
