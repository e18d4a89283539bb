"""Nothing wrong is ever cached: checksums, input fingerprints, writer locks, value guards.

- **Checksums.** Every data file of an artifact is hashed (sha256) once, when it is
  written; its record ``{"bytes", "sha256"}`` sits in the artifact's manifest or
  ``config.json``. Readers check sizes when they open an artifact and checksums lazily,
  once per file and process (``verify_once``), so a flipped byte is refused with an
  ``IntegrityError`` naming the file, the expected and found values and the call that
  repairs it.
- **Checksummed records.** JSON records (manifests, ``config.json`` of drafts, statistics
  and training runs, evaluation manifests) are written by ``write_record`` with the sha256
  of their own canonical JSON (``record_sha256``) and read by ``read_record``, which refuses
  an edited record and one without the field.
- **Provenance.** Every artifact's key holds the content digests of its inputs
  (``content_digest`` of their file records; ``models.model_digest`` of a model's files),
  so new inputs give new keys and nothing stale is ever reused: model files -> capture
  store -> layer statistics, drafts, study records -> evaluation runs.
- **Fingerprints.** ``model_fingerprint`` names a target by its name, class, config,
  parameter shapes, weights and dtype; ``model_identity`` adds the dtype-free config and
  the model's file digest, and ``identity_mismatch`` compares two identities (in another
  dtype by the file digests), so an artifact refuses a model it was not made with.
- **One writer at a time.** ``WriterLock`` ``flock``s ``<artifact folder>/.lock`` (with a
  pid + host record for messages) while a producer writes; a second writer waits (or
  fails naming the holder's pid, host and the file). The kernel releases the lock when
  its holder dies, so a record left by a dead process or another host is overwritten.
- **Value guards.** ``int_ids``, ``require_int`` and ``require_real`` refuse bools,
  floats posing as ints, strings and non-finite numbers with the bad value named;
  ``check_fields`` applies them to every field of a stage config by its annotation, with
  per-field ranges (``Between``) and allowed values.
"""
from __future__ import annotations

import fcntl
import dataclasses
import hashlib
import json
import logging
import math
import numbers
import operator
import os
import socket
import time
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CHUNK_BYTES = 16 * 2**20
LOCK_NAME = ".lock"


class IntegrityError(ValueError):
    """A cached file is not what its record says: names the file, both values, the repair."""

    def __init__(self, path: Path | str, what: str, expected, found, repair: str):
        self.path, self.expected, self.found, self.repair = Path(path), expected, found, repair
        super().__init__(f"{path}: {what} expected {expected}, found {found}; repair: {repair}")


# ----------------------------------------------------------------------------- checksums
def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path | str) -> str:
    """sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def bytes_record(data: bytes) -> dict:
    """The record of data about to be written: {"bytes", "sha256"}."""
    return {"bytes": len(data), "sha256": sha256_bytes(data)}


def file_record(path: Path | str) -> dict:
    """The record of a written file: {"bytes", "sha256"}."""
    return {"bytes": Path(path).stat().st_size, "sha256": file_sha256(path)}


def check_size(path: Path | str, record: dict, repair: str) -> None:
    """Refuse a missing file or one whose size differs from its record (a cheap stat)."""
    path = Path(path)
    if not path.is_file():
        raise IntegrityError(path, "file", "present", "missing", repair)
    if "bytes" in record and path.stat().st_size != record["bytes"]:
        raise IntegrityError(path, "size", f"{record['bytes']} bytes",
                             f"{path.stat().st_size} bytes", repair)


def verify_file(path: Path | str, record: dict, repair: str) -> None:
    """Refuse a file whose size or sha256 differs from its record (legacy records without
    a sha256 pass after the size check)."""
    check_size(path, record, repair)
    if "sha256" in record:
        found = file_sha256(path)
        if found != record["sha256"]:
            raise IntegrityError(path, "sha256", record["sha256"], found, repair)


# (path, size, mtime_ns, sha256) of files verified by this process: hashed once, not per read.
_verified: set[tuple[str, int, int, str]] = set()


def verify_once(path: Path | str, record: dict, repair: str) -> None:
    """``verify_file``, skipped when this process already verified the unchanged file."""
    path = Path(path)
    check_size(path, record, repair)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, record.get("sha256", ""))
    if key in _verified:
        return
    verify_file(path, record, repair)
    _verified.add(key)


def read_json(path: Path | str, repair: str) -> dict:
    """A JSON record, or an IntegrityError naming the file when it is unreadable."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IntegrityError(path, "content", "valid JSON", f"{type(err).__name__}: {err}",
                             repair) from err


