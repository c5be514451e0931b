"""Where weights live and what their SHA256 is.

A weights URI is either local — `file:///abs/path` or `/abs/path`, a file under one of the model roots
(settings.FLEXPIPE_MODEL_ROOTS: `confined`) that the console can read and hash itself — or remote — `http(s)://host/...`, `s3://bucket/key`, `hf://org/repo[/file]` — which only
the agent that downloads it can hash (DESIGN.md: weights never travel through the controller).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

REMOTE_SCHEMES = ("http", "https", "s3", "hf")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f\s]")


@dataclass(frozen=True)
class WeightsLocation:
    uri: str
    local_path: Path | None  # set for local weights; None for remote ones

    @property
    def is_local(self) -> bool:
        return self.local_path is not None


def parse_weights_uri(uri: str) -> WeightsLocation:
    """Classify a weights URI; ValueError with the reason when it is not one we can use."""
    if not uri:
        raise ValueError("must not be empty")
    if _CONTROL_RE.search(uri):
        raise ValueError("must not contain whitespace or control characters")
    if uri.startswith("/"):
        return WeightsLocation(uri, Path(uri))
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"a file:// URI names a file on the console's host, not on {parts.netloc!r}")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError("a file:// URI needs an absolute path, e.g. file:///models/llama/model.safetensors")
        return WeightsLocation(uri, Path(path))
    if scheme in REMOTE_SCHEMES:
        if not parts.netloc:
            raise ValueError(f"a {scheme}:// URI needs a host (or bucket, or organisation) after '//'")
        if scheme in ("s3", "hf") and parts.path.strip("/") == "":
            raise ValueError(f"a {scheme}:// URI needs a path after the {'bucket' if scheme == 's3' else 'organisation'}")
        return WeightsLocation(uri, None)
    raise ValueError("must be file:///absolute/path, an absolute path, or an http(s)://, s3:// or hf:// URI")


def confined(path: Path, roots: list[Path]) -> Path:
    """`path` resolved (symlinks and `..` followed), if it lies under one of the model roots; ValueError
    otherwise: the console reads and hashes files only there, never anywhere on its host."""
    resolved = path.resolve()
    for root in roots:
        if resolved.is_relative_to(root.resolve()):
            return resolved
    where = ", ".join(str(r) for r in roots) or "none configured"
    raise ValueError(f"{path} is not under a model root (FLEXPIPE_MODEL_ROOTS: {where}); put the model there or "
                     "add its folder to FLEXPIPE_MODEL_ROOTS")


def check_readable_file(path: Path) -> int:
    """The size of a local weights file; ValueError saying why the console cannot hash it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ValueError(f"no such file on the console's host: {path}") from None
    except OSError as exc:
        raise ValueError(f"cannot inspect {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a directory or a device); name the weights file itself")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path} is not readable by the console")
    return info.st_size


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Stream a file through SHA256; weights can be tens of GB, so never read them whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()
