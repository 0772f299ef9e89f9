"""The step drivers (trainer/engine/drivers.py), each against a membership made up here: the micro-batches a step
trains, commit, abandon and take again. The whole runs are tests/test_training.py's (Replicated),
tests/test_speed_settings.py's local SGD (Averaging) and tests/test_inplace.py's (InPlace)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer.checkpoint.state import Position
from trainer.core.errors import UsageError
from trainer.data.sampling import ResumableSampler
from trainer.engine.drivers import InPlace, Replicated, Source


class Members:
    """A membership the test sets: rank, world size, the largest world, whether this host writes."""

    def __init__(self, rank: int = 0, world_size: int = 1, largest: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.largest = largest if largest is not None else world_size

    def writes(self) -> bool:
        return self.rank == 0


class Loop:
    """What Run does around a driver: the position it moves after each counted step, the no-sync calls it saw."""

    def __init__(self, accum: int):
        self.position, self.ended, self.synced = Position(), False, []
        self.accum = accum

    def source(self, model=None) -> Source:
        @contextlib.contextmanager
        def no_sync(last: bool):
            self.synced.append(last)
            yield

        return Source(self.accum, lambda: self.position, lambda: self.ended, lambda batches: batches, no_sync,
                      contextlib.nullcontext, model)

    def count(self, micro: int) -> None:
        p = self.position
        self.position = Position(p.epoch, p.batch + micro, p.step + 1)


def trained(driver, loop: Loop, batches):
    """Drive `driver` as Run.steps() does; the steps counted, each (its micro-batches, whether it ended the epoch)."""
    counted = []
    for step in driver.steps(batches, loop.source()):
        micro = list(step.counted)
        if driver.step_done(step):
            counted.append((micro, step.epoch_done))
            loop.count(step.micro)
    return counted


def test_replicated_counts_every_step_with_the_samples_of_every_rank_and_drops_a_partial_one():
    driver = Replicated(Members(rank=1, world_size=4))
    loop = Loop(accum=2)
    batches = [torch.full((3,), float(i)) for i in range(5)]  # two steps of 2, and one micro-batch left over
    steps = []
    for step in driver.steps(batches, loop.source()):
        micro = [int(b[0]) for b in step.counted]
        assert driver.commit(lambda: pytest.fail("nothing to combine: the strategy did in the backward"))
        assert driver.step_done(step)
        steps.append((micro, step.micro, step.samples, step.epoch_done))
        loop.count(step.micro)
    assert steps == [([0, 1], 2, 3 * 2 * 4, False), ([2, 3], 2, 3 * 2 * 4, True)]
    assert loop.synced == [False, True, False, True]  # the gradients exchanged at each step's last micro-batch
    assert driver.sampler_place() == (1, 4) and driver.shares() is None


def test_replicated_without_a_length_drops_a_short_last_group_and_stops_at_the_runs_end():
    driver, loop = Replicated(Members()), Loop(accum=2)
    assert [micro for micro, _ in trained(driver, loop, iter([torch.ones(1)] * 5))] == [[torch.ones(1)] * 2] * 2
    loop = Loop(accum=1)
    loop.ended = True
    assert trained(driver, loop, [torch.ones(1)] * 3) == []


def test_replicated_counts_a_step_taken_by_hand():
    Replicated(Members()).counted_by_hand(contextlib.nullcontext)  # nothing to refuse


class Replicas(Members):
    """A replica group's membership as inplace.InPlace has it, scripted: the quorum of each begin_step() (its shares)
    and the answer of each commit()."""

    def __init__(self, quorums: list[list[int]], commits: list[bool], largest: int = 2):
        super().__init__(0, 1, largest)
        self.quorums, self.commits = list(quorums), list(commits)
        self.shares: list[int] = []
        self.chain = None
        self.summed = None  # no gradients' buckets: run.wrap() makes them
        self.recovered_at: list[int] = []
        self.committed = 0

    def begin_step(self, meanwhile=None):
        got = None if meanwhile is None else meanwhile()  # the first batch, read at the shares before the quorum
        shares = self.quorums.pop(0) if self.quorums else self.shares
        changed = shares != self.shares
        self.shares = shares
        return changed, got

    def commit(self, parameters) -> bool:
        self.committed += 1
        return self.commits.pop(0)

    def recovered(self, step: int) -> None:
        self.recovered_at.append(step)


def loader(samples: int, batch_size: int, largest: int) -> DataLoader:
    data = TensorDataset(torch.arange(samples))
    return DataLoader(data, batch_size=batch_size, sampler=ResumableSampler(samples, batch_size, 0, largest, seed=3))


def test_in_place_takes_an_abandoned_step_again_from_the_same_position_with_the_new_shares():
    # The largest world is 2; the host trains both shares, then (a peer back) share 0 only. The second step's first
    # try is abandoned: it is taken again from the same position, its batches read again for the new membership.
    replicas = Replicas(quorums=[[0, 1], [0, 1], [0], [0]], commits=[True, False, True, True])
    driver, loop = InPlace(replicas), Loop(accum=1)
    batches = loader(12, 2, largest=2)  # 3 steps per epoch of the largest world's global batch of 4
    tried, ends = [], []
    for step in driver.steps(batches, loop.source()):
        tried.append(sorted(int(i) for batch in step.counted for i in batch[0]))
        ends.append(step.epoch_done)
        driver.commit(lambda: [])
        if driver.step_done(step):
            assert step.micro == 1 and step.samples == 4  # the largest world's, whichever shares this host trained
            loop.count(step.micro)
    assert replicas.committed == 4 and loop.position.step == 3
    first, abandoned, again, third = tried
    assert len(first) == 4 and len(abandoned) == 4 and len(again) == 2 and len(third) == 2
    assert set(again) <= set(abandoned)  # the same position: share 0 of the step that was abandoned
    assert replicas.recovered_at == [1, 2, 3] and ends == [False, False, False, True]


def test_in_place_refuses_a_step_without_the_optimizer_step_and_batches_not_on_the_runs_sampler():
    replicas = Replicas(quorums=[[0]], commits=[], largest=1)
    driver, loop = InPlace(replicas), Loop(accum=1)
    steps = driver.steps(loader(4, 2, largest=1), loop.source())
    step = next(steps)
    list(step.counted)
    with pytest.raises(UsageError, match="without run.optimizer_step"):
        driver.step_done(step)
    with pytest.raises(UsageError, match="not a DataLoader on run.sampler"):
        next(InPlace(replicas).steps(DataLoader(TensorDataset(torch.arange(4)), batch_size=2), loop.source()))
    with pytest.raises(UsageError, match="run.step"):
        driver.counted_by_hand(contextlib.nullcontext)


def test_in_place_asks_the_hosts_once_per_step_however_often_it_is_asked():
    replicas = Replicas(quorums=[[0]], commits=[True], largest=1)
    driver = InPlace(replicas)
    step = next(driver.steps(loader(4, 2, largest=1), Loop(accum=1).source()))
    list(step.counted)
    assert driver.commit(lambda: []) and driver.commit(lambda: [])  # the clip's call, then the optimizer step's
    assert replicas.committed == 1 and driver.step_done(step)
    assert driver.sampler_place() == (0, 1) and driver.shares() == [0]


class _OneHost:
    """torchft's Manager over a job of one host: each bucket's sum is the bucket as it is, done at once."""

    @staticmethod
    def allreduce(tensor, reduce_op=None):
        from types import SimpleNamespace

        return SimpleNamespace(wait=lambda: True)


def test_a_host_of_one_process_keeps_its_ddp_out_of_the_backward_and_sums_autograds_gradients(tmp_path):
    """run.wrap() wraps a host of one process in a DDP all the same (as on the restart path). Under in place that DDP
    has nothing to average, and its copy of every gradient into its own buckets would be a pass over the gradients
    the restart path does not make: the strategy's no-sync keeps it out of every backward, and the sum takes each
    gradient from autograd as it is accumulated (every bucket launched during the backward), the gradients after
    the commit the sum's, not DDP's buckets."""
    import torch.distributed as dist

    from trainer.engine.inplace import GradientSum

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 300000), torch.nn.ReLU(), torch.nn.Linear(300000, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
        replicas = Replicas(quorums=[[0]], commits=[True], largest=2)

        def summing(params, fresh=False):  # inplace.InPlace's, over a job of one host, the host's share 1/2
            replicas.summed = GradientSum(params, _OneHost(), 0.5)
            return replicas.summed

        replicas.summing = summing
        driver = InPlace(replicas)
        driver.comm_hook(ddp, None)  # what run.wrap() calls
        summed = replicas.summed
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        expected = torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), list(net.parameters()))
        with driver._arming(lambda last: contextlib.nullcontext() if last else ddp.no_sync())(True):
            assert not ddp.require_backward_grad_sync  # DDP left out of the step's last backward too
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        assert summed.launched == len(summed.buckets) > 1  # every bucket during the backward
        summed.finish()
        summed.apply()
        for p, g in zip(net.parameters(), expected):
            assert torch.equal(p.grad, g * 0.5)  # scaled by the host's share as it was copied in
            assert any(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                       for flat, _ in summed.buckets)  # the sum's bucket, no copy of DDP's
    finally:
        dist.destroy_process_group()


def test_averaging_starts_after_a_warm_up_it_must_know_and_follows_the_runs_step():
    from types import SimpleNamespace

    from trainer.config.settings import TrainConfig
    from trainer.engine.drivers import Averaging

    ctx = SimpleNamespace(rank=0, world_size=2)
    driver = Averaging(ctx, period=4, label=lambda name: f"--{name.replace('_', '-')}")
    wrapped = SimpleNamespace(module=torch.nn.Linear(2, 2), forward=lambda x: x)
    with pytest.raises(UsageError, match="--local-sgd-period: starts after the LR warm-up"):
        driver.forward(wrapped, Position(), None, TrainConfig(warmup_steps=-1))
    driver.forward(wrapped, Position(0, 0, 3), 100, TrainConfig(warmup_steps=10))
    assert driver.averaging.warmup_steps == 10 and driver.averaging.step == 3
    before_commit, optimizer = [], object()
    driver.resumed(7, [optimizer], before_commit)  # a checkpoint of step 7: the schedule of averages goes on there
    assert driver.averaging.step == 7 and driver.averaging.optimizer is optimizer
    assert before_commit == [driver.averaging.synchronise]  # every rank's state rank 0's before each checkpoint
    driver.step_ended(8)  # within the warm-up: no average (it would be a collective)
    assert driver.averaging.step == 8 and driver.averaging.averaged_at == -1
    driver.moved(5)
    assert driver.averaging.step == 5 and driver.members.world_size == 2


def test_averaging_on_the_references_schedule_starts_after_its_warm_up_epochs():
    """--lr-scheduler's warm-up is counted in epochs (--lr-warmup-epochs): local SGD starts after as many epochs of
    the run's steps, not after --warmup-steps' 5%."""
    from types import SimpleNamespace

    from trainer.config.settings import TrainConfig
    from trainer.engine.drivers import Averaging

    driver = Averaging(SimpleNamespace(rank=0, world_size=2), period=4, label=lambda name: name)
    wrapped = SimpleNamespace(module=torch.nn.Linear(2, 2), forward=lambda x: x)
    driver.forward(wrapped, Position(), 100, TrainConfig(lr_scheduler="steplr", lr_warmup_epochs=2), 7)
    assert driver.averaging.warmup_steps == 14


# ---------------------------------------------------------------- the run's state (trainer/engine/train_state.py)
def settings(epochs: int = 2, max_steps: int = 0, grad_accum: int = 1):
    from types import SimpleNamespace

    return SimpleNamespace(epochs=epochs, max_steps=max_steps, grad_accum=grad_accum)


def test_the_state_ends_at_the_planned_total_or_max_steps_and_says_when_that_is_mid_epoch():
    from trainer.engine.train_state import TrainState

    state = TrainState(settings(epochs=2, max_steps=5), batch_size=4)
    assert state.total_steps == 5  # max_steps, before the plan is known
    state.plan(steps_per_epoch=3, epochs=None)
    assert state.total_steps == 5 and state.epochs_to_train(None) == 2
    for step in range(1, 6):
        epoch, counted, last = state.step_counted(micro=2, samples=8)
        assert (counted, last) == (step, step == 5)
        epoch_done = step % 3 == 0
        assert state.step_ended(stopping=False, last=last, epoch_done=epoch_done) == last
        if epoch_done:
            state.epoch_ended()
    assert state.position == Position(1, 4, 5, 40) and state.ended and state.ended_mid_epoch and not state.stopped
    assert state.past_the_end()
    assert TrainState(settings(epochs=3), None).total_steps is None  # no plan, no max_steps: not known


def test_the_plan_counts_the_epochs_left_at_this_runs_steps_on_from_the_checkpoints_step():
    """A checkpoint trained at another global batch (--batch-size per process, another world size): the epochs left
    are this run's steps per epoch, counted on from its step; at the same global batch the plan is the plain one."""
    from trainer.engine.train_state import TrainState

    state = TrainState(settings(epochs=3), batch_size=8)
    state.plan(steps_per_epoch=20, epochs=None, resumed=Position(1, 0, 40))  # epoch 0 at half this run's batch
    assert state.total_steps == 40 + 2 * 20
    state.plan(steps_per_epoch=20, epochs=None, resumed=Position(1, 0, 20))  # the same global batch
    assert state.total_steps == 60
    state.plan(steps_per_epoch=80, epochs=None, resumed=Position(1, 0, 40))  # epoch 0 at twice this run's batch
    assert state.total_steps == 40 + 2 * 80
    accum = TrainState(settings(epochs=2, grad_accum=2), batch_size=8)  # mid-epoch: micro-batch 12 of steps of 2
    accum.plan(steps_per_epoch=10, epochs=None, resumed=Position(0, 12, 30))
    assert accum.total_steps == 30 + (10 - 6) + 10
    capped = TrainState(settings(epochs=3, max_steps=50), batch_size=8)  # max_steps is a step count: it still caps
    capped.plan(steps_per_epoch=20, epochs=None, resumed=Position(1, 0, 40))
    assert capped.total_steps == 50


def test_the_state_moves_a_checkpoints_position_only_while_the_run_is_where_it_left_it():
    from trainer.engine.train_state import TrainState

    state = TrainState(settings(), batch_size=None)
    state.resumed(Position(1, 6, 9))
    assert state.resumed_from == 9 and state.nothing_trained()
    assert not state.resized(9, batch=3)  # the micro-batch size is not known yet: a script's sampler sets it
    state.batch_size = 8
    assert state.resized(9, batch=3) and state.position == Position(1, 3, 9)
    assert state.samples_per_batch(largest=4) == 32
    state.step_counted(micro=1, samples=32)
    assert not state.resized(9, batch=1) and not state.nothing_trained()  # trained on: the checkpoint is behind
    assert state.last_of_epoch(accum=2, batches_per_epoch=7)  # batch 4 + 2 reaches 6, the epoch's whole steps