# ----------------------------------------------------------------------------- fingerprints
def model_fingerprint(model: torch.nn.Module) -> dict:
    """Identity of a target: name, class, config, shapes, weights (sha256, 16 hex) and dtype.

    Hashing the weights reads every parameter once (~0.3 s per GB at 1.7 GB/s).
    """
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    config.pop("name_or_path", None)
    shapes, weights = hashlib.sha256(), hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        values = tensor.detach().cpu().contiguous()
        shapes.update(f"{name}:{values.dtype}:{tuple(values.shape)};".encode())
        weights.update(values.reshape(-1).view(torch.uint8).numpy())
    config_json = json.dumps(config, sort_keys=True, default=str).encode()
    return {"name": str(getattr(model, "name_or_path", "") or ""),
            "class": type(model).__name__,
            "config_sha256": sha256_bytes(config_json)[:16],
            "shapes_sha256": shapes.hexdigest()[:16],
            "weights_sha256": weights.hexdigest()[:16],
            "dtype": str(model_dtype(model)).removeprefix("torch.")}


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (the compute dtype)."""
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    raise ValueError(f"{type(model).__name__} has no floating-point parameters")


def fingerprint_mismatch(recorded: dict, found: dict) -> list[str]:
    """'key: recorded != found' for every field both fingerprints hold and disagree on."""
    return [f"{key}: {recorded[key]!r} != {found[key]!r}" for key in sorted(recorded)
            if key in found and recorded[key] != found[key]]


# ----------------------------------------------------------------------------- values
def require_int(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int; bools, floats, strings and values below ``minimum`` refused."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.Tensor)):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    try:
        number = operator.index(value)
    except TypeError as err:  # a float or multi-element tensor
        raise ValueError(f"{name} must be an int, got {value!r}") from err
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {number}")
    return number


def int_ids(name: str, values) -> tuple[int, ...]:
    """A sequence of ints (layer or token ids) as a tuple; a bare int, None, a string or
    any bool/float element refused naming it."""
    if values is None or isinstance(values, (str, bytes, numbers.Number)) or \
            not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
    return tuple(require_int(f"{name} element", value) for value in values)


def require_real(name: str, value, low: float = -math.inf, high: float = math.inf, *,
                 low_open: bool = False, high_open: bool = False) -> float:
    """A finite real number in the interval [low, high] (open ends as flagged)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Between:
    """A numeric range for ``check_fields``: [low, high], open ends as flagged, None unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def check(self, name: str, value) -> None:
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open
                                           else value > self.high)
        if not (below or above):
            return
        if self.high is None:
            raise ValueError(f"{name} must be {'>' if self.low_open else '>='} {self.low}, "
                             f"got {value!r}")
        interval = (f"{'(' if self.low_open else '['}{'-inf' if self.low is None else self.low}, "
                    f"{self.high}{')' if self.high_open else ']'}")
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def check_fields(config, ranges: Mapping[str, Between] | None = None,
                 choices: Mapping[str, Collection] | None = None) -> None:
    """Refuse a dataclass instance whose fields do not match their annotations.

    int: an int (not a bool, a float such as 2.5 or 2.0, a string); float: a finite real
    (ints accepted); bool: True or False; str: a string; ``X | None``: None or an X;
    ``tuple[X, ...]``/``tuple[X, Y]``: a list or tuple of such elements (checked one by
    one, named ``<field> element``); dict/list: an instance. ``ranges[field]`` bounds a
    number (or every element), ``choices[field]`` lists the allowed values (of every
    element). Values are checked, never converted, so config hashes do not change.
    """
    hints = typing.get_type_hints(type(config))
    for spec in dataclasses.fields(config):
        _check_value(spec.name, getattr(config, spec.name), hints[spec.name],
                     (ranges or {}).get(spec.name), (choices or {}).get(spec.name))


def _check_value(name: str, value, annotation, between: Between | None,
                 allowed: Collection | None) -> None:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        (annotation,) = [a for a in args if a is not type(None)]  # X | None only
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            raise ValueError(f"{name} must be a sequence, got {value!r}")
        element_types = ([args[0]] * len(value) if args[-1:] == (Ellipsis,) else list(args))
        if len(element_types) != len(value):
            raise ValueError(f"{name} must hold {len(element_types)} elements, got {value!r}")
        for element, element_type in zip(value, element_types):
            _check_value(f"{name} element", element, element_type, between, allowed)
        return
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    elif annotation is int:
        require_int(name, value)
    elif annotation is float:
        require_real(name, value)
    elif not isinstance(value, origin or annotation):
        raise ValueError(f"{name} must be a {getattr(annotation, '__name__', annotation)}, "
                         f"got {value!r} ({type(value).__name__})")
    if between is not None:
        between.check(name, value)
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {sorted(allowed)}")


def require_finite_tensors(what: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse if any floating tensor holds NaN/inf, naming the first such tensor."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise FloatingPointError(f"{what}: tensor {name!r} holds NaN or inf values")


# ----------------------------------------------------------------------------- locks
def _holder(path: Path) -> dict:
    """The pid/host record in a lock file ({} while its holder is writing it, or none)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}" if holder
            else "a writer that has not recorded its pid yet")


