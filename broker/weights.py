"""Weight versions: a record per version (number, step, transport, byte size, checksum, and
where the bytes are) in a hash, and an announcement on a channel that wakes the receivers
(who also poll the record, so a lost announcement costs one poll).

Where the bytes of a version are, by the record's `transport`:

    redis      safetensors bytes in chunks of at most `chunk_bytes` (and under the server's
               proto-max-bulk-len), so a model of any size fits
    dir        one safetensors file in a directory every process sees (`weights.dir`),
               written to a temporary name and renamed; a receiver reads it through a
               hard link of its own (readers/), so a rotation does not pull it away
    broadcast  nowhere in Redis: the learner sends the tensors over torch.distributed
               (learner/broadcast.py); the record says where to join

The last `keep` versions' bytes are kept; older chunks and files are deleted at publish.
Checksums and file writes run in a thread, off the caller's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from broker.keys import Keys
from broker.retry import REDIS_TRANSIENT
from common.files import write_atomic

log = logging.getLogger(__name__)


REDIS_MAX_VALUE = 512 << 20  # Redis's default proto-max-bulk-len: the largest value it accepts
_INT_FIELDS = ("version", "step", "nbytes", "chunks")
_HASH_BLOCK = 16 << 20  # bytes hashed at a time
STAGING = ".publishing.safetensors"
"""The learner's file of a version before `publish` takes it: in weights.dir (renamed into place,
same filesystem) or the run directory. One name: a restarted learner overwrites what a crashed
one left."""


class WeightVersionError(RuntimeError):
    """A version's bytes are gone or do not match its checksum."""


