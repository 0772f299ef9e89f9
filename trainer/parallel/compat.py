"""Private torch APIs, each behind a guard with a public fallback: a torch upgrade may cost speed, never a crash.

The trainer reaches into torch where the public API has no equivalent at the same speed: FSDP2's custom
collective hooks (the shared-memory all-gather and reduce-scatter), shared-memory storages (the shared-memory
all-reduce), the composable activation checkpoint (it keeps parameter names) and mkldnn's bf16 probe. Each use
goes through `private()`: where this torch lacks the name, the caller takes the public path (gloo's collectives,
torch.utils.checkpoint, ...) and says so once. TRAINER_PUBLIC_TORCH_ONLY=1 takes every public path on purpose:
what a torch without these names runs (the tests compare the two).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, TypeVar

T = TypeVar("T")
PUBLIC_ONLY_ENV = "TRAINER_PUBLIC_TORCH_ONLY"
log = logging.getLogger("trainer")
_told: set[str] = set()


def public_only() -> bool:
    return os.environ.get(PUBLIC_ONLY_ENV, "").strip() == "1"


def private(what: str, load: Callable[[], T]) -> T | None:
    """load() (an import or attribute of torch's private API), or None: the caller then takes the public path."""
    if public_only():
        return None
    try:
        return load()
    except (ImportError, AttributeError) as err:
        if what not in _told:
            _told.add(what)
            log.warning("%s is not in this torch (%s): using the public path instead, which may be slower", what,
                        f"{type(err).__name__}: {err}"[:160])
        return None
