"""Which host went away: every launcher of a multi-host job beats in the rendezvous store while its workers
run, so when a rank loses its peers, its host's launcher can say whose launcher stopped answering.

A collective error only names a peer's address (gloo: `Connection closed by peer [10.0.0.2]:41234`, or a
timeout with none). Each launcher takes a slot in torchrun's own store (no port of our own), writes its name
there, and adds to its slot's counter twice a second; one that ends on its own marks its slot as left. When
this host's ranks fail, the launcher watches the counters for a few seconds: a slot that neither moves nor
left is a host that went away (its launcher killed, its machine or its network gone). A store that stops
answering is the rendezvous host itself going away. Counters, not clocks: hosts' clocks need not agree.
"""

from __future__ import annotations

import socket
import threading
import time

BEAT_S = 0.5
SETTLE_S = 3.0  # six beats: a live launcher, even a loaded one, moves its counter within it
STORE_S = 2  # a store operation that takes longer is the store gone
PREFIX = "trainer-hosts"
STORE_GONE_HEAD = "the rendezvous host "  # how verdict() begins when the store itself is what went away


class Presence(threading.Thread):
    """Started by the supervisor before torchrun's agent on a multi-host job; `verdict()` after a failure."""

    def __init__(self, store_at: tuple[str, int], label: str, on_lost=None, lost_after_s: float = 0.0):
        """on_lost: called (once, from this thread) when the store has not answered for lost_after_s after it had
        answered: an elastic agent polls that store between its workers' checks and blocks in the call when the
        network to it is cut, so nothing else would end this host."""
        super().__init__(name="host-presence", daemon=True)
        self.store_at, self.label = store_at, label
        self.on_lost, self.lost_after_s = on_lost, lost_after_s
        self.slot: int | None = None
        self.answered = 0.0  # monotonic time of the store's last answer to a beat
        self._beating = None  # this thread's client; the caller's is its own (a blocked beat blocks no verdict)
        self._asking = None
        self._done = threading.Event()
        self._named: set[int] = set()  # slots a verdict named already: a lost launcher's slot stays quiet for good

    def _client(self):
        return store_client(self.store_at, STORE_S)

    def _ask(self):
        if self._asking is None:
            self._asking = self._client()
        return self._asking

    def run(self) -> None:
        while not self._done.is_set():
            try:
                if self._beating is None:
                    self._beating = self._client()
                if self.slot is None:
                    slot = int(self._beating.add(f"{PREFIX}/count", 1))
                    self._beating.set(f"{PREFIX}/{slot}/name", self.label)
                    self.slot = slot
                self._beating.add(f"{PREFIX}/{self.slot}/beat", 1)
                self.answered = time.monotonic()
            except Exception:  # noqa: BLE001 (not up yet, or gone: verdict() says which when it matters)
                self._beating = None
            self._done.wait(BEAT_S)

    def _watch(self) -> None:
        """on_lost's own thread: a store cut off by the network leaves a beat blocked in its call, not failing."""
        while not self._done.wait(BEAT_S):
            if self.slot is not None and time.monotonic() - self.answered > self.lost_after_s:
                self.on_lost()
                return

    def start(self) -> None:
        super().start()
        if self.on_lost is not None:
            threading.Thread(target=self._watch, name="host-presence-watch", daemon=True).start()

    def _store_silent(self) -> bool:
        """The store stopped answering this host's beats a while ago (not merely between two of them)."""
        return self.slot is not None and time.monotonic() - self.answered > 4 * BEAT_S + STORE_S

    def stop(self) -> None:
        """No more beats; the thread is gone before this returns (a store client's thread killed at the
        interpreter's exit aborts the process)."""
        self._done.set()
        if self.is_alive():
            self.join(STORE_S + 2 * BEAT_S)

    def leave(self, why: str) -> None:
        """This launcher ends on its own: its slot is not a host that went away."""
        self.stop()
        if self.slot is None or self._store_silent():
            return
        try:
            self._ask().set(f"{PREFIX}/{self.slot}/left", why)
        except Exception:  # noqa: BLE001 (the store's host is gone: nobody is left to read it)
            pass

    def linger(self) -> None:
        """Until every other slot has left, or SETTLE_S and a beat more: the store this process hosts must
        outlive the others' verdicts, or they would take its end for the rendezvous host going away."""
        deadline = time.monotonic() + SETTLE_S + BEAT_S
        while time.monotonic() < deadline:
            try:
                store = self._ask()
                count = int(store.add(f"{PREFIX}/count", 0))
                if all(store.check([f"{PREFIX}/{s}/left"]) for s in range(1, count + 1)):
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(BEAT_S / 2)

    def verdict(self) -> str | None:
        """After this host's ranks failed: which hosts went away, in a clause, or None (none did, or unknown)."""
        host, port = self.store_at
        gone_store = (f"{STORE_GONE_HEAD}{host} went away (its store at {host}:{port} stopped answering: its "
                      "launcher, its machine or the network to it is gone)")
        if self._store_silent():
            return gone_store
        try:
            store = self._ask()
            count = int(store.add(f"{PREFIX}/count", 0))
            others = [s for s in range(1, count + 1) if s != self.slot and s not in self._named]
            first = {s: int(store.add(f"{PREFIX}/{s}/beat", 0)) for s in others}
            quiet = set(others)
            deadline = time.monotonic() + SETTLE_S
            while quiet and time.monotonic() < deadline:
                time.sleep(BEAT_S / 2)
                for s in list(quiet):
                    if store.check([f"{PREFIX}/{s}/left"]) or int(store.add(f"{PREFIX}/{s}/beat", 0)) != first[s]:
                        quiet.discard(s)
            names = [store.get(f"{PREFIX}/{s}/name").decode() for s in sorted(quiet)]
            self._named |= quiet
        except Exception:  # noqa: BLE001 (the store itself stopped answering: its host is the one that went)
            return gone_store
        if not names:
            return None
        return (f"{' and '.join(names)} went away (its launcher stopped answering the rendezvous store "
                f"for {SETTLE_S:g} s: the launcher, its machine or the network to it is gone)")


def store_client(at: tuple[str, int], timeout_s: float):
    """A client of torchrun's rendezvous store (never its host): the launcher's own keys beside torchrun's."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(at[0], at[1], is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def label(node_rank: str, address: str | None = None) -> str:
    """How the others' lines name this host: a static job's node, an elastic one's host (with its address toward
    the rendezvous host, where that is not loopback: hosts on one machine, or containers, share a hostname)."""
    host = socket.gethostname()
    if node_rank.isdigit():
        return f"node {node_rank} (host {host})"
    return f"host {host} ({address})" if address and not address.startswith("127.") else f"host {host}"


def newest_attempt(store, own: int) -> int:
    """The attempt a static job's group meets under: this host's restart count, or the newest any host of the job
    has reached if that is later. A host whose launcher was started again counts its restarts from 0 while the
    others are at their Nth restart, waiting for it under prefix N; under its own count it would meet the stale
    keys of a group long gone. The newest is kept in the store, only ever raised."""
    key, value = "trainer/newest-attempt", str(own)
    current = store.compare_set(key, "", value).decode()
    while int(current) < own:  # another host wrote a smaller one between: raise it, unless a larger one came
        current = store.compare_set(key, current, value).decode()
    return int(current)