class WeightStore:
    def __init__(self, client: aioredis.Redis, keys: Keys, keep: int = 3, chunk_bytes: int = 64 << 20,
                 directory: str | None = None):
        self.client, self.keys, self.keep = client, keys, keep
        self.chunk_bytes, self.directory = chunk_bytes, directory
        self._max_value: int | None = None

    async def max_value(self) -> int:
        """The server's proto-max-bulk-len, or Redis's default where CONFIG is not allowed."""
        if self._max_value is None:
            try:
                reply = await self.client.config_get("proto-max-bulk-len")
                self._max_value = int(next(iter(reply.values()))) if reply else REDIS_MAX_VALUE
            except ResponseError:  # managed servers often refuse or rename CONFIG
                self._max_value = REDIS_MAX_VALUE
        return self._max_value

    async def publish(self, version: int, step: int, blob: bytes | str) -> dict[str, Any]:
        """The blob transport: the bytes in Redis chunks, or a file in `directory`; then the record.
        `blob`: the bytes, or the path of a file holding them (`STAGING`), linked into `directory`
        or read into Redis a chunk at a time, and deleted once the record is out: publishing holds
        one chunk, never the version's bytes, and a call repeated after a Redis fault finds the
        file where it was."""
        from_file = isinstance(blob, str)
        nbytes = await asyncio.to_thread(os.path.getsize, blob) if from_file else len(blob)
        digest = await asyncio.to_thread(_file_sha256 if from_file else _sha256, blob)
        record = {"version": version, "step": step, "nbytes": nbytes, "sha256": digest}
        if self.directory:
            path = os.path.join(self.directory, f"v{version}.safetensors")
            await asyncio.to_thread(_link_atomic if from_file else write_atomic, path, blob)
            record.update(transport="dir", path=path)
        else:
            # A value over proto-max-bulk-len makes the server drop the connection: chunks stay under it.
            size = max(1, min(self.chunk_bytes, await self.max_value() - 1024))
            chunks = max(1, -(-nbytes // size))
            with open(blob, "rb") if from_file else contextlib.nullcontext(memoryview(blob)) as source:
                for i in range(chunks):
                    chunk = await asyncio.to_thread(source.read, size) if from_file else source[i * size:(i + 1) * size]
                    await self.client.set(self.keys.weights_chunk(version, i), chunk)
            record.update(transport="redis", chunks=chunks)
        record = await self.announce(record)
        if from_file:
            os.unlink(blob)
        return record

    async def announce(self, record: dict[str, Any]) -> dict[str, Any]:
        """Make `record` the newest version (its bytes already where it says), forget the bytes of
        versions older than the last `keep`, and wake the receivers."""
        record = {**record, "time": time.time()}
        version = record["version"]
        kept = [int(v) for v in await self.client.zrange(self.keys.weights_kept, 0, -1)]
        dropped = sorted(v for v in kept if v != version)[:max(0, len(kept) + (version not in kept) - self.keep)]
        old = [await self.latest(v) for v in dropped]
        # One slot ({run}), so one transaction on a cluster too; PUBLISH is not allowed in a
        # cluster pipeline, and the announcement only hurries pollers along, so it goes after.
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.weights_record(version), mapping=record)
            pipe.hset(self.keys.weights_latest, mapping=record)
            pipe.zadd(self.keys.weights_kept, {str(version): version})
            for v, rec in zip(dropped, old):
                pipe.zrem(self.keys.weights_kept, str(v))
                pipe.delete(self.keys.weights_record(v))
                for i in range(rec["chunks"] if rec else 0):
                    pipe.delete(self.keys.weights_chunk(v, i))
            await pipe.execute()
        if self.directory:  # by listing: files of versions Redis forgot (a restart without AOF) go too
            keep = {version, *(v for v in kept if v not in dropped)}
            await asyncio.to_thread(_prune, self.directory, keep)
        await self.client.publish(self.keys.weights_channel, str(version))
        return record

    async def latest(self, version: int | None = None) -> dict[str, Any] | None:
        """The newest version's record, or that of `version` while it is kept."""
        key = self.keys.weights_latest if version is None else self.keys.weights_record(version)
        raw = await self.client.hgetall(key)
        if not raw:
            return None
        rec: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
        for field in _INT_FIELDS:
            if field in rec:
                rec[field] = int(rec[field])
        rec["time"] = float(rec["time"])
        rec.setdefault("chunks", 0)
        return rec

    async def fetch_to(self, record: dict[str, Any], directory: str) -> str:
        """A verified safetensors file of the version, which the caller deletes when it has
        loaded it: a hard link to the shared file (dir: the learner may rotate the version out
        while the engine reads it), or a file written under `directory` from the Redis chunks."""
        version = record["version"]
        if record["transport"] == "dir":
            path = await asyncio.to_thread(_pin, record["path"])
            if path is None:
                raise WeightVersionError(f"weights of version {version} are no longer stored ({record['path']})")
            digest = await asyncio.to_thread(_file_sha256, path)
        elif record["transport"] == "redis":
            path = os.path.join(directory, f"v{version}.safetensors")
            hasher = hashlib.sha256()
            with open(path, "wb") as f:
                for i in range(record["chunks"]):
                    chunk = await self.client.get(self.keys.weights_chunk(version, i))
                    if chunk is None:
                        f.close()
                        os.unlink(path)
                        raise WeightVersionError(f"weights of version {version} are no longer stored")
                    await asyncio.to_thread(_write_and_hash, f, hasher, chunk)
            digest = hasher.hexdigest()
        else:
            raise WeightVersionError(f"weights of version {version} travel by {record['transport']}, not in a blob")
        if await asyncio.to_thread(os.path.getsize, path) != record["nbytes"] or digest != record["sha256"]:
            discard(record, path)
            raise WeightVersionError(f"weights of version {version} fail their checksum")
        return path

    async def fetch(self, record: dict[str, Any]) -> bytes:
        """The version's bytes in memory (tests and small models; receivers use `fetch_to`)."""
        with tempfile.TemporaryDirectory(prefix="omrl-weights-") as tmp:
            path = await self.fetch_to(record, tmp)
            try:
                with open(path, "rb") as f:
                    return f.read()
            finally:
                discard(record, path)


def _sha256(data: bytes) -> str:
    hasher, view = hashlib.sha256(), memoryview(data)
    for start in range(0, len(view), _HASH_BLOCK):
        hasher.update(view[start:start + _HASH_BLOCK])
    return hasher.hexdigest()


def _file_sha256(path: str) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            hasher.update(block)
    return hasher.hexdigest()


def _write_and_hash(f, hasher, chunk: bytes) -> None:
    f.write(chunk)
    hasher.update(chunk)


def _link_atomic(path: str, source: str) -> None:
    """`source`'s file under `path` too (a hard link, same filesystem), replacing what was there;
    renamed in where links are refused."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        os.link(source, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(source, tmp)
    os.replace(tmp, path)


READERS = "readers"  # weights.dir/readers: receivers' hard links to the versions they are loading
READER_LINK_KEPT_S = 3600.0  # a link this old was left by a receiver that died while loading


def discard(record: dict[str, Any], path: str) -> None:
    """Delete what `fetch_to` returned for `record` once it is loaded: the receiver's own copy
    or link, never the shared file itself (a filesystem without hard links hands that out)."""
    if path != record.get("path"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _pin(path: str) -> str | None:
    """A hard link to `path` under its directory's readers/ (same filesystem), so the bytes
    outlive the learner's rotation until the receiver has loaded them; None if the file is
    gone. Where links are refused, the file itself."""
    readers = os.path.join(os.path.dirname(path), READERS)
    link = os.path.join(readers, f"{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        os.makedirs(readers, exist_ok=True)
        os.link(path, link)
        return link
    except FileNotFoundError:
        return None
    except OSError:  # a filesystem without hard links: read it in place, and race the rotation
        return path if os.path.exists(path) else None


def _prune(directory: str, keep: set[int]) -> None:
    """Delete the version files in `directory` (one run's: weights.dir) but those of `keep`,
    and receivers' links older than READER_LINK_KEPT_S."""
    readers = os.path.join(directory, READERS)
    for name in os.listdir(readers) if os.path.isdir(readers) else ():
        with contextlib.suppress(FileNotFoundError):
            link = os.path.join(readers, name)
            if time.time() - os.stat(link).st_mtime > READER_LINK_KEPT_S:
                os.unlink(link)
    for name in os.listdir(directory):
        stem = name.removeprefix("v").removesuffix(".safetensors")
        if name.startswith("v") and name.endswith(".safetensors") and stem.isdigit() and int(stem) not in keep:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


class Announcements:
    """`wait(timeout)` returns when a version is announced, or after `timeout`: a receiver
    applies a new version as soon as it is out instead of at its next poll. Redis Cluster's
    asyncio client has no pub/sub, and a lost connection is subscribed again at the next
    wait: both fall back to waiting the timeout (the poll)."""

    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.client, self.channel = client, keys.weights_channel
        self._pubsub = None

    async def wait(self, timeout: float) -> None:
        if isinstance(self.client, RedisCluster):
            await asyncio.sleep(timeout)
            return
        try:
            if self._pubsub is None:
                self._pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(self.channel)
            await self._pubsub.get_message(timeout=timeout)
        except REDIS_TRANSIENT as exc:
            log.debug("weight announcements: %s; polling until the next wait subscribes again", exc)
            await self.close()
            await asyncio.sleep(timeout)

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                await pubsub.aclose()
            except REDIS_TRANSIENT:
                pass
