"""Atomic file writes, safetensors checkpoints with checksummed JSON sidecars, folder locks, and the environment
record of a run."""

import datetime
import errno
import hashlib
import json
import math
import os
import platform
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, overload

import numpy
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

VERSION = "0.2.0"  # ntpflow's version (ntpflow.__version__), stamped on every result; pyproject.toml's matches it


class CorruptFileError(ValueError):
    """A file that exists but cannot be trusted: unreadable, truncated, or not matching its recorded checksum."""


class SimulatedKill(BaseException):
    """Raised at a :func:`fault_point` named by ``NTPFLOW_FAULT`` (tests): not an Exception, so no handler of
    ordinary errors catches it, as none would catch a real kill."""


def fault_point(name: str) -> None:
    """A named point where tests inject a crash: the environment variable ``NTPFLOW_FAULT`` (read at each call)
    equal to ``name`` raises :class:`SimulatedKill`; ``name:kill`` sends this process SIGKILL; ``name:hang`` stops it
    there until it is killed. A no-op otherwise."""
    want = os.environ.get("NTPFLOW_FAULT")
    if want == name:
        raise SimulatedKill(f"simulated kill at {name}")
    if want == f"{name}:kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while want == f"{name}:hang":
        signal.pause()


def _open_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, created with mode 0o666 so that the umask applies as to any new file
    (``tempfile.mkstemp`` would make it 0o600)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"cannot create a temporary file beside {path}")


def fsync_dir(folder: str | Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder (flushed with ``fsync``) and
    ``os.replace``: readers see the old file or the new one, never a part. The new file's mode follows the umask."""
    path = Path(path)
    try:
        fd, tmp = _open_temp(path)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:  # disk full, permissions, ...: the old file (if any) is untouched
        Path(tmp).unlink(missing_ok=True)
        raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    """Write ``obj`` to ``path`` as indented, key-sorted JSON, atomically."""
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: str | Path):
    """Parse the JSON file ``path``; missing -> FileNotFoundError, corrupted -> ValueError (one line each)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"missing file {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupted JSON in {path}: {e}") from None


def json_safe(obj):
    """``obj`` with every non-finite float (NaN, ±inf) replaced by None, recursively: standard JSON (``null``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def sidecar(path: str | Path) -> Path:
    """The JSON sidecar of a tensor file: ``x.safetensors`` -> ``x.json``."""
    return Path(path).with_suffix(".json")


class InFolder:
    """A file's name inside a folder object's ``dir``, declared once: ``config_path = InFolder("config.json")``
    makes ``obj.config_path`` the path ``obj.dir / "config.json"``."""

    def __init__(self, name: str):
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> "InFolder": ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Path: ...
    def __get__(self, obj: Any, owner: type | None = None) -> "InFolder | Path":
        return self if obj is None else Path(obj.dir) / self.name


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> str:
    """Save tensors to ``path`` (safetensors) atomically (fsync, then rename), and ``meta`` plus the file's SHA-256
    (``"sha256"``) to its ``.json`` sidecar if given; returns that SHA-256 (hex).

    The sidecar is written last, so a checkpoint counts as complete only when its sidecar exists; its checksum is
    verified by :func:`load_tensors`.
    """
    path = Path(path)
    data = save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    atomic_write(path, data)
    digest = hashlib.sha256(data).hexdigest()
    if meta is not None:
        fault_point("save_tensors:before_sidecar")
        write_json(sidecar(path), {**meta, "sha256": digest})
    return digest


def load_tensors(path: str | Path, device: str | torch.device = "cpu", sha256: str | None = None
                 ) -> dict[str, torch.Tensor]:
    """Load a safetensors file, checked against ``sha256`` if given, else the SHA-256 its sidecar records (if any).
    A missing file raises FileNotFoundError; a truncated, unreadable or altered one :class:`CorruptFileError` (one
    line each)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"missing checkpoint {path}") from None
    except OSError as e:
        raise CorruptFileError(f"cannot read checkpoint {path}: {e.strerror or e}") from None
    side = sidecar(path)
    want = sha256
    if want is None:
        try:
            meta = read_json(side) if side.exists() else {}
        except ValueError as e:
            raise CorruptFileError(str(e)) from None
        want = meta.get("sha256") if isinstance(meta, dict) else None
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        where = f"the checksum in {side}" if sha256 is None else "the checksum recorded for it"
        raise CorruptFileError(f"corrupted checkpoint {path}: its contents do not match {where}")
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # safetensors raises its own error types
        raise CorruptFileError(f"corrupted checkpoint {path}: {e}") from None
    return {k: v.to(device) for k, v in tensors.items()} if str(device) != "cpu" else tensors


def environment() -> dict:
    """Package versions, platform, device and git commit of the ntpflow source tree."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "git_commit": None,
        "git_dirty": None,
    }
    env["ntpflow"] = VERSION
    env["git_commit"], env["git_dirty"] = git_state()
    return env


