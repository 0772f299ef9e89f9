"""Two C++ warnings every in-place worker printed at its start, known to be harmless there (docs/elastic.md):

    [W... socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
        c10d names a store's address by its host name (getnameinfo) when it makes a socket; where no DNS server
        answers (a network namespace, an air-gapped host) it says this, once per process, and names addresses by
        their IP from then on.
    [rank0]:[W... Backend.hpp:556] Warning: setSequenceNumberForGroup() is deprecated and is now a no-op; ...
        torchft (0.2.0) calls it on every gloo group it makes, and torch (2.14) made it a no-op that warns, once per
        process.

Neither goes through Python's warnings (c10's logger writes them to fd 2), and TORCH_CPP_LOG_LEVEL=ERROR, the one
setting that controls them, would hide every other C++ warning with them. Since each is said once per process, the
worker has both said at its start, by a store and a fake process group of its own, with fd 2 caught for those
milliseconds: the two lines are dropped, every other line caught is written on.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from datetime import timedelta
from typing import Iterator

KNOWN = re.compile(rb"\[c10d\] The hostname of the client socket cannot be retrieved\. err=-?\d+\s*$|"
                   rb"Warning: setSequenceNumberForGroup\(\) is deprecated and is now a no-op")


@contextlib.contextmanager
def fd2_without(known: re.Pattern = KNOWN) -> Iterator[None]:
    """Inside the block, what is written to fd 2 (C++ included) is caught; after it, every line but the known ones
    is written there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                caught.seek(0)
                kept = [line for line in caught.read().splitlines(keepends=True) if not known.search(line)]
                if kept:
                    os.write(2, b"".join(kept))
    finally:
        os.close(saved)


def said_quietly(address: str) -> None:
    """Have both warnings said (where they would be) and dropped, before the process groups are made. address: the
    one the worker's first store connection goes to (its host group's), whose name c10d looks up. Best effort:
    where a step fails (another torch), its warning shows as before."""
    import torch.distributed as dist

    with fd2_without():
        with contextlib.suppress(Exception):  # its own client's connection names the address
            dist.TCPStore(address, 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
        with contextlib.suppress(Exception):
            from torch._C._distributed_c10d import FakeProcessGroup

            FakeProcessGroup._create_internal(0, 1)._set_sequence_number_for_group()
