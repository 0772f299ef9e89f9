"""The torchft lighthouse of a job on in-place recovery (docs/elastic.md), seen from the launcher (torch-free).

The lighthouse says, at every step, which hosts train it (torchft's quorum). It listens at MASTER_ADDR:MASTER_PORT,
the port the c10d rendezvous would take on the restart path: the launcher on the MASTER_ADDR host runs it beside
itself unless one answers there already (compose.multinode.yaml's `lighthouse` service, or another launcher of the
job on that host). Every launcher waits for it, up to RDZV_TIMEOUT, before its workers start, and refuses anything
else that answers there (answers()).

    python -m trainer.cluster.lighthouse --port 29500 [--min-hosts 1] [--join-timeout 300]

runs one on its own (what the compose service does), with the settings the launcher gives its own.
"""

from __future__ import annotations

import ctypes
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

QUORUM_TICK_MS = 100
# A host that stops sending heartbeats (killed, frozen, cut off) is left out of the next quorum after this long: the
# most of what a lost host costs the others (docs/benchmarks.md). Heartbeats come from threads of torchft's own (a
# host busy in a long step or checkpoint write still sends them); torchft's default is 5 s.
HEARTBEAT_TIMEOUT_MS = 2000


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def identity(host: str, port: int) -> str:
    """An in-place job's identity: its lighthouse's URL at the address `host` resolves to (hosts of one job may name
    the MASTER_ADDR host differently: a name on one, its address on another)."""
    try:
        address = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, IndexError):
        address = host
    return url(address, port)


# The torchft releases whose API this code knows (its Manager's arguments, ProcessGroupGloo.configure and
# ProcessGroupBabyNCCL.configure, which trainer/engine/replica_group.py overrides, and the Rust LighthouseServer loaded
# by path in serve()); pyproject.toml pins this range.
TORCHFT_TESTED = ("0.2",)
TORCHFT_REQUIREMENT = "torchft>=0.2,<0.3"


def torchft_version() -> str | None:
    """The installed torchft's version, read from its metadata (no import: torchft's imports torch)."""
    from importlib import metadata

    try:
        return metadata.version("torchft")
    except metadata.PackageNotFoundError:
        return None


def unknown_torchft() -> str | None:
    """The installed torchft's version where it is not one this code was tested with; None otherwise."""
    version = torchft_version()
    if version is None or any(version == tested or version.startswith(f"{tested}.") for tested in TORCHFT_TESTED):
        return None
    return version


def unavailable() -> str | None:
    """Why this host cannot run in place (torchft, a dependency, is missing from this Python); None: it can."""
    if importlib.util.find_spec("torchft") is None:
        return f"torchft is not installed (pip install '{TORCHFT_REQUIREMENT}', a dependency of the trainer)"
    if program() is None:
        return "torchft's torchft_lighthouse command is not on PATH nor beside this Python"
    return None


def program() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")


# What answers at the lighthouse's address is asked for torchft's dashboard page: the lighthouse serves it on its gRPC
# port (tonic with accept_http1 and axum routes beside its LighthouseService), and its <title> has read
# "Lighthouse Dashboard - torchft" since the dashboard came (torchft's templates/index.html, Nov 2024); verified
# against torchft 0.2.0. A plain HTTP GET: no torch, no gRPC client (HTTP/2 and HPACK) in the torch-free launcher,
# and no state in the lighthouse (a gRPC Heartbeat would register a replica). Anything else there (another service
# holding MASTER_PORT) was taken for the lighthouse by a TCP connect: the workers then sat silent in their quorum.
DASHBOARD_TITLE = b"Lighthouse Dashboard - torchft"
TAKEN_EXIT = 3  # the launcher's lighthouse found its port taken on this host (another launcher's lighthouse, or not)
ANSWER_S = 5.0  # a silent listener is refused after this long: the lighthouse answers in milliseconds, loaded or not


class NotTheLighthouse(Exception):
    """Something other than torchft's lighthouse answers at its address; the message says what was seen."""


