"""Private torch APIs (and accelerate's), each behind a guard with a public fallback: an upgrade may cost speed or a
line of advice, never a crash.

The trainer reaches into torch where the public API has no equivalent at the same speed: FSDP2's custom
collective hooks (the shared-memory all-gather and reduce-scatter), shared-memory storages (the shared-memory
all-reduce), the composable activation checkpoint (it keeps parameter names), mkldnn's bf16 probe, and (for the
launcher's end line) accelerate's shared state and torchrun's agent-store flag in a worker's environment. Each use
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
    """load() (an import or attribute of a private API), or None: the caller then takes the public path."""
    if public_only():
        return None
    try:
        return load()
    except (ImportError, AttributeError, KeyError) as err:
        if what not in _told:
            _told.add(what)
            log.warning("%s is not in this version (%s): using the public path instead, which may be slower", what,
                        f"{type(err).__name__}: {err}"[:160])
        return None


def torchrun_agent_store() -> bool:
    """Whether this worker's MASTER_ADDR:MASTER_PORT is plain torchrun's agent store, kept across its restarts:
    TORCHELASTIC_USE_AGENT_STORE, which torchrun sets in every worker but does not document (its docs list
    TORCHELASTIC_RESTART_COUNT, _MAX_RESTARTS and _RUN_ID). The launcher's own agent names the store's prefix
    itself; without this flag the public path is env://, as torch's own init takes it."""
    return not public_only() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
