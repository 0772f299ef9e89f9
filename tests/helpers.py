"""Shared helpers for the trainer tests: real subprocesses, real files, read back the way a user would.

Every run gets a clean environment (no inherited rank, Slurm or TRAIN_* variables, no GPU) with
OMP_NUM_THREADS=1, and runs in a temporary directory so relative defaults (./runs, ./checkpoints,
.env) never touch the repository.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Mapping, NoReturn, Sequence

import pytest
import torch

from trainer.checkpoint.store import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
# A run of a few steps takes seconds; this bound only turns a hang into a failure.
RUN_TIMEOUT_S = 300
# The spec says a bad setting fails within 5 s; on a loaded 2-core CI runner importing torch alone can
# take that long, so the bound here is looser. What it catches is a hang: the rendezvous waits 900 s.
BAD_INPUT_TIMEOUT_S = 30

INHERITED_TOPOLOGY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "MAX_RESTARTS", "RDZV_TIMEOUT",
                      "PREFLIGHT", "TORCHELASTIC_RUN_ID", "JOB_COMPLETION_INDEX", "HANG_TIMEOUT", "SCRIPT_LAUNCH",
                      "TRAINER_AGENT_DIR", "TRAINER_AGENT_PID", "TRAINER_STORE_PREFIX", "STOP_GRACE_PERIOD",
                      "COMPOSE_STOP_GRACE_PERIOD", "TERMINATION_GRACE_PERIOD_SECONDS",
                      "TRAINER_RUN_STARTED")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment minus anything that would change the topology or the options."""
    env = {k: v for k, v in os.environ.items()
           if k not in INHERITED_TOPOLOGY and not k.startswith(("TRAIN_", "SLURM_", "TORCHELASTIC_", "PET_", "SKYPILOT_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the suite is CPU + gloo, the same on a GPU host
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def srun_task_env(procid: int, ntasks: int, nodelist: str = "localhost", job_id: int = 4242) -> dict[str, str]:
    """What `srun --ntasks=<ntasks>` gives task <procid> of a one-node step (Slurm's env_array_for_step and
    the task's own SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID): src/common/env.c, srun(1) OUTPUT ENVIRONMENT."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
            "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_STEP_NODELIST": nodelist,
            "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid), "SLURM_NODEID": "0"}


# Ports for runs come from below the kernel's ephemeral range: a port picked by binding port 0 comes from
# that range, and any outgoing connection on the machine (gloo's, another test's) could be given it between
# the pick and the run's bind. A lock file per port keeps concurrent test sessions from picking the same one.
PORTS = (20000, 32768)
PORT_LOCKS = Path(tempfile.gettempdir()) / f"ddp-trainer-test-ports-{os.getuid()}"
_ports_held: list = []  # the open, locked files: each port stays this process's until it exits


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on, never handed out before to this or another test session on this machine."""
    PORT_LOCKS.mkdir(exist_ok=True)
    low, high = PORTS[0], min(PORTS[1], _ephemeral_low())
    for _ in range(2000):
        port = random.randrange(low, high)
        lock = open(PORT_LOCKS / str(port), "a")  # noqa: SIM115 (held until this process exits)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                lock.close()
                continue
        _ports_held.append(lock)
        return port
    raise RuntimeError(f"no free port in {low}-{high} after 2000 tries")


def skip_or_fail_in_ci(reason: str) -> NoReturn:
    """A test this machine cannot run (it lacks root, a tool, a capability) skips and says why. In CI
    (CI=true: root on a machine with everything installed, .ci/run) it fails instead: a skipped fault test
    checked nothing, and its row in docs/reliability.md would claim what no run showed."""
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def as_unprivileged(command: Sequence[str]) -> list[str]:
    """The command with file permissions in force even for root (CI runs as root, which reads and writes
    anything): setpriv drops the two capabilities that override them."""
    if os.geteuid() != 0:
        return list(command)
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]


def dirs_args(root: Path) -> list[str]:
    """Where a run under `root` writes: <root>/runs and <root>/checkpoints."""
    return ["--log-dir", str(root / "runs"), "--checkpoint-dir", str(root / "checkpoints")]


def trainer_command(args: Sequence[str], nproc: int | None) -> list[str]:
    """`python -m trainer` alone (nproc None) or under a real torchrun with nproc workers."""
    if nproc is None:
        return [sys.executable, "-m", "trainer", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), "-m", "trainer", *args]


def run_trainer(args: Sequence[str], cwd: Path, nproc: int | None = None, env: Mapping[str, str] | None = None,
                timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(trainer_command(args, nproc), cwd=cwd, env=clean_env(env), capture_output=True,
                          text=True, timeout=timeout)


# `python -m trainer` forked from one interpreter that has imported it (and torch) already: a run refused before
# training costs the refusal, not the 3-4 s of importing torch again (seconds more on a loaded runner), over the
# hundred-odd bad-input rows. The child is `python -m trainer` in all else: its own process, cwd, environment
# (torch and the trainer read theirs when called, not at import), sys.path[0] and argv, its exit through the
# interpreter's own (an exception's traceback, SystemExit's code), its stdout and stderr on their file descriptors.
_FORK_SERVER = r"""
import json, os, runpy, sys
import trainer.engine.inplace, trainer.engine.loop  # what `python -m trainer` imports before reading a setting
import torch.distributed.run  # torchrun's (a run's workers are interpreters of their own: it starts them)
sys.stdout.write("ready\n"); sys.stdout.flush()
while True:
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    sys.stdout.write(json.dumps({"pid": pid}) + "\n"); sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n"); sys.stdout.flush()
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
    os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.path[0] = request["cwd"]  # -m's: the working directory
sys.argv = ["-m", *request["args"]]
del json, null, fd, path, line, pid
# The interpreter's own end, but for freeing every module one by one: in a fork that touches each copied page
# of torch's, seconds a process of its own does not spend.
try:
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as stop:
    code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    if not isinstance(stop.code, int) and stop.code is not None:
        print(stop.code, file=sys.stderr)
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = 1
import atexit, threading
threading._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    stream.flush()
os._exit(code & 0xFF)
"""
_fork_server: subprocess.Popen | None = None


def run_trainer_forked(args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None,
                       timeout: float = RUN_TIMEOUT_S, nproc: int | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer *args` (under a torchrun of nproc workers, as run_trainer), forked from this test process's
    trainer server, which imported torch once: for a run refused before training, or a short one. Not for a run
    whose environment changes how Python starts (PYTHONPATH, a sitecustomize): the server started already."""
    assert not any(key.startswith("PYTHON") for key in env or {}), "the fork server's interpreter started already"
    module = "trainer"
    if nproc is not None:  # torchrun forked, its workers `python -m trainer` of their own
        module, args = "torch.distributed.run", ["--nproc-per-node", str(nproc), "--master-port", str(free_port()),
                                                 "-m", "trainer", *args]
    command = [sys.executable, "-m", module, *args]  # what it stands for
    global _fork_server
    if _fork_server is None or _fork_server.poll() is not None:
        _fork_server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=tempfile.gettempdir(),
                                        env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert _fork_server.stdout.readline() == "ready\n", "the trainer's fork server did not start"
    server = _fork_server
    with tempfile.TemporaryDirectory(prefix="forked-trainer-") as out:
        paths = {name: str(Path(out) / name) for name in ("stdout", "stderr")}
        for path in paths.values():
            Path(path).touch()
        server.stdin.write(json.dumps({"module": module, "args": list(args), "cwd": str(cwd), "env": clean_env(env),
                                       **paths}) + "\n")
        server.stdin.flush()
        pid = json.loads(server.stdout.readline())["pid"]
        timed_out = threading.Event()

        tree: list[str] = []

        def kill() -> None:  # a hang fails as subprocess.run's would, with what it said and where each process was
            timed_out.set()
            family = [pid, *descendants(pid)]
            tree.extend(_where(member) for member in family)
            for member in family:  # torchrun's workers too: none left running after the test
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)
        hung = threading.Timer(timeout, kill)
        hung.start()
        try:
            code = json.loads(server.stdout.readline())["exit"]
        finally:
            hung.cancel()
        stdout, stderr = (Path(paths[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        if timed_out.is_set():
            where = "\n[the processes when it timed out]\n" + "\n".join(tree)
            raise Hung(command, timeout, output=stdout, stderr=stderr + where)
    return subprocess.CompletedProcess(command, code, stdout, stderr)


class Hung(subprocess.TimeoutExpired):
    """A forked run that timed out: its message ends with the tail of what it wrote to stderr and where each of its
    processes was (a hang seen once in CI must say where it hung)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{(self.stderr or '')[-6000:]}"


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def _where(pid: int) -> str:
    """A process's command line, state and the kernel function it waits in."""
    proc = Path("/proc") / str(pid)
    try:
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        state = (_stat_fields(pid) or ["gone"])[0]
        wchan = (proc / "wchan").read_text(errors="replace") if (proc / "wchan").exists() else "?"
        threads = len(list((proc / "task").iterdir()))
    except OSError:
        return f"{pid}: gone"
    return f"{pid}: state {state}, waits in {wchan or '-'}, {threads} thread(s): {cmdline[:300]}"


def train_ok(args: Sequence[str], cwd: Path, nproc: int | None = None,
             env: Mapping[str, str] | None = None, forked: bool = False) -> subprocess.CompletedProcess:
    """forked: through run_trainer_forked, the torch import of `python -m trainer` (or of torchrun) paid once per
    test process."""
    result = run_trainer_forked(args, cwd, env, nproc=nproc) if forked else run_trainer(args, cwd, nproc, env)
    assert result.returncode == 0, f"trainer exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def finished_run(root: Path, args: Sequence[str], steps: int, nproc: int = 2, forked: bool = False) -> Path:
    """A run of `args` under root (see dirs_args) that must end at `steps`; returns root."""
    train_ok([*args, *dirs_args(root)], root, nproc=nproc, forked=forked)
    assert read_summary(root / "runs")["global_step"] == steps
    return root


def assert_usage_error(result: subprocess.CompletedProcess, setting: str) -> str:
    """The documented bad-input contract: exit 2, exactly one stderr line `error: <setting>: ...`."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, f"exit {result.returncode}, stderr:\n{result.stderr[-3000:]}"
    assert len(lines) == 1, f"expected one stderr line, got:\n{result.stderr[-3000:]}"
    assert lines[0].startswith(f"error: {setting}"), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    return lines[0]


def read_summary(log_dir: Path) -> dict:
    return json.loads((log_dir / "summary.json").read_text())


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under log_dir: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()[SCALARS]}


def checkpoint_steps(checkpoint_dir: Path) -> list[int]:
    """Steps of the committed checkpoints, oldest first."""
    return sorted(int(p.stem.split("-")[1]) for p in checkpoint_dir.glob("step-*.pt"))


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def mid_epoch_copy(run: Path, tmp_path: Path, step: int, steps_per_epoch: int) -> Path:
    """The run's checkpoint of `step`, checked to be mid-epoch, copied to tmp_path/from/ (so that a resume from it
    writes into a directory of its own): the copy's path."""
    saved = load_checkpoint(run / "checkpoints" / f"step-{step:08d}.pt")
    assert (saved["epoch"], saved["batch"]) == divmod(step, steps_per_epoch)  # really mid-epoch
    copy = tmp_path / "from" / f"step-{step:08d}.pt"
    copy.parent.mkdir()
    shutil.copy(run / "checkpoints" / copy.name, copy)
    return copy


def assert_identical(a, b, where: str = "", same_types: bool = False) -> None:
    """Every tensor of two nested states bit-identical. same_types: also the same containers, dtypes and key order
    (what a transport must keep, where a resume may turn a tuple into a list)."""
    if same_types:
        assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
        assert not same_types or a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        assert not same_types or list(a) == list(b), f"{where}: the keys in another order"
        for key in a:
            assert_identical(a[key], b[key], f"{where}/{key}", same_types)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]", same_types)
    else:
        assert a == b, f"{where}: {a} != {b}"


def final_params(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The model state of the newest checkpoint (the trainer always checkpoints its last step)."""
    return load_checkpoint(list_checkpoints(checkpoint_dir)[0])["model"]  # newest first


def max_param_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_same_params(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"{len(unequal)} tensors differ (max |diff| {max_param_difference(a, b):.3g}): {unequal[:5]}"


def files_under(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


# ------------------------------------------------------------------ dataset files in their real formats

def _random_bytes(count: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (count,), generator=gen, dtype=torch.uint8).tolist())


def write_cifar10(root: Path, per_batch: int = 8, test_size: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The CIFAR-10 python layout (root/cifar-10-batches-py: 5 pickled train batches, test_batch,
    batches.meta), tiny. Returns the train images (N x 3 x 32 x 32 uint8) and labels as written."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    import numpy as np

    images, labels = [], []
    for number, name in enumerate(["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                                   "data_batch_5", "test_batch"]):
        count = test_size if name == "test_batch" else per_batch
        data = np.frombuffer(_random_bytes(count * 3072, seed=number), dtype=np.uint8).reshape(count, 3072)
        batch_labels = [(number + i) % 10 for i in range(count)]
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": batch_labels, "data": data,
                         "filenames": [f"{name}_{i}.png" for i in range(count)]}, f)
        if name != "test_batch":
            images.append(torch.from_numpy(data.copy()).view(count, 3, 32, 32))
            labels += batch_labels
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"num_cases_per_batch": per_batch, "num_vis": 3072,
                     "label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                     "ship", "truck"]}, f)
    return torch.cat(images), torch.tensor(labels)


def write_mnist(root: Path, train_size: int = 32, test_size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncompressed MNIST idx files in root/MNIST/raw. Returns the train images (N x 28 x 28) and labels."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    written = {}
    for prefix, count, seed in (("train", train_size, 0), ("t10k", test_size, 1)):
        pixels = _random_bytes(count * 28 * 28, seed)
        labels = bytes(i % 10 for i in range(count))
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, count, 28, 28) + pixels)
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, count) + labels)
        written[prefix] = (torch.tensor(list(pixels), dtype=torch.uint8).view(count, 28, 28),
                           torch.tensor(list(labels)))
    return written["train"]


def write_image_folder(root: Path, classes: Iterable[str] = ("cat", "dog"), per_class: dict | None = None) -> None:
    """ImageNet-style root/train/<class>/*.png and root/val/<class>/*.png, small random images."""
    from PIL import Image

    per_class = per_class or {"train": 4, "val": 2}
    seed = 0
    for split, count in per_class.items():
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                seed += 1
                size = (40 + 8 * i, 36 + 4 * label)  # varied sizes: the resize/crop path has work to do
                pixels = _random_bytes(size[0] * size[1] * 3, seed)
                Image.frombytes("RGB", size, pixels).save(folder / f"{i}.png")


def run_bench_pair(out: Path, stacks: tuple[str, ...], nproc: int, ratio: str | Sequence[str], args: Sequence[str],
                   env: Mapping[str, str] | None = None, timeout: float = 600) -> dict:
    """`python -m bench` on two stacks (or more), which must succeed with what every such run shows: the rounds
    interleaved, every run's figure its own record's, and each `ratio` ("a/b") the ratio of the two medians in
    the JSON and the markdown. Returns the JSON result."""
    command = [sys.executable, "-m", "bench", "--stacks", *stacks, "--nproc", str(nproc), "--rounds", "3",
               *args, "--out", str(out)]
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as bench:
        try:
            stdout, stderr = bench.communicate(timeout=timeout)
        except KeyboardInterrupt:  # a Ctrl-C reached bench too: it removes what it started (a container), then ends
            try:
                bench.wait(timeout=60)
            except subprocess.TimeoutExpired:
                bench.kill()
            raise
        except subprocess.TimeoutExpired:
            bench.kill()
            raise
    done = subprocess.CompletedProcess(command, bench.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(next(out.glob("bench-*.json")).read_text())
    assert [(r["round"], r["stack"]) for r in result["runs"]] == [(n, stack) for n in (1, 2, 3) for stack in stacks]
    # Each run's figure is the one that run wrote itself (the trainer's summary.json, a script's result.json).
    for run in result["runs"]:
        own = [Path(run["record"]) / name for name in ("summary.json", "result.json")]
        (written,) = [path for path in own if path.is_file()]
        own_figure = json.loads(written.read_text())["samples_per_second"]
        assert run["samples_per_second"] == pytest.approx(own_figure), (run, written, own_figure)
        assert run["samples_per_second"] > 0
    medians = result["stacks"][str(nproc)]
    speed = {(r["round"], r["stack"]): r["samples_per_second"] for r in result["runs"]}
    for name in [ratio] if isinstance(ratio, str) else ratio:
        numerator, denominator = name.split("/")
        value = result["ratios"][str(nproc)][name]
        assert value == pytest.approx(medians[numerator]["median"] / medians[denominator]["median"])
        assert f"{name} = {value:.3f}" in next(out.glob("bench-*.md")).read_text()
        # Within each round too: the runs' own ratios, their median and (3 rounds) their whole range.
        per_round = sorted(speed[n, numerator] / speed[n, denominator] for n in (1, 2, 3))
        paired = result["paired"][str(nproc)][name]
        assert paired["values"] == pytest.approx(per_round)
        assert (paired["median"], paired["low"], paired["high"]) == pytest.approx((per_round[1], per_round[0],
                                                                                  per_round[2]))
    return result


def photo(width: int, height: int, seed: int):
    """A photo-like RGB PIL image: smooth colour structure plus fine noise (JPEG treats it as it does photos)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, (4, 4, 3)).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), dtype=np.float32)
    return Image.fromarray(np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8))


def write_jpeg_folder(root: Path, classes: Iterable[str] = ("cat", "dog"), per_class: dict | None = None,
                      size: tuple[int, int] = (160, 120)) -> list[Path]:
    """root/<split>/<class>/<i>.jpg photo-like JPEGs (quality 90); returns the files written."""
    per_class = per_class or {"train": 4, "val": 2}
    written, seed = [], 0
    for split, count in per_class.items():
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                seed += 1
                path = folder / f"{i}.jpg"
                photo(size[0] + 8 * (i % 3), size[1], seed).save(path, quality=90)
                written.append(path)
    return written