def answers(host: str, port: int, timeout: float = 1.0, answer_s: float = ANSWER_S) -> str | None:
    """None when torchft's lighthouse answers at host:port; else why nothing does (the socket's words). Raises
    NotTheLighthouse when something else answers there."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as err:
        return err.strerror or type(err).__name__
    sock.settimeout(answer_s)
    connection = http.client.HTTPConnection(host, port, timeout=answer_s)
    connection.sock = sock  # connected above: a refused connection is no answer yet, anything after it is one
    try:
        connection.request("GET", "/", headers={"Connection": "close"})
        response = connection.getresponse()
        page = response.read(1 << 16)
    except TimeoutError:
        raise NotTheLighthouse(f"it accepted the connection but gave no answer in {answer_s:g} s") from None
    except http.client.RemoteDisconnected:
        raise NotTheLighthouse("it closed the connection without an answer") from None
    except http.client.HTTPException as err:  # a status line that is not HTTP's, or no line at all
        raise NotTheLighthouse(f"an answer that is not HTTP: {' '.join(str(err).split())[:40]}") from None
    except OSError as err:
        raise NotTheLighthouse(f"it broke off the connection: {err.strerror or type(err).__name__}") from None
    finally:
        connection.close()
    if response.status == 200 and DASHBOARD_TITLE in page:
        return None
    server = " ".join((response.getheader("Server") or "").split())[:60]
    raise NotTheLighthouse(f"HTTP {response.status} {response.reason} from {server or 'an HTTP server'}")


def here(host: str) -> bool:
    """Whether `host` is an address of this machine (the lighthouse then runs here): a loopback address, or one a
    socket binds to (only an address of one of this machine's interfaces does)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for address in addresses:
        if address.startswith("127.") or address == "::1":
            return True
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
                return True
            except OSError:
                continue
    return False


def _die_with_parent() -> None:
    """In the lighthouse's process, before exec: it gets SIGTERM when the launcher's process ends (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start(port: int, min_hosts: int, join_timeout_s: float) -> subprocess.Popen:
    """The lighthouse, beside this launcher: in a session of its own (a terminal's Ctrl-C is the launcher's to pass
    on: the workers stop at an agreed step, which needs the lighthouse), ended when the launcher's process ends."""
    return subprocess.Popen([sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port), "--min-hosts",
                             str(min_hosts), "--join-timeout", f"{join_timeout_s:g}", "--exit-if-taken"],
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)


def keep(started: subprocess.Popen, port: int, min_hosts: int, join_timeout_s: float,
         say: Callable[[str], None]) -> threading.Thread:
    """The lighthouse beside this launcher started again, on the same port, whenever it ends while the launcher runs
    (killed, crashed): the hosts' workers wait for it in their quorum, keeping their processes, and rejoin it (a
    thread of the launcher's; the new lighthouse dies with the launcher's process, as the first did). A lighthouse
    that finds its port taken (another launcher's on this host started one first) is left to that one, watched
    from here: started again if nothing answers there any more."""

    def watch() -> None:
        proc = started
        while True:
            code = proc.wait()
            if code == TAKEN_EXIT:
                while _answered("127.0.0.1", port):
                    time.sleep(1.0)
            else:
                how = f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                    else f"exit {code}"
                say(f"the lighthouse beside this launcher ended ({how}): starting it again on port {port} (the hosts "
                    "rejoin it in place)")
                time.sleep(0.5)  # not a busy loop if it cannot start at all
            proc = start(port, min_hosts, join_timeout_s)

    thread = threading.Thread(target=watch, name="lighthouse", daemon=True)
    thread.start()
    return thread


def _answered(host: str, port: int) -> bool:
    try:
        return answers(host, port) is None
    except NotTheLighthouse:
        return True  # not ours to replace


