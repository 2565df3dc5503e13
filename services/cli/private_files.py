"""Files and folders that only their owner may read: what `spotrl secrets` writes (tokens,
passwords, keys). Each file is created with its mode, never opened to others for a moment; a
folder's mode is set again after mkdir (an existing folder, or a umask that took bits away)."""

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    path.chmod(DIR_MODE)


def write_private(path: Path, text: str) -> Path:
    """`text` into a new file that only its owner can read, from its creation on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_private_bytes(path: Path, data: bytes) -> None:
    """`data` into a new file `path` (an old one replaced), created 0600."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def private(path: Path) -> Path:
    path.chmod(FILE_MODE)
    return path
