"""Two pipeline stages of a small CNN (BatchNorm, ResNet's flatten before the head) trained for a few steps through
trainer.parallel.pipeline.Stage, under torchrun: each rank saves its stage's state dict (the unsplit model's names)
for the test to compare with one process accumulating the same micro-batches. At 4 processes, two replicas of the
two stages, each training its half of every batch, the stages' gradients averaged over the replicas.

    torchrun --nproc-per-node 2 pipeline_stages.py OUT SCHEDULE     (or --nproc-per-node 4)

interleaved-1f1b cuts it into four pieces, two on each process (conv and hidden on the first, bn and fc on the second).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.pipeline import Layout, Stage, cut, groups

MICROBATCHES, BATCH, STEPS = 4, 16, 4  # BATCH: the whole step's, over every replica


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.hidden = nn.Linear(32, 16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.relu(self.hidden(torch.flatten(x, 1))))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(STEPS)]


def watch_receives(stage: Stage) -> list:
    """gpipe's and 1f1b's receives posted ahead (gloo): as each micro-batch's forward or backward begins, the
    micro-batches of that phase whose receives are posted and not yet waited for
    (trainer.parallel.pipeline.prefetching_stage)."""
    part, ahead = stage.stages[0], []

    def watched(phase: str, run):
        def begin(chunk, *args, **kwargs):
            ahead.append((phase, chunk, sorted(later for (kind, later), works in part.posted.items()
                                               if kind == phase and works)))
            return run(chunk, *args, **kwargs)
        return begin

    part.forward_one_chunk = watched("forward", part.forward_one_chunk)
    part.backward_one_chunk = watched("backward", part.backward_one_chunk)
    return ahead


def main() -> None:
    out, schedule = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    points = ["bn", "hidden", "fc"] if schedule == "interleaved-1f1b" else ["hidden"]
    layout = Layout.of(dist.get_rank(), dist.get_world_size(), stages=2, chunks=(len(points) + 1) // 2)
    net = model()
    data = batches()
    per_replica = BATCH // layout.replicas
    example = data[0][0][:per_replica // MICROBATCHES]
    modules, evaluation = ([pieces[index] for index in layout.pieces]
                           for pieces in (cut(net, example, points), cut(net, example, points, training=False)))
    loss = nn.CrossEntropyLoss()
    pipeline_group, replica_group = groups(layout)
    stage = Stage(modules, layout, schedule, MICROBATCHES, lambda output, target: loss(output, target) / MICROBATCHES,
                  torch.device("cpu"), pipeline_group, replica_group, evaluation)
    ahead = watch_receives(stage) if schedule != "interleaved-1f1b" else []
    optimizer = torch.optim.SGD([p for module in modules for p in module.parameters()], lr=0.1, momentum=0.9)
    losses = []
    for inputs, targets in data:
        mine = slice(layout.replica * per_replica, (layout.replica + 1) * per_replica)
        losses += [float(x.detach()) for x in stage.step(inputs[mine], targets[mine])]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    evaluated = stage.evaluate(data[0][0][:per_replica])  # the first batch again, with the trained weights
    state = {key: value for module in modules for key, value in module.state_dict().items()}
    torch.save({"state": state, "losses": losses, "evaluated": evaluated, "ahead": ahead},
               out / f"stage-{layout.stage}-{layout.replica}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