def is_held(folder: Path | str) -> bool:
    """Whether a live process holds ``folder``'s ``WriterLock`` (the kernel's lock, probed
    with a shared non-blocking ``flock`` released at once; no lock file: not held)."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


class LockedError(RuntimeError):
    """Another live writer holds an artifact folder's lock."""


# (pid, lock path) of the locks this process holds: a nested taker would wait on itself.
_held: set[tuple[int, str]] = set()


class WriterLock:
    """Exclusive writer lock on an artifact folder: ``flock`` on ``<folder>/.lock``.

    The rule: the kernel's lock is the truth, the file's pid/host record only names the
    holder in messages. The lock file stays open (and ``flock``-ed) for the lock's
    lifetime; the kernel releases it when its process exits or is killed, so there is no
    staleness to guess and no takeover race: a record left by a dead process, a reused
    pid or another host, whose file nobody locks, is simply overwritten. A lock held by
    a live process anywhere that shares this filesystem's locks (local disks; NFS via its
    lock manager) blocks.

    ``timeout``: seconds to wait for a live holder (None: as long as it holds, logging the
    holder every minute; 0: fail at once) before ``LockedError`` names the holder's pid,
    host and the lock file. ``poll``: seconds between attempts.
    """

    def __init__(self, folder: Path | str, timeout: float | None = None, poll: float = 0.2):
        self.path = Path(folder) / LOCK_NAME
        self.timeout, self.poll = timeout, poll
        self._fd: int | None = None

    def _try_acquire(self) -> bool:
        """flock the lock file without blocking; True once this process holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # locked a file its previous holder unlinked on release: try the new one
            os.close(fd)
            return False
        previous = _holder(self.path)
        if previous:
            log.info("%s: taking the lock; the last holder (%s) no longer holds it", self.path,
                     _describe(previous))
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return True

    def __enter__(self) -> "WriterLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = (os.getpid(), str(self.path.resolve()))
        if key in _held:
            raise LockedError(f"{self.path} is already held by this process (pid "
                              f"{os.getpid()}): nested writers of one artifact")
        start, logged = time.monotonic(), -math.inf
        while not self._try_acquire():
            waited = time.monotonic() - start
            if self.timeout is not None and waited >= self.timeout:
                raise LockedError(
                    f"{self.path.parent} is being written by {_describe(_holder(self.path))} "
                    f"(lock file {self.path}); waited {waited:.1f} s. Wait for it to finish; "
                    "the lock is released when that process ends")
            if waited - logged >= 60:
                log.warning("waiting for %s, held by %s", self.path, _describe(_holder(self.path)))
                logged = waited
            time.sleep(self.poll)
        _held.add(key)
        return self

    def __exit__(self, *exc) -> None:
        # Unlink while still holding: a waiter that opened this file sees, once it gets the
        # lock, that the path is gone (or another file) and retries on the current one.
        self.path.unlink(missing_ok=True)
        _held.discard((os.getpid(), str(self.path.resolve())))
        os.close(self._fd)
        self._fd = None


# ----------------------------------------------------------------------------- JSON lines
def dump_json_lines(records) -> bytes:
    """One compact, key-sorted JSON object per line, UTF-8, newline-terminated."""
    return "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in records).encode()


def parse_json_lines(data: bytes) -> list:
    """The objects of ``dump_json_lines`` output. Split on "\n" only: ``str.splitlines``
    also breaks at U+2028, U+0085 and other separators that JSON strings hold unescaped
    (with ``ensure_ascii=False``), which cut a record in two."""
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line]


# ----------------------------------------------------------------------------- records
# JSON records (manifests, config.json of drafts and statistics, evaluation manifests) carry
# the sha256 of their own canonical JSON under this field, checked on every read.
RECORD_CHECKSUM = "record_sha256"


def canonical_json(obj) -> bytes:
    """The sorted, compact JSON bytes of ``obj`` (tuples as lists, paths as strings): what
    checksums and digests are taken of, independent of indentation on disk."""
    from actwave.config import to_jsonable
    return json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


def content_digest(obj, length: int = 16) -> str:
    """sha256 (``length`` hex) of ``obj``'s canonical JSON: the digest of an artifact is the
    digest of its file records (``{"file", "bytes", "sha256", ...}``) and its inputs' digests,
    so equal contents give equal keys and any change of content a new one."""
    return sha256_bytes(canonical_json(obj))[:length]


def record_checksum(record: dict) -> str:
    """sha256 of a record's canonical JSON without its ``RECORD_CHECKSUM`` field."""
    return sha256_bytes(canonical_json({k: v for k, v in record.items() if k != RECORD_CHECKSUM}))


