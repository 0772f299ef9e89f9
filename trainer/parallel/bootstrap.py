"""Every worker the launcher's agent starts begins here, then runs the program as Python would.

    python -m trainer.parallel.bootstrap my_train.py ARGS      as `python my_train.py ARGS`
    python -m trainer.parallel.bootstrap -m mypkg.train ARGS   as `python -m mypkg.train ARGS`

Before the program's first line it:
- ties the worker's life to its launcher: the kernel kills the worker when the launcher dies
  (PR_SET_PDEATHSIG), and a sentinel process kills the worker's process group (its own children: mp.spawn,
  DataLoader workers) when the worker dies, so a lost launcher leaves no process training on;
- registers faulthandler on STACKS_SIGNAL, so the launcher's hang watchdog can read every thread's stack
  without ptrace (containers rarely allow it);
- counts each line the program writes to stdout or stderr as progress, for the watchdog;
- records the worker's pid, then how it ended, so the launcher says truthfully what a stop did.

The records are files in the folder the agent names in TRAINER_AGENT_DIR (their format, and the agent's reading
of them: trainer/cluster/workers.py); this module writes them, for the bootstrap and for trainer.api's Run. A
worker started by plain torchrun or srun has no folder, and every function below then does nothing.
Torch-free, so that it adds nothing to a worker's start but a fork (but for a script run once on its host, which
starts its ranks itself: it imports torch's multiprocessing first, see at_exit.collect_in_spawned_children).
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from trainer.cluster.workers import AGENT_DIR_ENV, PROGRESS_EVERY, RUN_ONCE_ENV, STACKS_SIGNAL
from trainer.core.files import atomic_file
from trainer.parallel import at_exit

SENTINEL_SIGNAL = signal.SIGRTMIN + 5  # the sentinel's parent-death signal: nothing else sends it


# ------------------------------------------------------------------ this worker's record

def agent_dir() -> Path | None:
    raw = os.environ.get(AGENT_DIR_ENV, "")
    return Path(raw) if raw and os.path.isdir(raw) else None


def this_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _write(path: Path, facts: dict) -> None:
    """Whole or not at all: the agent may read while a worker writes (not durable: the folder lives as long as
    the job)."""
    with atomic_file(path, "w", durable=False) as f:
        f.write(json.dumps(facts))


def group() -> str:
    """Which start of the worker group this worker belongs to: the agent's restart count, with the world size and
    the group's store port, which an elastic round changes without counting a restart."""
    return "/".join(os.environ.get(name, "") for name in ("TORCHELASTIC_RESTART_COUNT", "WORLD_SIZE", "MASTER_PORT"))


def start() -> None:
    """A new worker's record. The agent removed the earlier group's before it started this one
    (workers.clear_records): a worker removing its predecessors' itself raced its new peers, and once removed a peer's
    record written a moment before (the agent then read a worker of this group as never started, and a stop that
    every worker committed exited 143)."""
    folder = agent_dir()
    if folder is not None:
        _write(folder / f"rank-{this_rank()}.json", {"pid": os.getpid(), "pgid": os.getpgid(0), "group": group()})
        progress()


# Why a lock: a rank's record is read, merged and written whole, and two threads of one worker note facts (the
# main thread its stop, a background checkpoint thread its commit). Unlocked, the later write dropped the earlier
# fact: on torch 2.13 a stopped launcher read a record without the committed stop and exited 143 (issue 45).
_note_lock = threading.Lock()


def note(**facts) -> None:
    """Add facts to this rank's record (nothing without an agent)."""
    folder = agent_dir()
    if folder is None:
        return
    path = folder / f"rank-{this_rank()}.json"
    with _note_lock:
        try:
            record = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            record = {}
        try:
            _write(path, {**record, **facts})
        except OSError:
            pass  # the folder went away with its agent: nobody is left to read it


_progress_path: Path | None | bool = False  # False: not looked up yet
_next_touch = 0.0


def progress() -> None:
    """This rank made progress (a completed step, a line of output). Cheap: one clock read, and a file
    touch at most once a second."""
    global _progress_path, _next_touch
    now = time.monotonic()
    if now < _next_touch:
        return
    _next_touch = now + PROGRESS_EVERY
    if _progress_path is False:
        folder = agent_dir()
        _progress_path = None if folder is None else folder / f"rank-{this_rank()}.progress"
    if _progress_path is not None:
        try:
            _progress_path.touch()
        except OSError:
            _progress_path = None


# ------------------------------------------------------------------ the process


