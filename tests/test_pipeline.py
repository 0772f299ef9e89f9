"""Pipeline stages (trainer/parallel/pipeline.py): where a model is cut, what each stage is, and two stages trained at
two real processes against one process accumulating the same micro-batches."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from helpers import (REPO, RUN_TIMEOUT_S, assert_usage_error, clean_env, dirs_args, final_params, free_port,
                     read_scalars, read_summary, train_ok)
from trainer.checkpoint import sharded
from trainer.checkpoint.store import list_checkpoints
from trainer.core.errors import UsageError
from trainer.parallel.pipeline import Layout, balanced, cut, split_points


def _user_code(name: str):
    """A script of tests/user_code as a module (its model and data, for the reference), sys.path untouched."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "user_code" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pipeline_stages = _user_code("pipeline_stages")


# ---------------------------------------------------------------- the layout and the cut
def test_a_replicas_stages_are_consecutive_ranks_and_a_stages_replicas_one_per_replica():
    layout = Layout.of(rank=5, world_size=8, stages=2)
    assert (layout.stage, layout.replica, layout.replicas) == (1, 2, 4) and layout.last and not layout.first
    assert layout.pipeline_ranks() == [4, 5] and layout.replica_ranks() == [1, 3, 5, 7]


@pytest.mark.parametrize("counts, stages, starts", [
    ([1, 1, 1, 1], 2, [2]),
    ([10, 1, 1, 1, 1], 2, [1]),        # one heavy block alone
    ([1, 2, 3, 4, 5, 6], 3, [3, 5]),   # 6 | 9 | 6: the largest part, 9, is as small as it gets
    ([5, 5], 2, [1]),
])
def test_the_balanced_cut_makes_the_largest_stage_as_small_as_it_can(counts, stages, starts):
    assert balanced(counts, stages) == starts


@pytest.mark.parametrize("classes", [1000, 10])
def test_resnet50_cut_in_two_keeps_at_most_six_tenths_of_its_parameters_in_either_stage(classes):
    """Issue 42's memory goal, for the parameters (their gradients and optimizer state follow them): layer4's 15 M
    parameters are more than half of the model, and its blocks alone leave 0.57 (1000 classes) or 0.62 (10) in the
    larger stage; the cut goes inside layer4.0 instead. The stages, run one after the other, are the model's forward
    to the bit (the block's input crosses the cut beside its branch)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=classes).eval()
    points = split_points(model, 2, "", "--pipeline-split", "resnet50")
    assert len(points) == 1 and points[0].startswith("layer4.0."), points
    x = torch.randn(2, 3, 32, 32)
    stages = cut(model, x, points, training=False)
    total = sum(p.numel() for p in model.parameters())
    shares = [sum(p.numel() for p in stage.parameters()) / total for stage in stages]
    assert max(shares) <= 0.6 and sum(shares) == pytest.approx(1), shares
    with torch.no_grad():
        out = stages[1](*stages[0](x)) if isinstance(stages[0](x), tuple) else stages[1](stages[0](x))
        out = out[0] if isinstance(out, tuple) else out
        assert torch.equal(out, model(x))


@pytest.mark.parametrize("name, options, expected", [
    ("vit_b_16", {"image_size": 32}, ["encoder.layers.encoder_layer_6"]),  # the class token and the positions: stage 0
    ("vgg11", {}, ["classifier.3"]),  # the convolutions and the first of the classifier's 102 M weights: stage 0
])
def test_a_vit_and_a_vgg_are_cut_where_their_parameters_balance_and_their_stages_are_their_forward(name, options,
                                                                                                  expected):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10, **options).eval()
    points = split_points(model, 2, "", "--pipeline-split", name)
    assert points == expected
    x = torch.randn(2, 3, 32, 32)
    first, second = cut(model, x, points, training=False)
    with torch.no_grad():
        middle = first(x)
        out = second(*middle) if isinstance(middle, tuple) else second(middle)
        assert torch.equal(out[0] if isinstance(out, tuple) else out, model(x))


@pytest.mark.parametrize("given, stages, problem, fix", [
    ("layer3,layer4", 2, "2 names for 2 stages", "name the 1 module that begins each stage after the first"),
    ("layer5", 2, "'layer5' is not a module of resnet18", "did you mean layer"),
    ("layer4,layer2", 3, "are not in the model's order", "in the order the model runs them"),
])
def test_a_split_that_does_not_fit_the_model_is_one_line_naming_the_setting(given, stages, problem, fix):
    with pytest.raises(UsageError) as raised:
        split_points(torchvision.models.resnet18(), stages, given, "--pipeline-split", "resnet18")
    line = str(raised.value)
    assert line.startswith("--pipeline-split: ") and problem in line and fix in line, line


def test_more_stages_than_blocks_names_the_stages_setting():
    with pytest.raises(UsageError) as raised:
        split_points(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 3, "", "--pipeline-split", "tiny")
    assert str(raised.value).startswith("--pipeline-stages: 3 stages, and tiny has 2 blocks"), str(raised.value)


def test_the_stages_of_a_resnet_are_its_own_forward_under_its_own_names():
    """ResNet's forward flattens before its head: the traced stages run that too. Outputs, gradients and BatchNorm's
    running statistics equal the eager model's, bit for bit, and the stages' state dicts are the model's."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    eager = torchvision.models.resnet18(num_classes=10)
    eager.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 32, 32)
    stages = cut(model, x, ["layer3"])
    out = stages[1](stages[0](torch.randn(4, 3, 32, 32).copy_(x)))
    out = out[0] if isinstance(out, tuple) else out
    expected = eager(x)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    mine = {**dict(stages[0].named_parameters()), **dict(stages[1].named_parameters())}
    assert set(mine) == {name for name, _ in eager.named_parameters()}
    assert all(torch.equal(mine[name].grad, p.grad) for name, p in eager.named_parameters())
    state = {**stages[0].state_dict(), **stages[1].state_dict()}
    assert set(state) == set(eager.state_dict())
    assert all(torch.equal(state[name], value) for name, value in eager.state_dict().items())
    assert mine["conv1.weight"] is model.conv1.weight  # the stages share the model's tensors