def write_record(path: Path | str, record: dict) -> dict:
    """Write a JSON record atomically with its self-checksum; -> the record as written
    (plain JSON values, checksum field included)."""
    from actwave.config import atomic_write_json, to_jsonable
    plain = {k: v for k, v in to_jsonable(record).items() if k != RECORD_CHECKSUM}
    plain[RECORD_CHECKSUM] = record_checksum(plain)
    atomic_write_json(path, plain)
    return plain


def save_config_record(directory: Path | str, config, **extra) -> Path:
    """``config.json`` beside an artifact (``config.config_record``: the config, its hash,
    versions, extras) as a checksummed record; read it back with ``read_record``."""
    from actwave.config import config_record
    path = Path(directory) / "config.json"
    write_record(path, config_record(config, **extra))
    return path


def read_record(path: Path | str, repair: str) -> dict:
    """A JSON record written by ``write_record``, its self-checksum verified (the field is
    removed from the result). Unreadable JSON, a missing checksum (every record the current
    code writes has one) or a mismatch -> IntegrityError naming the file."""
    record = read_json(path, repair)
    if not isinstance(record, dict):
        raise IntegrityError(path, "content", "a JSON object", type(record).__name__, repair)
    if RECORD_CHECKSUM not in record:
        raise IntegrityError(path, RECORD_CHECKSUM, "a self-checksum field",
                             "none (not written by actwave.integrity.write_record)", repair)
    found = record_checksum(record)
    if found != record[RECORD_CHECKSUM]:
        raise IntegrityError(path, RECORD_CHECKSUM, record[RECORD_CHECKSUM], found, repair)
    return {k: v for k, v in record.items() if k != RECORD_CHECKSUM}


# ----------------------------------------------------------------------------- model identity
def model_identity(model: torch.nn.Module) -> dict:
    """``model_fingerprint`` plus what survives a change of dtype: ``arch_sha256`` (the config
    without its dtype) and ``digest`` (``models.model_digest`` of the files the model was
    loaded from, None for a model that has no readable files, e.g. one built in memory)."""
    found = model_fingerprint(model)
    config = model.config.to_dict()
    for key in ("_name_or_path", "name_or_path", "torch_dtype", "dtype"):
        config.pop(key, None)
    found["arch_sha256"] = content_digest(json.loads(json.dumps(config, default=str)))
    found["digest"] = None
    if found["name"]:
        from actwave.capture.models import model_digest
        try:
            found["digest"] = model_digest(found["name"])
        except (OSError, ValueError):  # no files behind the name
            pass
    return found


def identity_mismatch(recorded: dict, found: dict) -> list[str]:
    """How two ``model_identity`` records disagree ([] when they name the same model).

    Same dtype: class, config, shapes and weights must agree. Another dtype: weights cannot
    be compared, so both must carry file digests, which must agree (with class and
    architecture). Any two file digests must agree.
    """
    def differ(keys):
        return [f"{key}: {recorded.get(key)!r} != {found.get(key)!r}" for key in keys
                if recorded.get(key) != found.get(key)]

    problems = differ(["class"])
    digests = (recorded.get("digest"), found.get("digest"))
    if all(digests):
        problems += differ(["digest"])
    if recorded.get("dtype") == found.get("dtype"):
        problems += differ(["config_sha256", "shapes_sha256", "weights_sha256"])
    else:
        problems += differ(["arch_sha256"])
        if not all(digests):
            problems.append(f"dtype: {recorded.get('dtype')!r} != {found.get('dtype')!r} and no "
                            "file digest on both sides to compare the weights by")
    return problems


def describe_model(identity: dict | None) -> str:
    """A short name for a model identity in messages: name, weights, digest."""
    if not identity:
        return "an unrecorded model"
    name = identity.get("name") or f"an unnamed {identity.get('class', 'model')}"
    return (f"{name!s} (weights {identity.get('weights_sha256')}, {identity.get('dtype')}, "
            f"files {identity.get('digest') or 'none'})")


def require_model(recorded: dict | None, target: torch.nn.Module, made: str, passed: str,
                  missing: str, remedy: str) -> None:
    """Refuse ``target`` unless it is the model ``recorded`` (a ``model_identity``), naming
    both: "``made`` <recorded>``passed`` <found> (differences); ``remedy``"; ``missing`` is
    the message when nothing is recorded."""
    if not recorded:
        raise ValueError(missing)
    found = model_identity(target)
    problems = identity_mismatch(recorded, found)
    if problems:
        raise ValueError(f"{made} {describe_model(recorded)}{passed} {describe_model(found)} "
                         f"({'; '.join(problems)}); {remedy}")
