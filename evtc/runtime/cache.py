"""The on-disk cache of compiled kernels.

Each entry is a directory named by the kernel's key (a SHA-256 of everything that changes the code:
the generated source, the tensor layouts, the configuration, the versions of evtc, of its code
generator and of the CuTe DSL). It holds the generated source, the PTX, the compiled host+device
object (``kernel.o``), the same linked into ``kernel.so`` (loaded with ``tvm_ffi.load_module``, no
CuTe DSL needed, see :mod:`evtc.runtime.build`) and ``manifest.json``, which
names the key and the SHA-256 of every file. An entry is used only if its manifest is complete, names
this key and every checksum matches; anything else (a crash half-way, a damaged or foreign entry) is
rebuilt, never run.

Entries are written to a temporary directory and renamed into place. A lock file per key, held with
``fcntl.flock``, makes concurrent processes build a kernel once; a lock per key in the process does
the same for threads.

Front records (``front/``) map the cheap key of a compile call (:mod:`evtc.runtime.front_key`) to
a kernel's key and its plan, so a process that compiles an epilogue again loads it without tracing.
A record is used only if its checksum holds and it names its own key, and only together with a
verified entry.

The directory: the ``cache_dir`` argument of ``evtc.compile``, else ``$EVTC_CACHE_DIR``, else
``~/.cache/evtc``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from evtc.runtime.dsl_lock import reinit_after_fork

MANIFEST = "manifest.json"
FORMAT = 2  # 2: kernels linked into a shared library, front records

_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _new_locks_after_fork() -> None:
    _THREAD_LOCKS.clear()
    _THREAD_LOCKS_GUARD._at_fork_reinit()


reinit_after_fork(_new_locks_after_fork)


def default_dir() -> Path:
    env = os.environ.get("EVTC_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    return Path("~/.cache/evtc").expanduser()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hex(name: str, length: int) -> bool:
    return len(name) == length and all(c in "0123456789abcdef" for c in name)


def _written_by_evtc(folder: Path) -> bool:
    """Whether ``folder``, at a cache directory's top, holds only what evtc writes there: entries
    (``ab/ab<64 hex>/``), front records (``front/ab/<hex>.json``), lock files, device and tuning
    records (``.lock`` and ``.json`` files) or an unfinished build (``build-XXXXXXXX``)."""
    name = folder.name
    try:
        if _hex(name, 2):
            return all(entry.is_dir() and _hex(entry.name, 64) and entry.name.startswith(name)
                       for entry in folder.iterdir())
        if name == "front":
            return all(part.is_dir() and _hex(part.name, 2)
                       and all(record.suffix in (".json", ".tmp") for record in part.iterdir())
                       for part in folder.iterdir())
        if name in ("locks", "devices", "autotune"):
            return all(path.is_dir() or path.suffix in (".json", ".lock", ".tmp")
                       for path in folder.rglob("*"))
        return name.startswith("build-") and len(name) == len("build-") + 8
    except OSError:
        return False


class DiskCache:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        # Absolute: kernels read their entries later (a variant's source), perhaps after os.chdir.
        self.root = (Path(root).expanduser() if root is not None else default_dir()).absolute()

    def entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    # ---- reading -----------------------------------------------------------------------------
    def load(self, key: str) -> dict | None:
        """The manifest of a verified entry (with ``dir``), or None when absent or invalid."""
        path = self.entry(key)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("key") != key:
            return None
        files = manifest.get("files")
        if not isinstance(files, dict) or not files:
            return None
        for name, digest in files.items():
            try:
                data = (path / name).read_bytes()
            except OSError:
                return None
            if sha256_bytes(data) != digest:
                return None
        manifest["dir"] = str(path)
        return manifest

    def discard(self, key: str) -> None:
        shutil.rmtree(self.entry(key), ignore_errors=True)

    def entries(self) -> list[dict]:
        """Every entry with a readable manifest (not checksummed: for listing), newest first, each
        with ``dir``, ``bytes`` and ``mtime`` added."""
        found = []
        for manifest_path in self.root.glob(f"??/*/{MANIFEST}"):
            try:
                manifest = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(manifest, dict) or "key" not in manifest:
                continue
            entry = manifest_path.parent
            manifest["dir"] = str(entry)
            manifest["bytes"] = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            manifest["mtime"] = manifest_path.stat().st_mtime
            found.append(manifest)
        return sorted(found, key=lambda m: m["mtime"], reverse=True)

    def clear(self) -> int:
        """Remove every entry, front record, tuned launch, lock file and unfinished build; returns
        the number of entries removed. Only folders that hold nothing but what evtc writes there are
        removed: a cache directory pointed at the user's own files (``--cache-dir .``) loses none."""
        count = len(self.entries())
        if self.root.is_dir():
            for child in self.root.iterdir():
                if child.is_dir() and _written_by_evtc(child):
                    shutil.rmtree(child, ignore_errors=True)
        return count

    # ---- front records: the cheap key of a compile call -> the kernel's entry and plan --------
    def front(self, front_key: str) -> dict | None:
        """The front record of ``front_key`` (see :mod:`evtc.runtime.front_key`), or None when it is
        absent, damaged or not this key's."""
        try:
            record = json.loads((self.root / "front" / front_key[:2] / f"{front_key}.json").read_text())
            body = record["body"]
            if record.get("format") != FORMAT or body.get("front_key") != front_key \
                    or record.get("sha256") != sha256_bytes(json.dumps(body, sort_keys=True).encode()):
                return None
            return body
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def commit_front(self, front_key: str, body: dict) -> None:
        """Write the front record of ``front_key`` (atomically; a read-only cache keeps none)."""
        body = {**body, "front_key": front_key}
        record = {"format": FORMAT, "body": body,
                  "sha256": sha256_bytes(json.dumps(body, sort_keys=True).encode())}
        target = self.root / "front" / front_key[:2] / f"{front_key}.json"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(record, sort_keys=True))
            os.replace(tmp, target)
        except OSError:
            pass

    # ---- writing -----------------------------------------------------------------------------
    def staging(self) -> Path:
        """A fresh directory on the cache's file system, to build an entry in."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="build-", dir=self.root))

    def commit(self, key: str, staged: Path, files: list[str], meta: dict) -> Path:
        """Checksum ``files`` in ``staged``, write the manifest and move the entry into place."""
        digests = {name: sha256_bytes((staged / name).read_bytes()) for name in files}
        manifest = {"format": FORMAT, "key": key, "files": digests, **meta}
        tmp = staged / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, staged / MANIFEST)
        target = self.entry(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staged, target)
        except OSError:
            if self.load(key) is None:
                # Neither ours nor another process's valid entry is there: its place cannot be
                # written (another user's folder, a corrupt entry that cannot be removed). What is
                # there is never loaded: the caller builds where it can (UnwritableCache).
                raise
            # Another process committed the same key first: theirs is as good as ours.
            shutil.rmtree(staged, ignore_errors=True)
        return target

    # ---- locking -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold the build lock of ``key``: one build per key across threads and processes."""
        with _THREAD_LOCKS_GUARD:
            tlock = _THREAD_LOCKS.setdefault(key, threading.Lock())
        with tlock:
            lock_dir = self.root / "locks"
            try:
                lock_dir.mkdir(parents=True, exist_ok=True)
                handle = open(lock_dir / f"{key}.lock", "w")  # noqa: SIM115 - closed below
            except OSError:
                yield  # a read-only cache: threads are still serialized
                return
            try:
                import fcntl

                fcntl.flock(handle, fcntl.LOCK_EX)
            except (ImportError, OSError):
                pass
            try:
                yield
            finally:
                handle.close()


__all__ = ["DiskCache", "default_dir", "sha256_bytes"]