# ---------------------------------------------------------------- real processes
def reference_run(replicas: int) -> tuple[dict[str, torch.Tensor], list[float], torch.Tensor]:
    """One process training the same micro-batches with gradient accumulation (each replica's half of a batch, cut
    into the same micro-batches): its state dict, its losses (replica 0's), and replica 0's part of the first batch
    through the trained model in evaluation mode."""
    # One thread, as torchrun gives each worker (OMP_NUM_THREADS=1): a CPU convolution's weight gradient is summed in
    # an order that follows the thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = pipeline_stages.model()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        loss_fn, m = nn.CrossEntropyLoss(), pipeline_stages.MICROBATCHES
        losses = []
        for inputs, targets in pipeline_stages.batches():
            for replica, (xs, ys) in enumerate(zip(inputs.chunk(replicas), targets.chunk(replicas))):
                for x, y in zip(xs.chunk(m), ys.chunk(m)):
                    loss = loss_fn(reference(x), y) / m
                    (loss / replicas).backward()
                    if replica == 0:
                        losses.append(float(loss.detach()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        reference.eval()
        with torch.no_grad():
            evaluated = reference(next(iter(pipeline_stages.batches()))[0].chunk(replicas)[0])
        return reference.state_dict(), losses, evaluated
    finally:
        torch.set_num_threads(threads)


# The built-in loop's tests below run every schedule at P = 2 and, across two hosts, at P = 2 x D = 2; these runs of
# the stages alone (no engine) keep what those do not show: the evaluation's output to the bit, and the replicas'
# average under a schedule that runs two forwards before its first backward (gpipe) at one host.
@pytest.mark.parametrize("nproc, schedule", [(2, "1f1b"), (4, "gpipe")])
def test_two_stages_train_as_one_process_accumulating_the_same_micro_batches(tmp_path, nproc, schedule):
    """2 processes: one replica of the two stages, bit-identical to one process, and so is its evaluation of a batch
    through the stages. 4: two replicas, each stage's gradients averaged over them by DistributedDataParallel, within
    1e-5 (the average sums in another order), and so are the losses computed with them. interleaved-1f1b: four pieces, two on each process. Each phase's
    receives are posted ahead (the second stage's activations, the first's gradients): as a micro-batch's forward or
    backward begins, its own and every later micro-batch's receive of that phase are in flight."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           f"--master-port={free_port()}", str(REPO / "tests" / "user_code" / "pipeline_stages.py"),
                           str(tmp_path), schedule], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    replicas = nproc // 2
    saved = {(stage, replica): torch.load(tmp_path / f"stage-{stage}-{replica}.pt", weights_only=True)
             for stage in (0, 1) for replica in range(replicas)}
    expected, losses, evaluated = reference_run(replicas)
    for replica in range(replicas):
        state = {**saved[0, replica]["state"], **saved[1, replica]["state"]}
        assert set(state) == set(expected)
        if replicas == 1:
            different = [name for name, value in expected.items() if not torch.equal(state[name], value)]
            assert not different, different
        else:  # the parameters; BatchNorm's running statistics are replica 0's, as DistributedDataParallel keeps them
            for name, _ in pipeline_stages.model().named_parameters():
                torch.testing.assert_close(state[name], expected[name], rtol=1e-5, atol=1e-7)
    assert saved[0, 0]["losses"] == [] and len(saved[1, 0]["losses"]) == len(losses)
    if replicas == 1:
        assert saved[1, 0]["losses"] == losses
    else:  # computed with those parameters: one loss in 16 rounded otherwise on an AVX-512 machine (3e-8 apart)
        torch.testing.assert_close(torch.tensor(saved[1, 0]["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    assert saved[0, 0]["evaluated"] is None  # the output is the last stage's
    if replicas == 1:  # through the stages in evaluation mode (BatchNorm's running statistics), as the model computes
        assert torch.equal(saved[1, 0]["evaluated"], evaluated)
    m = pipeline_stages.MICROBATCHES
    assert losses[-m:] != losses[:m]  # it trained: the last step's losses are not the first's
    # Each phase's receives posted ahead (gloo): as micro-batch i's forward or backward begins, i and every later one's
    # receive of that phase are in flight (the schedules' orders differ: compared sorted).
    posted = sorted((phase, i, list(range(i, m))) for _ in range(pipeline_stages.STEPS)
                    for phase in ("forward", "backward") for i in range(m))
    for replica in range(replicas):
        for stage, receives in ((1, "forward"), (0, "backward")):  # the activations, then the gradients
            assert sorted(saved[stage, replica]["ahead"]) == [(p, i, ahead if p == receives else [])
                                                              for p, i, ahead in posted]


# ---------------------------------------------------------------- the built-in loop
PIPELINE_RUN = ["--model", "cnn", "--synthetic-size", "512", "--epochs", "1", "--max-steps", "20", "--log-every", "5",
                "--val-every", "0"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as torchrun gives each of several workers: the same kernels' sum orders
ONE_PROCESS = ["--batch-size", "4", "--grad-accum", "4"]  # each step's 16 samples as 4 micro-batches of 4
TWO_STAGES = ["--batch-size", "16", "--pipeline-stages", "2", "--pipeline-microbatches", "4"]


def finished(tmp_path_factory, name: str, layout: list[str], nproc: int) -> Path:
    """The run of 20 steps at a layout, checkpointed at steps 10 and 20."""
    root = tmp_path_factory.mktemp(name)
    train_ok([*PIPELINE_RUN, *layout, "--checkpoint-every", "10", *dirs_args(root)], root, nproc=nproc,
             env=ONE_THREAD, forked=True)
    return root


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory) -> Path:
    """One process training each step's 16 samples as 4 micro-batches of 4, accumulated."""
    return finished(tmp_path_factory, "accumulated", ONE_PROCESS, 1)


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    """Two stages (1f1b) of the same run."""
    return finished(tmp_path_factory, "staged", TWO_STAGES, 2)


def model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return sharded.full_model_state(checkpoint) if checkpoint.is_dir() else \
        torch.load(checkpoint, weights_only=True)["model"]


@pytest.mark.parametrize("start, resume, nproc, expected", [
    ("staged", TWO_STAGES, 2, "staged"),
    ("staged", ONE_PROCESS, 1, "accumulated"),
    ("accumulated", TWO_STAGES, 2, "staged"),
], ids=["two stages, again at two stages", "two stages, at one process", "one process, at two stages"])
def test_a_mid_epoch_checkpoint_resumes_at_any_layout_bit_identical(request, tmp_path, start, resume, nproc,
                                                                     expected):
    """Step 10 of 32 in the epoch, resumed (at the layout that wrote it, or the other: a DCP directory of two
    stages' parts into one whole model, one model's file into two stages) and trained to step 20: the weights are
    the uninterrupted run's, bit for bit (the two layouts train the same micro-batches bit-identically)."""
    source = request.getfixturevalue(start) / "checkpoints"
    name = next(path.name for path in source.iterdir() if path.name.startswith("step-00000010"))
    (tmp_path / "from").mkdir()
    copy = tmp_path / "from" / name
    (shutil.copytree if (source / name).is_dir() else shutil.copy)(source / name, copy)
    train_ok([*PIPELINE_RUN, *resume, "--resume", str(copy), *dirs_args(tmp_path)], tmp_path, nproc=nproc,
             env=ONE_THREAD, forked=True)
    resumed = model_state(list_checkpoints(tmp_path / "checkpoints")[0])
    reference = model_state(list_checkpoints(request.getfixturevalue(expected) / "checkpoints")[0])
    different = [key for key in reference if not torch.equal(resumed[key], reference[key])]
    assert not different, different
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == 10


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_the_built_in_loop_at_two_stages_trains_bit_identical_to_one_process_accumulating(accumulated, request,
                                                                                         tmp_path, schedule):
    """Issue 42's goal at P = 2: the weights after 20 steps (each of 16 samples, cut into 4 pipeline micro-batches)
    are those of one process accumulating the same micro-batches, bit for bit; the checkpoint is the unsplit
    model's state dict (a DCP directory of both stages' parts), which trainer-export writes as one plain state dict;
    the loss falls; one summary.json."""
    if schedule == "1f1b":  # the `staged` fixture's run is this one (1f1b is the default; its step-10 checkpoint aside)
        run = request.getfixturevalue("staged")
    else:
        run = tmp_path
        train_ok([*PIPELINE_RUN, *TWO_STAGES, "--pipeline-schedule", schedule, *dirs_args(run)], tmp_path, nproc=2,
                 env=ONE_THREAD, forked=True)
    staged = sharded.full_model_state(list_checkpoints(run / "checkpoints")[0])
    reference = final_params(accumulated / "checkpoints")
    assert set(staged) == set(reference)
    different = [name for name in reference if not torch.equal(staged[name], reference[name])]
    assert not different, different
    if schedule == "1f1b":  # trainer-export: the stages' directory as the whole model's plain state dict
        exported = tmp_path / "model.pt"
        done = subprocess.run([sys.executable, "-m", "trainer.cli.export", str(run / "checkpoints"),
                               str(exported)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        plain = torch.load(exported, weights_only=True)
        assert set(plain) == set(reference) and all(torch.equal(plain[name], reference[name]) for name in reference)
    summary, expected = read_summary(run / "runs"), read_summary(accumulated / "runs")
    assert summary["global_step"] == 20 and summary["samples_seen"] == expected["samples_seen"] == 320
    # The logged loss: the pipeline's sums its micro-batches' shares, the accumulation averages them (float rounding).
    losses = [value for _, value in read_scalars(run / "runs")["Loss/train"]]
    assert losses == pytest.approx([value for _, value in read_scalars(accumulated / "runs")["Loss/train"]],
                                   rel=1e-6)
    assert losses[-1] < losses[0], losses


def test_fsdp_over_the_replicas_of_two_stages_trains_and_validates_as_one_process(tmp_path):
    """--strategy fsdp at P = 2 x D = 2: each stage's pieces sharded over its two replicas (FSDP2 over the stage's
    replica group, the gradients reduce-scattered), the evaluation pieces gathered whole for validation. One epoch
    of 20 steps, validated at its end: the weights (a DCP directory of the shards) and the validation's loss and
    accuracy are one process's accumulating the same micro-batches, within 1e-5. The validation samples are the
    replica's on each of its stages (the first stage's inputs, the last stage's targets), and a replica with fewer
    batches than the other does not wait for it. Its step-10 checkpoint resumed at two stages of one replica ends
    there too."""
    # lr 0.05: the cnn is unstable at 0.1 (compose.yaml), and an unstable run turns the sums' rounding into 1e-4.
    # 325 samples: 20 steps of 16, and 65 to validate, 33 on one replica (5 batches of 8) and 32 on the other (4).
    epoch = ["--synthetic-size", "325", "--val-every", "1", "--lr", "0.05"]
    roots = {name: tmp_path / name for name in ("one", "fsdp")}
    train_ok([*PIPELINE_RUN, *epoch, *ONE_PROCESS, *dirs_args(roots["one"])], tmp_path, nproc=1, env=ONE_THREAD, forked=True)
    train_ok([*PIPELINE_RUN, *epoch, "--batch-size", "8", "--pipeline-stages", "2", "--pipeline-microbatches", "2",
              "--strategy", "fsdp", "--checkpoint-every", "10", *dirs_args(roots["fsdp"])], tmp_path, nproc=4,
             env=ONE_THREAD, forked=True)
    # Its step-10 directory of shards, resumed at two stages of one replica (ddp): another layout, the same run.
    middle = next(path for path in (roots["fsdp"] / "checkpoints").iterdir() if path.name.startswith("step-00000010"))
    (tmp_path / "from").mkdir()
    shutil.copytree(middle, tmp_path / "from" / middle.name)
    roots["resumed"] = tmp_path / "resumed"
    train_ok([*PIPELINE_RUN, *epoch, *TWO_STAGES, "--resume", str(tmp_path / "from" / middle.name),
              *dirs_args(roots["resumed"])], tmp_path, nproc=2, env=ONE_THREAD, forked=True)
    one, sharded_run, resumed = (model_state(list_checkpoints(root / "checkpoints")[0]) for root in roots.values())
    assert set(one) == set(sharded_run) == set(resumed)
    for name, value in one.items():
        torch.testing.assert_close(sharded_run[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6)
    assert read_summary(roots["resumed"] / "runs")["resumed_from_step"] == 10
    expected, summary = (read_summary(roots[name] / "runs") for name in ("one", "fsdp"))
    assert summary["world_size"] == 4 and summary["global_step"] == expected["global_step"] == 20
    assert summary["val_acc1"] == expected["val_acc1"] and summary["val_loss"] == pytest.approx(expected["val_loss"],
                                                                                                rel=1e-5)


def test_the_recipe_at_two_stages_clips_by_the_whole_models_norm_and_mixes_alike_on_every_stage(tmp_path):
    """--clip-grad-norm with pipeline stages: the norm is the whole model's (each stage's squared norm summed over
    the stages), so every stage clips by the same factor, as one process does. --mixup-alpha: the first stage's inputs
    and the last stage's targets are mixed by the same draw (keyed by the replica, not the rank). 10 steps, clipped at
    every one: the weights and the logged Grad/norm are one process's training the same batches, within 1e-5 (the
    gradient and the norm sum in another order)."""
    clip = ["--clip-grad-norm", "0.01", "--mixup-alpha", "0.4", "--max-steps", "10", "--log-every", "1"]
    runs = {}
    # One process trains each step's 16 samples at once: mixup draws once per loop micro-batch, and the stages'
    # loop micro-batch is the 16 (the pipeline's four are cut after the mix).
    for name, layout, nproc in (("one", ["--batch-size", "16"], 1), ("staged", TWO_STAGES, 2)):
        root = tmp_path / name
        train_ok([*PIPELINE_RUN, *layout, *clip, *dirs_args(root)], tmp_path, nproc=nproc, env=ONE_THREAD, forked=True)
        state = list_checkpoints(root / "checkpoints")[0]
        runs[name] = (model_state(state), [value for _, value in read_scalars(root / "runs")["Grad/norm"]])
    (one, one_norms), (staged, staged_norms) = runs["one"], runs["staged"]
    assert len(one_norms) == 10 and min(one_norms) > 0.01  # it clipped at every step
    assert staged_norms == pytest.approx(one_norms, rel=1e-5)
    for name, value in one.items():
        torch.testing.assert_close(staged[name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("args, setting, problem", [
    (["--pipeline-stages", "3"], "--pipeline-stages", "3 stages do not divide world size 2"),
    (["--pipeline-stages", "2", "--batch-size", "6", "--pipeline-microbatches", "4"], "--pipeline-microbatches",
     "4 does not divide the 6 samples per process"),
    (["--pipeline-stages", "2", "--local-sgd-period", "4"], "--local-sgd-period", "averages whole models"),
    (["--pipeline-stages", "2", "--strategy", "fsdp", "--fsdp-cpu-offload"], "--fsdp-cpu-offload",
     "offloads the whole model's shards"),
    (["--pipeline-stages", "2", "--pipeline-split", "features.3,head"], "--pipeline-split", "2 names for 2 stages"),
    (["--pipeline-stages", "2", "--pipeline-split", "feature.6"], "--pipeline-split",
     "'feature.6' is not a module of cnn (did you mean features.6?"),
    (["--pipeline-stages", "2", "--pipeline-split", "features.7"], "--pipeline-split",
     "'features.7' holds no parameters, and a stage begins with weights (did you mean head?"),
    (["--pipeline-stages", "2", "--pipeline-schedule", "interleaved-1f1b", "--pipeline-split", "features.3"],
     "--pipeline-split", "1 name cuts the model into 2 pieces, and interleaved-1f1b gives each of the 2 stages 2 or "
     "more"),
    (["--pipeline-stages", "2", "--pipeline-schedule", "interleaved-1f1b", "--pipeline-microbatches", "5",
      "--batch-size", "10"], "--pipeline-microbatches", "interleaved-1f1b runs 5 micro-batches in 2 rounds"),
    (["--pipeline-stages", "2", "--model", "autoencoder"], "--pipeline-stages",
     "autoencoder computes its own loss from its inputs (compute_loss)"),
], ids=["stages do not divide the world", "micro-batches do not divide the batch", "local SGD", "fsdp's offload",
        "a split of the wrong length", "a split that is no module", "a split at an activation",
        "interleaved with one piece per stage", "interleaved micro-batches out of rounds", "a model with its own loss"])
def test_pipeline_mistakes_are_one_line_and_exit_2_with_nothing_written(tmp_path, args, setting, problem):
    """Through trainer-launch at 2 processes: refused before any worker starts, one line, exit 2. The split's names
    and the blocks a default cut needs are checked against the built-in model, built on the meta device in the
    launcher."""
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", *PIPELINE_RUN, *args, *dirs_args(tmp_path)],
                            cwd=tmp_path, env=clean_env({"NPROC_PER_NODE": "2", "PREFLIGHT": "0"}),
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    line = assert_usage_error(result, setting)
    assert problem in line, line
    assert "+ torchrun" not in result.stdout + result.stderr  # no worker started
    assert not list((tmp_path / "checkpoints").glob("step-*")), "a checkpoint was written"


def test_a_script_on_trainer_api_trains_in_two_stages_under_the_launcher(tmp_path):
    """The script door: TRAIN_PIPELINE_STAGES=2 under trainer-launch, the loop docs/your-code.md shows; it learns,
    checkpoints the unsplit model's state dict, and writes one summary."""
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch",
                             str(REPO / "tests" / "user_code" / "pipeline_script.py"), "--out", str(tmp_path)],
                            cwd=tmp_path, env=clean_env({"NPROC_PER_NODE": "2", "PREFLIGHT": "0",
                                                         "TRAIN_PIPELINE_STAGES": "2"}),
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "runs")
    assert summary["status"] == "completed" and summary["global_step"] == 3 * 256 // 16, summary
    losses = [value for _, value in read_scalars(tmp_path / "runs")["Loss/train"]]
    assert losses[-1] < 0.5 * losses[0], losses
    state = model_state(list_checkpoints(tmp_path / "checkpoints")[0])
    assert set(state) == {f"{layer}.{kind}" for layer in (0, 2, 4) for kind in ("weight", "bias")}


def test_an_elastic_pipeline_job_takes_the_restart_path_and_says_why():
    """In-place recovery replicates whole models across the hosts: an elastic job of pipeline stages (the built-in
    loop's flag, or a script's TRAIN_PIPELINE_STAGES) restarts its workers instead, and its recovery line says why."""
    import json

    env = clean_env({"NNODES": "1:2", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "2"})
    for args, extra in ((["--model", "cnn", "--pipeline-stages", "2"], {}),
                        ([str(REPO / "tests" / "user_code" / "pipeline_script.py"), "--out", "x"],
                         {"TRAIN_PIPELINE_STAGES": "2"})):
        done = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", *args], env={**env, **extra},
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, done.stderr
        facts = json.loads(done.stdout)
        assert facts["recovery"] == "restart" and "pipeline stages cut the model across processes" in \
            facts["recovery_line"], facts


# 1f1b only across hosts (CI's time): gpipe's P = 2 x D = 2 runs on one host above, and the schedule does not change
# what crosses the link (each stage's gradients, averaged across its replicas).
@pytest.mark.parametrize("schedule", ["1f1b"])
def test_two_stages_on_each_of_two_hosts_train_as_one_process_accumulating(hosts, accumulated, tmp_path, launches,
                                                                           schedule):
    """P = 2 x D = 2 as the tutorials draw it: each host (a network namespace, tests/netns.py) runs a replica's two
    stages (NPROC_PER_NODE=2: the activations stay on the host), the stages' gradients are averaged across the hosts
    over the veth link. Each replica trains half of every step's 16 samples as 2 micro-batches of 4: the weights after
    20 steps are the one process's accumulating 4 micro-batches of 4, within 1e-5 (the average sums in another
    order); one summary for the job, the checkpoint the unsplit model's (one directory both hosts write, as hosts
    share a file system)."""
    from fault_helpers import Launch
    from netns import MASTER_ADDR

    args = [*PIPELINE_RUN, "--batch-size", "8", "--pipeline-stages", "2", "--pipeline-microbatches", "2",
            "--pipeline-schedule", schedule, "--checkpoint-every", "10", *dirs_args(tmp_path)]
    nodes = []
    for host in hosts:
        env = {"NNODES": "2", "NODE_RANK": str(host.node_rank), "NPROC_PER_NODE": "2", "MASTER_ADDR": MASTER_ADDR,
               "MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": host.veth, "PREFLIGHT": "0", **ONE_THREAD}
        nodes.append(Launch(args, tmp_path, env, name=f"node{host.node_rank}", prefix=host.prefix))
        launches.append(nodes[-1])
    for node in nodes:
        assert node.wait(RUN_TIMEOUT_S) == 0, node.output()[-4000:]
    assert hosts[0].bytes_through_link() > 2 ** 16  # the stages' gradients crossed between the hosts
    summary = read_summary(tmp_path / "runs")
    assert summary["global_step"] == 20 and summary["world_size"] == 4 and summary["samples_seen"] == 320, summary
    staged = sharded.full_model_state(list_checkpoints(tmp_path / "checkpoints")[0])
    reference = final_params(accumulated / "checkpoints")
    assert set(staged) == set(reference)
    worst = max(float(((staged[name] - value).abs() / value.abs().clamp_min(1e-3)).max())
                for name, value in reference.items())
    for name, value in reference.items():
        torch.testing.assert_close(staged[name], value, rtol=1e-5, atol=1e-6, msg=f"{name}: worst {worst}")
