"""Several lighthouses (LIGHTHOUSE_HOSTS): no host whose loss ends an in-place job (docs/elastic.md).

Every launcher on a host that LIGHTHOUSE_HOSTS names runs a lighthouse beside it; one of them says who trains each
step, the others stand by. torchft's Manager takes one lighthouse address when it is made (its ManagerServer, on the
host's first process, sends its heartbeats and quorum requests there, reconnecting on each retry), so that process
gives it the address of a relay of its own (Relay, a TCP relay on 127.0.0.1): each connection torchft opens goes to
the lighthouse the relay chooses, and the Manager, its process group and the training state stay as they are. A
lighthouse moved to is, to the Manager, the lighthouse started again (its quorum ids start over: the job's
generations, counted in the checkpoint directory, still only grow: inplace.JobGenerations).

Which lighthouse: the one in use while it answers. When it does not (its host lost), the one the job's lease names,
if that answers; else, once the lease has not changed for LEASE_S, the first in LIGHTHOUSE_HOSTS's order that
answers. The lease is a file in the shared checkpoint directory (LIGHTHOUSE_LEASE) that the first host of the
training generation rewrites every LEASE_RENEW_S (Lease) with the lighthouse it uses and a count: a change, not a
time (the hosts' clocks differ). A host cut off from the job's lighthouse while the job trains on (its lease
changing) therefore does not move to a standby of its own side and train there: a network cut into two groups
leaves one group training, the one with the lease's lighthouse; the other's quorums fail (inplace.QuorumFailed, or
Fenced by the generations the first group opens). The generations' fencing stays the guard behind it: a host of an
older generation commits no checkpoint, whatever lighthouse it found.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from trainer.checkpoint.claim import LIGHTHOUSE_LEASE
from trainer.config.settings import LIGHTHOUSES_ENV
from trainer.core.files import atomic_file

log = logging.getLogger("trainer")
LEASE_RENEW_S = 0.5
# The lease unchanged this long: its holder's group is gone (or paused), and a standby lighthouse may be used. Above
# the longest quorum of a live group (the lighthouse drops a lost host after its 2 s heartbeat timeout), below the
# issue's goal of 10 s for a host's loss.
LEASE_S = 4.0
UNACKNOWLEDGED_S = 3.0
CONNECT_S = 1.0  # a lighthouse that does not accept a connection in this long is taken for lost


def addresses(env) -> list[tuple[str, int]]:
    """The lighthouses trainer-launch gave the workers, in order ((host, port)); fewer than two: no relay."""
    found = []
    for item in env.get(LIGHTHOUSES_ENV, "").split(","):
        if item.strip():
            parts = urlsplit(item.strip())
            found.append((parts.hostname or "", parts.port or 80))
    return found


def shown(address: tuple[str, int] | None) -> str:
    if address is None:
        return "none"
    host, port = address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolved(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return {host}


def connect(address: tuple[str, int], timeout: float = CONNECT_S) -> socket.socket | None:
    try:
        return socket.create_connection(address, timeout=timeout)
    except OSError:
        return None


def read_lease(directory: Path) -> str | None:
    try:
        return (directory / LIGHTHOUSE_LEASE).read_text()
    except OSError:
        return None


def lease_holder(text: str | None) -> tuple[str, int] | None:
    """The lighthouse a lease names (its first word, host:port)."""
    word = (text or "").split(" ", 1)[0].strip()
    host, _, port = word.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


class Relay:
    """A TCP relay on 127.0.0.1 (url) to the chosen lighthouse, chosen again for each connection (module docstring)."""

    def __init__(self, order: list[tuple[str, int]], directory: Path):
        self.order, self.directory = order, directory
        self.current: tuple[str, int] | None = None
        self.seen: tuple[str | None, float] | None = None  # the lease as last read, and since when unchanged
        self.lock = threading.Lock()
        self.said_held = False
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="lighthouse-relay", daemon=True).start()

    def answers(self) -> bool:
        """Whether the lighthouse in use accepts a connection now."""
        current = self.current
        if current is None:
            return False
        sock = connect(current)
        if sock is None:
            return False
        sock.close()
        return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = self.upstream()
        if upstream is None:  # no lighthouse to use now: torchft's client fails this try and asks again
            client.close()
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A lighthouse's host lost without a word (powered off, cut off): torchft's heartbeats every 100 ms go
        # unacknowledged, and the kernel ends the connection after this long (gRPC's own keepalive: 60 + 20 s); torchft
        # then connects again, and the relay chooses again.
        with contextlib.suppress(OSError, AttributeError):
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(UNACKNOWLEDGED_S * 1000))
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)

    def upstream(self) -> socket.socket | None:
        """A connection to the lighthouse to use now (None: none may be used yet)."""
        with self.lock:
            if self.current is not None:
                sock = connect(self.current)
                if sock is not None:
                    return sock
            text = read_lease(self.directory)
            now = time.monotonic()
            if self.seen is None or self.seen[0] != text:
                self.seen = (text, now)
            holder = lease_holder(text)
            if holder is not None and holder != self.current:
                sock = connect(holder)
                if sock is not None:
                    self._move(holder, "the lighthouse the job's lease names")
                    return sock
            if text is None and self.current is None or now - self.seen[1] >= LEASE_S:
                for address in self.order:
                    if address in (self.current, holder):
                        continue  # tried above
                    sock = connect(address)
                    if sock is not None:
                        self._move(address, f"the job's lease unchanged for {now - self.seen[1]:.1f} s"
                                   if text is not None else "the first in LIGHTHOUSE_HOSTS's order that answers")
                        return sock
            elif self.current is not None and not self.said_held:
                self.said_held = True
                log.warning("in place: the lighthouse at %s does not answer: this host moves to another only once the "
                            "job's lease in %s has not changed for %g s (while it changes, the job trains on there, "
                            "and a host cut off from it must not train apart)", shown(self.current), self.directory,
                            LEASE_S)
            return None

    def _move(self, address: tuple[str, int], why: str) -> None:
        if self.current is not None:
            log.warning("in place: the lighthouse at %s does not answer: this host moves to the one at %s (%s), its "
                        "processes as they are", shown(self.current), shown(address), why)
        self.current, self.said_held = address, False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.server.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class Lease:
    """The job's lease, rewritten every LEASE_RENEW_S while holds() (the first host of a generation that trains, on a
    thread of its own: a host frozen or gone renews nothing)."""

    def __init__(self, relay: Relay, holds: Callable[[], bool]):
        self.relay, self.holds = relay, holds
        self.token, self.count = uuid.uuid4().hex[:12], 0
        self.running = True
        threading.Thread(target=self._renew, name="lighthouse-lease", daemon=True).start()

    def _renew(self) -> None:
        while self.running:
            time.sleep(LEASE_RENEW_S)
            current = self.relay.current
            try:
                if current is None or not self.holds():
                    continue
            except Exception:  # noqa: BLE001 (the run's state read from another thread: the next turn reads it again)
                continue
            self.count += 1
            host, port = current
            with contextlib.suppress(OSError):  # the checkpoint directory's own writes say why it cannot be written
                with atomic_file(self.relay.directory / LIGHTHOUSE_LEASE, "w", durable=False) as f:
                    f.write(f"{f'[{host}]' if ':' in host else host}:{port} {self.token} {self.count}\n")

    def stop(self) -> None:
        self.running = False


def on_a_lost_lighthouse_host(member: str, lighthouses: list[tuple[str, int]]) -> bool:
    """Whether a quorum's member (torchft's replica id: this host's address toward MASTER_ADDR, '-', its name, ':'
    and a uuid) is on a host of LIGHTHOUSE_HOSTS whose lighthouse does not answer: that host is taken for lost."""
    address = member.split("-", 1)[0]
    for host, port in lighthouses:
        if address in resolved(host):
            sock = connect((host, port))
            if sock is None:
                return True
            sock.close()
    return False
