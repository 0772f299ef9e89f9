"""What a worker frees while its interpreter is whole, before the teardown can abort it (torch-free itself).

A DDP model keeps its process group alive through reference cycles; left to the interpreter's teardown, the group's
C++ threads were destroyed there and aborted the process after its last step ("terminate called without an active
exception", SIGABRT): the job failed after it had finished. The bootstrap collects them after the program returns;
a script run once on its host starts its ranks itself (mp.spawn), and those collect them at their exit; a process
that forms its group through the trainer (parallel.context.setup: the built-in loop, trainer.api) collects them at
its exit whatever started it (plain torchrun, srun).

A module of its own, not the bootstrap's: a spawned child finds what it calls at exit by this module's name (the
bootstrap runs as __main__).
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import inspect
import sys


def collect_while_alive() -> None:
    """Free what only reference cycles still hold, while the interpreter is whole: 2 to 6 of 15 plain-torchrun runs
    of the tutorials' ending (destroy_process_group(), then return) aborted at the teardown; 0 of 20 after this."""
    try:
        gc.collect()
    except Exception:  # noqa: BLE001 (a user's __del__ that raises: Python prints it; the run is over)
        pass


class _CollectedAtExit:
    """A script's mp.spawn target on its way to a spawned child: unpickled there it is the target itself (no frame
    of ours in the user's traceback), with collect_while_alive registered for the child's exit."""

    def __init__(self, fn):
        self.fn = fn

    def __reduce__(self):
        return _collected_at_exit, (self.fn,)

    def __call__(self, *args, **kwargs):  # never pickled (a fork start): the target as it is
        return self.fn(*args, **kwargs)


def collect_at_exit() -> None:
    """collect_while_alive at this process's exit (atexit: before the interpreter's teardown), once however often
    it is asked."""
    atexit.unregister(collect_while_alive)
    atexit.register(collect_while_alive)


def _collected_at_exit(fn):
    collect_at_exit()  # at the child's exit
    return fn


def collect_in_spawned_children() -> None:
    """The processes a script starts itself through torch.multiprocessing (mp.spawn, start_processes) collect their
    cycles at exit, as the bootstrap's own workers do (CI: the mp.spawn tutorial's rank 0 aborted after "rank 0 of 2
    done", and the job failed after it finished). torch's start_processes is public; that its spawn() calls the
    module's own is not: a torch that changes it only loses the collection."""
    from trainer.parallel.compat import private

    module = private("torch.multiprocessing.spawn.start_processes",
                     lambda: importlib.import_module("torch.multiprocessing.spawn"))
    original = getattr(module, "start_processes", None)
    if not callable(original) or getattr(original, "collects_at_exit", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def start_processes(fn, *args, **kwargs):
        if signature.bind(fn, *args, **kwargs).arguments.get("start_method", "spawn") in ("spawn", "forkserver"):
            fn = _CollectedAtExit(fn)  # a fork child never reaches the teardown (multiprocessing ends it, os._exit)
        return original(fn, *args, **kwargs)

    start_processes.collects_at_exit = True
    module.start_processes = start_processes
    torch_mp = sys.modules.get("torch.multiprocessing")
    if torch_mp is not None and getattr(torch_mp, "start_processes", None) is original:
        torch_mp.start_processes = start_processes
