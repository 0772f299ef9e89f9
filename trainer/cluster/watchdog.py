"""The launcher's hang watchdog: no progress for HANG_TIMEOUT seconds names the stuck ranks, then ends the job.

Progress is what the workers record (trainer.cluster.workers): a completed step for the built-in loop and
trainer.api, any output line for other scripts. On several hosts the hosts share it through the rendezvous
store (one counter every host adds its progress to), so a host whose ranks print nothing while rank 0's host
logs is not taken for a hung one. Past the bound every worker on the host writes its threads' stacks
(faulthandler, registered by the bootstrap: no ptrace needed), the watchdog prints each rank's, names the
ranks that are not inside a collective (where a hang starts: the others wait for them) and stops the job.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.cluster import workers
from trainer.cluster.presence import store_client

HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
# Where a rank waits for its peers: torch's collectives, DDP's reducer (inside backward) and the trainer's own.
COLLECTIVE = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}torch{os.sep}nn{os.sep}parallel{os.sep}",
              f"{os.sep}torch{os.sep}autograd{os.sep}", f"{os.sep}trainer{os.sep}parallel{os.sep}")
LIBRARY = ("site-packages", "dist-packages", "<frozen")
HOST = socket.gethostname()
BOOTSTRAP = f"trainer{os.sep}parallel{os.sep}bootstrap.py"
NOISE = re.compile(r'File "(<frozen runpy>|.*trainer/parallel/bootstrap\.py)"')  # how the program was started


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def where(self) -> str:
        path = os.path.relpath(self.file) if self.file.startswith(os.getcwd() + os.sep) else self.file
        return f"{path}:{self.line} in {self.func}"


def main_thread(dump: str) -> list[Frame]:
    """The main thread's frames, innermost first, from a faulthandler dump: the thread whose outermost frames
    are the bootstrap's (it ran the program)."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if HEADER.match(line):
            threads.append([])
        elif (match := FRAME.match(line)) and threads:
            threads[-1].append(Frame(match["file"], int(match["line"]), match["func"]))
    return next((t for t in threads if any(f.file.endswith(BOOTSTRAP) for f in t)), threads[-1] if threads else [])


def in_collective(frames: list[Frame]) -> bool:
    return any(any(part in f.file for part in COLLECTIVE) for f in frames if not f.file.endswith(BOOTSTRAP))


def stuck_at(frames: list[Frame]) -> Frame:
    """The innermost frame of the user's own code (not the standard library, a package or the trainer's
    bootstrap); else the innermost frame."""
    stdlib = (os.path.dirname(os.__file__),)
    own = [f for f in frames if not any(part in f.file for part in LIBRARY) and not f.file.startswith(stdlib)
           and not f.file.endswith(BOOTSTRAP)]
    return (own or frames)[0]


class Progress:
    """Whether the job made progress since the last look: this host's records, and on several hosts the
    counter in the rendezvous store every host adds to."""

    KEY = "trainer-watchdog/progress"

    def __init__(self, folder: Path, store_at: tuple[str, int] | None):
        self.folder, self.store_at = folder, store_at
        self.seen_local = 0.0
        self.seen_shared = 0
        self._store = None

    def _shared(self, add: int) -> int | None:
        if self.store_at is None:
            return None
        try:
            if self._store is None:
                self._store = store_client(self.store_at, 10)
            return int(self._store.add(self.KEY, add))
        except Exception:  # noqa: BLE001 (the store is torchrun's; its host gone, the job fails without us)
            return None

    def moved(self) -> bool:
        local = max((workers.last_progress(self.folder, w.rank) or 0.0 for w in workers.read_workers(self.folder)),
                    default=0.0)
        moved = local > self.seen_local
        self.seen_local = max(local, self.seen_local)
        shared = self._shared(1 if moved else 0)
        if shared is not None:
            moved = moved or shared != self.seen_shared
            self.seen_shared = shared
        return moved


class Watchdog(threading.Thread):
    """Started by the agent before its workers; `fired` holds the one-line verdict once it acted."""

    def __init__(self, folder: Path, timeout: float, store_at: tuple[str, int] | None, stop: Callable[[], None]):
        super().__init__(name="hang-watchdog", daemon=True)
        self.folder, self.timeout, self.stop = folder, timeout, stop
        self.progress = Progress(folder, store_at)
        self.fired: str | None = None

    def run(self) -> None:
        tick = max(0.5, min(5.0, self.timeout / 10))
        last = time.monotonic()
        while True:
            time.sleep(tick)
            running = [w for w in workers.read_workers(self.folder) if w.exit is None and w.alive]
            if not running or self.progress.moved():
                last = time.monotonic()
                continue
            if time.monotonic() - last >= self.timeout:
                self.act(running)
                return

    def act(self, running: list[workers.Worker]) -> None:
        outside, waiting = probe(self.folder, running, show=True)
        named = "; ".join(outside) if outside else (
            f"ranks {', '.join(map(str, waiting))} (host {HOST}) wait in a collective: a rank on another "
            "host is the stuck one (its host's launcher names it)")
        self.fired = (f"hang: no progress for {self.timeout:g} s (HANG_TIMEOUT): {named}; the stacks are above "
                      "(raise HANG_TIMEOUT for longer silent phases, or 0 turns the watchdog off)")
        self.stop()
        workers.kill(running)


def probe(folder: Path, running: list[workers.Worker], show: bool) -> tuple[list[str], list[int]]:
    """Ask these workers for their stacks: (a line for each one not inside a collective, the ranks that are);
    show: print every rank's stack too."""
    for w in running:
        (folder / f"rank-{w.rank}.stacks").write_text("")  # this dump only (the worker appends)
        try:
            os.kill(w.pid, workers.STACKS_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(1.0)  # faulthandler writes from its signal handler, in microseconds; a loaded host is slower
    outside, waiting = [], []
    for w in running:
        dump = (folder / f"rank-{w.rank}.stacks").read_text(errors="replace")
        frames = main_thread(dump)
        if show:
            shown = "\n".join(line for line in dump.strip().splitlines() if not NOISE.search(line))
            print(f"--- rank {w.rank} (host {HOST}, pid {w.pid}):\n"
                  + (shown or "(no stack: the process did not answer)"), file=sys.stderr, flush=True)
        if not frames:  # faulthandler answers from its C handler, GIL or not: only a stopped process is silent
            outside.append(f"rank {w.rank} (host {HOST}) did not answer (stopped, or frozen in the kernel)")
        elif in_collective(frames):
            waiting.append(w.rank)
        else:
            where = stuck_at(frames).where()
            outside.append(f"rank {w.rank} (host {HOST}) is not in the collective: stuck at {where}")
    return outside, waiting
