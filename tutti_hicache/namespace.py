"""A store's namespace on disk: its directories and the checks they must pass.

At a glance:
    check_dirs(cfg)                         create missing store dirs (0700); each must be writable
                                            and accept O_DIRECT, else ValueError naming tutti_dirs
"""

from __future__ import annotations

import os

from . import engine
from .config import ENV_PREFIX, PREFIX, TuttiConfig


def check_dirs(cfg: TuttiConfig) -> None:
    """Create missing store directories (0700); check they are writable and accept O_DIRECT."""
    if not cfg.dirs:
        raise ValueError(f"{PREFIX}dirs: at least one store directory is required "
                         f"(or set {ENV_PREFIX}DIRS)")
    for d in cfg.dirs:
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{PREFIX}dirs: cannot create {d}: {e.strerror}") from None
        if not os.path.isdir(d):
            raise ValueError(f"{PREFIX}dirs: {d} is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"{PREFIX}dirs: {d} is not writable")
        try:
            direct = engine.probe_o_direct(d)
        except OSError as e:
            raise ValueError(f"{PREFIX}dirs: cannot create files in {d}: {e.strerror}") from None
        if not direct:
            raise ValueError(f"{PREFIX}dirs: the filesystem of {d} refuses O_DIRECT (some FUSE, "
                             "overlay or network filesystems do); use a directory on ext4, xfs, "
                             "btrfs or tmpfs")