def _on_parent_death(sig: int) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux); False where it cannot."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        return ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """SIGKILL this worker when the launcher (its parent) dies."""
    parent = os.getppid()
    if _on_parent_death(signal.SIGKILL) and os.getppid() != parent:  # it died before the call
        os._exit(128 + signal.SIGKILL)


def start_sentinel() -> None:
    """A forked process that waits for this worker to end, then kills the worker's process group: children
    that outlive their worker (mp.spawn's, a script's own) go with it. torchrun starts each worker in a
    session of its own, so the group is the worker's and nothing else's. The kernel tells the sentinel (a
    parent-death signal: fork-inherited pipes would keep a wait on a pipe open in the very orphans it is for)."""
    if os.getpgid(0) != os.getpid():
        return  # not a group leader (started by hand, or by something else than torchrun): nothing of ours to kill
    worker = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {SENTINEL_SIGNAL})  # no window between fork and the wait
    child = os.fork()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {SENTINEL_SIGNAL})
    if child != 0:
        return
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # torchrun signals the group: outlive the worker
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {SENTINEL_SIGNAL})
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # hold none of the launcher's pipes open
            os.dup2(null, fd)
        os.closerange(3, 65536)
        if _on_parent_death(SENTINEL_SIGNAL) and os.getppid() == worker:
            signal.sigwait({SENTINEL_SIGNAL})
        os.killpg(worker, signal.SIGKILL)  # the worker is gone; so are we, with the rest of its group
    finally:
        os._exit(0)


def _joined() -> bool:
    """This process is in a torch.distributed process group now (read without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:  # noqa: BLE001 (torch half-imported, or another torch: say nothing)
        return False


def watch_for_a_process_group() -> None:
    """Record once this worker joins a process group, so the launcher can say when every rank trained alone
    (accelerate on CPUs without ACCELERATE_USE_CPU, a script that never called init_process_group). Polled
    from a daemon thread: often at first (a short script may join and leave within a second), then rarely."""
    def watch():
        started = time.monotonic()
        while not _joined():
            time.sleep(0.05 if time.monotonic() - started < 30 else 1.0)
        note(joined=True)

    threading.Thread(target=watch, name="trainer-join-watch", daemon=True).start()


FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning", "transformers")


def single_process_frameworks() -> list[str]:
    """Frameworks that ran this rank as a job of one although the launcher started several: accelerate on
    CPUs without ACCELERATE_USE_CPU joins torchrun's process group, then trains as DistributedType.NO."""
    state = sys.modules.get("accelerate.state")
    if state is None or world_size() < 2:
        return []
    from trainer.parallel.compat import private  # at the end only: the start stays at its few imports

    # Its Borg state holds what the user's Accelerator decided; the public PartialState() would initialise one.
    shared = private("accelerate's PartialState._shared_state", lambda: state.PartialState._shared_state)
    return ["accelerate"] if isinstance(shared, dict) and shared.get("num_processes") == 1 else []


def note_the_end(code: int) -> None:
    facts = {"exit": code, "frameworks": [name for name in FRAMEWORKS if name in sys.modules]}
    try:
        facts["single_process"] = single_process_frameworks()
    except Exception:  # noqa: BLE001 (another framework version: say nothing rather than fail a finished run)
        pass
    if _joined():
        facts["joined"] = True
    note(**facts)


class _Beating:
    """A text stream that counts each write as progress and is otherwise the stream it wraps."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        progress()
        return self._stream.write(text)

    def writelines(self, lines):
        progress()
        return self._stream.writelines(lines)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def prepare() -> None:
    folder = agent_dir()
    if folder is None:
        return
    die_with_parent()
    start_sentinel()
    rank = this_rank()
    path = folder / f"rank-{rank}.stacks"
    path.write_text("")  # a restarted rank's own file; appended to, so the watchdog may empty it between dumps
    stacks = open(path, "a")  # noqa: SIM115 (open for the process's lifetime)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    start()
    sys.stdout, sys.stderr = _Beating(sys.stdout), _Beating(sys.stderr)
    watch_for_a_process_group()


def run(argv: list[str]) -> None:
    """argv as Python's command line after `python`: a script path or -m and a module, then its arguments."""
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` puts it
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    prepare()
    if os.environ.get(RUN_ONCE_ENV) == "1":
        at_exit.collect_in_spawned_children()
    try:
        run(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code
        note_the_end(code if isinstance(code, int) else (0 if code is None else 1))
        at_exit.collect_while_alive()
        raise
    except Exception as err:  # noqa: BLE001 (the user's error: its traceback from its own frames, exit 1)
        note_the_end(1)
        # The user's traceback from the user's first frame, as torchrun's @record shows it: not runpy's and ours.
        tb = err.__traceback__
        while tb is not None and (tb.tb_frame.f_code.co_filename == __file__ or
                                  os.path.basename(tb.tb_frame.f_code.co_filename) in ("<frozen runpy>", "runpy.py")):
            tb = tb.tb_next
        traceback.print_exception(type(err), err, tb)
        sys.stderr.flush()
        raise SystemExit(1) from None
    except BaseException:  # KeyboardInterrupt: Python's own end (it exits by the signal)
        note_the_end(1)
        raise
    note_the_end(0)
    at_exit.collect_while_alive()


if __name__ == "__main__":
    main()