def git_state() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the git checkout holding ntpflow's source: the HEAD commit and whether tracked files
    differ from it; ``(None, None)`` outside a git checkout (an installed package) or without git."""
    src = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip())
    except Exception:  # no git, not a checkout, a timeout: unknown
        return None, None
    return commit, dirty


def command_line(argv: list[str] | None = None) -> str:
    """The command that runs this process, as one could type it again: ``argv`` (default ``sys.argv``) quoted for a
    shell, with ntpflow's own entry points named as they are called (``ntpflow ...``, ``python -m
    ntpflow.experiments.toy_report ...``)."""
    argv = list(sys.argv if argv is None else argv) or [""]
    first = Path(argv[0])
    pkg = Path(__file__).resolve().parent
    if first.name == "ntpflow" or first.name == "__main__.py" and first.resolve().parent == pkg:
        return shlex.join(["ntpflow", *argv[1:]])
    if first.suffix == ".py" and first.resolve().is_relative_to(pkg):
        module = ".".join(("ntpflow", *first.resolve().relative_to(pkg).with_suffix("").parts))
        return shlex.join(["python", "-m", module, *argv[1:]])
    return shlex.join(argv)


def stamp(argv: list[str] | None = None) -> dict:
    """Who made a result, for every summary.json and report: ``ntpflow`` (version), ``git_commit`` ("unknown"
    outside a git checkout), ``git_dirty`` (tracked files changed; None when unknown), ``date`` (UTC, ISO 8601) and
    ``command`` (:func:`command_line` of ``argv``). A re-rendered report reuses the stamp stored with its numbers."""
    commit, dirty = git_state()
    return {"ntpflow": VERSION, "git_commit": commit or "unknown", "git_dirty": dirty,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command_line(argv)}


def stamp_text(s: dict) -> str:
    """One line for a report: ``Made by ntpflow 0.2.0 (commit 1a2b3c4d5e6f, with uncommitted changes) on
    2025-01-01T00:00:00Z: `ntpflow reproduce toy --scale small`.``, then the stamp's ``note`` (how the result was
    made, where one command does not say it all) if it has one."""
    commit = s.get("git_commit") or "unknown"
    where = f"commit {commit[:12]}" + (", with uncommitted changes" if s.get("git_dirty") else "")
    note = f" Note: {s['note']}" if s.get("note") else ""
    return f"Made by ntpflow {s.get('ntpflow')} ({where}) on {s.get('date')}: `{s.get('command')}`.{note}"


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; any other string is passed to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: CUDA is not available to this torch ({torch.__version__}); "
                             "use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device {spec!r}: MPS is not available")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N")
    return dev


def ensure_writable_dir(path: str | Path) -> Path:
    """Create ``path`` if needed and check that files can be written there (one-line error otherwise)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-test.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise PermissionError(f"cannot write to {path}: {e.strerror or e}") from None
    return path


class DirLock:
    """An exclusive lock on a folder, so that two processes never write the same run directory.

    The lock is ``FOLDER/.lock``, naming its owner (host, pid), and held with ``flock``. A new lock file is written
    aside and linked into place, so it names its owner from the start (one atomic step). The kernel releases a
    ``flock`` when its process dies, so a lock left by a dead process on this host (or an empty one, as older versions
    could leave) is taken over by the next run, atomically: ``flock`` admits one process. A lock naming another host
    cannot be checked from here: it is refused, with the message to rerun with ``force=True`` (``--force-unlock``)
    once that process is known to be gone.

    Use as ``with DirLock(run_dir): ...``; a held lock raises RuntimeError naming its owner and how to release it.
    """

    def __init__(self, folder: str | Path, force: bool = False):
        self.path = Path(folder) / ".lock"
        self.force = force
        self._fd: int | None = None

    def __enter__(self) -> "DirLock":
        for _ in range(10):
            try:
                fd = self._open()
            except FileNotFoundError:  # removed by its owner between our link and open: try again
                continue
            try:
                if self._acquire(fd):
                    self._fd = fd
                    return self
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # released and removed by its owner meanwhile: lock the new file instead
        raise RuntimeError(f"could not lock {self.path.parent}")

    def _open(self) -> int:
        """Open the lock file; a new one is created already naming its owner (written aside, then linked into
        place), so no process ever sees an empty lock."""
        try:
            return os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            pass
        fd, tmp = _open_temp(self.path)
        try:
            os.write(fd, _owner_bytes())
            os.fsync(fd)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                pass  # another process created it first: compete for its flock
        finally:
            os.close(fd)
            os.unlink(tmp)
        return os.open(self.path, os.O_RDWR)

    def _acquire(self, fd: int) -> bool:
        if not _flock(fd):
            raise RuntimeError(f"{self.path.parent} is in use by another process ({_describe(_read_owner(fd))}); "
                               "concurrent runs must use different directories")
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
                return False
        except FileNotFoundError:
            return False
        owner = _read_owner(fd)
        if owner and owner.get("host") != platform.node() and not self.force:
            raise RuntimeError(f"{self.path.parent} is locked by {_describe(owner)} on another host; if that process "
                               f"is gone, rerun with --force-unlock (or delete {self.path})")
        fault_point("lock:before_owner")
        # free: nobody holds the flock, and the recorded owner (if any) is a dead process on this host. Overwrite,
        # then cut to length: the file never reads empty
        data = _owner_bytes()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return True

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # while still holding the flock
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _flock(fd: int) -> bool:
    """Take an exclusive non-blocking ``flock`` on ``fd``: False if another holder has it. Where the filesystem has
    no flock, the owner recorded in the file decides (a live process on this host keeps it)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        owner = _read_owner(fd)
        return not (owner and owner.get("host") == platform.node() and owner.get("pid") != os.getpid()
                    and _alive(owner.get("pid")))


def _owner_bytes() -> bytes:
    return json.dumps({"host": platform.node(), "pid": os.getpid()}).encode()


def _read_owner(fd: int) -> dict | None:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _describe(owner: dict | None) -> str:
    return f"host {owner.get('host')}, pid {owner.get('pid')}" if owner else "unknown owner"


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
