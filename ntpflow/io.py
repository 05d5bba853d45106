"""Atomic file writes, safetensors checkpoints with JSON sidecars, and the environment record of a run."""

import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
    """Save tensors to ``path`` (safetensors) atomically, and ``meta`` to its ``.json`` sidecar if given.

    The sidecar is written last, so a checkpoint counts as complete only when its sidecar exists.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if meta is not None:
        write_json(path.with_suffix(".json"), meta)


def load_tensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a safetensors file; a missing or corrupted file raises a one-line error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"missing checkpoint {path}")
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"corrupted checkpoint {path}: {e}") from None


def environment() -> dict:
    """Package versions, platform, device and git commit of the ntpflow source tree."""
    import numpy

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "git_commit": None,
        "git_dirty": None,
    }
    try:
        from importlib.metadata import version

        env["ntpflow"] = version("ntpflow")
    except Exception:
        env["ntpflow"] = None
    src = Path(__file__).resolve().parent
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        env["git_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=src, capture_output=True, text=True,
            timeout=10).stdout.strip())
    except Exception:
        pass
    return env


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU; any other string is passed to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unknown device {spec!r}") from None


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
    """An exclusive lock on a folder (``.lock`` holding the owner's host and pid), so that two processes never
    write the same run directory. A lock left by a dead process on this host is taken over.

    Use as ``with DirLock(run_dir): ...``; a held lock raises RuntimeError with its owner.
    """

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / ".lock"

    def __enter__(self) -> "DirLock":
        me = {"host": platform.node(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and owner.get("host") == me["host"] and not _alive(owner.get("pid")):
                    self.path.unlink(missing_ok=True)  # stale: its process is gone
                    continue
                raise RuntimeError(f"{self.path.parent} is in use by another process ({owner or 'unknown owner'}); "
                                   "concurrent runs must use different directories") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return self
        raise RuntimeError(f"could not lock {self.path.parent}")

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None


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