def serve(port: int, min_hosts: int, join_timeout_s: float, exit_if_taken: bool = False) -> int:
    """Run the lighthouse in this process until it is stopped. torchft's Rust server (its LighthouseServer) is loaded
    from its file without the torchft package, whose import loads torch: 3 s and 300 MB on this project's test
    machine against 0.03 s and a few MB. Where that file is not found or does not load (another torchft), its
    torchft_lighthouse command takes this process's place: slower to start, the same server. A port taken on this
    host is one line and exit 2; exit_if_taken (the launcher's): TAKEN_EXIT and no line (its wait says what)."""
    os.environ.setdefault("RUST_LOG", "warn")  # its INFO is a line per quorum request
    settings = {"bind": f"[::]:{port}", "min_replicas": min_hosts, "quorum_tick_ms": QUORUM_TICK_MS,
                "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                # A host alive but not at a step's start (a long checkpoint write) is waited for this long.
                "join_timeout_ms": int(join_timeout_s * 1000)}
    server = None
    try:
        spec = importlib.util.find_spec("torchft")
        places = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [os.path.join(place, name) for place in places for name in sorted(os.listdir(place))
                 if name.startswith("_torchft.") and name.endswith(".so")]
        if found:
            loaded = importlib.util.spec_from_file_location("torchft._torchft", found[0])
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
            server = module.LighthouseServer(**settings)
    except (ImportError, OSError, AttributeError, TypeError):
        server = None
    except RuntimeError as err:  # torchft's bind error, in Rust's words: "Address already in use (os error 98)"
        if "os error 98" not in str(err):
            raise
        if not exit_if_taken:
            print(f"error: --port: {port} is taken on this host ({str(err).split(' (')[0]}) (stop what holds it, or "
                  "choose another port, the job's MASTER_PORT on every host)", file=sys.stderr, flush=True)
        return TAKEN_EXIT if exit_if_taken else 2
    if server is None:
        command = [program() or "torchft_lighthouse", *(f"--{key}={value}" for key, value in settings.items())]
        os.execvp(command[0], command)
    # The server runs on threads of its own, which hold the interpreter at exit: SIGTERM (its launcher ending, docker
    # stop) and SIGINT end the process at once, exit 0, the same as a stop of any other service.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))
    while True:
        time.sleep(3600)


def wait(host: str | tuple[str, ...], port: int, bound_s: float, say: Callable[[str], None],
         started: subprocess.Popen | None = None, poll: Callable[[], None] | None = None) -> str | None:
    """Wait until the lighthouse answers (said once after a few seconds); None, or why nothing ever did. Something
    else answering there is NotTheLighthouse, at once: it will not turn into the lighthouse; so is a port held on
    this host (the lighthouse started here found it taken) by something that does not answer at host:port. poll:
    called while nothing answers (what it raises ends the wait: the job has ended, say). Several hosts
    (LIGHTHOUSE_HOSTS): any of their lighthouses answering ends the wait."""
    hosts = (host,) if isinstance(host, str) else host
    host = hosts[0]
    deadline, said = time.monotonic() + bound_s, False
    began, taken_at = time.monotonic(), None
    while True:
        why = None
        for each in hosts:
            why = answers(each, port)
            if why is None:
                return None
        if started is not None and started.poll() is not None:
            # Another launcher on this machine took the port first (several hosts on one machine): its lighthouse
            # answers at once. Anything else that holds it here answers not at all (bound to another address).
            taken_at = time.monotonic() if started.returncode == TAKEN_EXIT else None
            started = None
        if taken_at is not None and time.monotonic() - taken_at > ANSWER_S:
            raise NotTheLighthouse(f"nothing does ({why}), and another process on this host holds port {port}")
        if poll is not None:
            poll()
        if time.monotonic() >= deadline:
            return why
        if not said and time.monotonic() - began > 3:
            say(f"waiting for the lighthouse at {url(host, port)} (up to RDZV_TIMEOUT, {bound_s:g} s): it runs beside "
                "trainer-launch on the MASTER_ADDR host" if len(hosts) == 1 else
                f"waiting for a lighthouse at {' or '.join(url(each, port) for each in hosts)} (up to RDZV_TIMEOUT, "
                f"{bound_s:g} s): they run beside trainer-launch on the hosts of LIGHTHOUSE_HOSTS")
            said = True
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer.cluster.lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="its port (the job's MASTER_PORT)")
    parser.add_argument("--min-hosts", type=int, default=None, help="no quorum with fewer hosts (default: MIN of "
                        "--nnodes)")
    parser.add_argument("--nnodes", default="1", help="the job's NNODES, MIN:MAX (its MIN is the fewest hosts)")
    parser.add_argument("--join-timeout", type=float, default=300.0,
                        help="seconds a host alive but not at a step's start is waited for (--collective-timeout)")
    parser.add_argument("--exit-if-taken", action="store_true", help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args(argv)
    fewest = args.min_hosts
    if fewest is None:
        first = args.nnodes.split(":")[0].strip()
        if not first.isdigit() or int(first) < 1:
            parser.error(f"--nnodes: '{args.nnodes}' is not MIN:MAX (e.g. 1:2)")
        fewest = int(first)
    return serve(args.port, fewest, args.join_timeout, args.exit_if_taken)


if __name__ == "__main__":
    raise SystemExit(main())
