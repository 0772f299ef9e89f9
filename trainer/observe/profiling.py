"""--profile-steps A:B: torch.profiler traces of optimizer steps A to B, as Chrome/Perfetto JSON.

Each chosen rank (--profile-ranks) writes <log-dir>/profile/rank<R>.steps<A>-<B>.pt.trace.json, with
the run's own step numbers as its ProfilerStep#N markers. Open a trace at https://ui.perfetto.dev
or chrome://tracing (TensorBoard's profiler plugin is deprecated). The profiler follows the optimizer's
step hook, so the training loop does not know about it; off (the default) it registers nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from trainer.config.settings import profile_rank_list, profile_window
from trainer.core.errors import UsageError

log = logging.getLogger("trainer")
PROFILE_DIR = "profile"


def check_window(cfg, total_steps: int | None) -> None:
    """Without --max-steps the run's length is known only once the data is: checked then, before any output
    (a script whose length is not known: not checked; a window beyond its end is never reached)."""
    window = profile_window(cfg.profile_steps)
    if window and total_steps is not None and window[1] > total_steps:
        raise UsageError("--profile-steps", f"{cfg.profile_steps} ends beyond the run's last step {total_steps}",
                         f"profile steps up to {total_steps}")


class StepProfiler:
    def __init__(self, cfg, ctx, optimizer, total_steps: int | None, start_step: int):
        self.prof = self.hook = None
        window = profile_window(cfg.profile_steps)
        if window is None:
            return
        check_window(cfg, total_steps)
        ranks = profile_rank_list(cfg.profile_ranks, ctx.world_size)
        directory = Path(cfg.log_dir) / PROFILE_DIR
        if ctx.is_main and start_step < window[1]:
            which = "every rank" if len(ranks) == ctx.world_size else "rank " + ",".join(map(str, ranks))
            log.info("profiling steps %d-%d on %s into %s (open a rank*.pt.trace.json at https://ui.perfetto.dev "
                     "or chrome://tracing)", max(window[0], start_step + 1), window[1], which, directory)
        if ctx.rank not in ranks or start_step >= window[1]:
            return
        self.first, self.last = max(window[0], start_step + 1), window[1]
        self.done = start_step  # optimizer steps finished
        self.ctx, self.cuda = ctx, ctx.device.type == "cuda"
        self.directory = directory
        self.hook = optimizer.register_step_post_hook(self._after_step)
        if self.done == self.first - 1:
            self._start()

    def _start(self) -> None:
        # Kineto logs every start and stop (and, on a CPU-only build, an ERROR line about CUDA devices) per
        # rank; level 5 keeps the run's log to our one hint line. A user's own setting wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity

        steps = self.last - self.first + 1
        offset = [0]

        def schedule(step: int) -> ProfilerAction:  # recording from the first step, saved after the last
            relative = step - offset[0]
            if relative < steps - 1:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if relative == steps - 1 else ProfilerAction.NONE

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self._save)
        self.prof.step_num = offset[0] = self.first  # the trace's ProfilerStep#N: the run's step numbers
        self.prof.start()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.done += 1
        if self.prof is None:
            if self.done == self.first - 1:
                self._start()
            return
        self.prof.step()  # after the last step: the trace is saved (_save)
        if self.done >= self.last:
            self.close()

    def _save(self, prof) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.ctx.rank}.steps{self.first}-{self.done}.pt.trace.json"
        prof.export_chrome_trace(str(path))

    def close(self) -> None:
        """A run that stops inside the window keeps the trace of the steps it made."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
