"""ResNet-18 with a new 10-class head on CIFAR-shaped images, as a hand-written DDP script.

The pattern of OCI's distributed-training tutorial (its `train.py`), written on trainer.api in its step-by-step
form (its own backward and optimizer.step(), then run.step()): the loop is yours; the process group, the
resumable sampler, checkpoints with automatic resume, the SIGTERM stop, TensorBoard, step timing and
summary.json come from the stack. The TRAIN_* settings apply (TRAIN_TRACKER, TRAIN_CHECKPOINT_DIR, ...). Run it on every local process:

    trainer-launch examples/cifar_resnet_script/train.py --epochs 3
    # the same under plain torchrun, Slurm's srun, or as one process:
    torchrun --nproc-per-node 2 examples/cifar_resnet_script/train.py --epochs 3

No download: the data is synthetic and CIFAR-10-shaped (3x32x32 images, 10 classes, each class a
noisy copy of its own colour pattern), made from a seed on every rank.
"""

import argparse

import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from trainer import api


def cifar_shaped(size: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # the same in every split
    labels = torch.randint(0, 10, (size,), generator=gen)
    return TensorDataset(patterns[labels] + 0.8 * torch.randn(size, 3, 32, 32, generator=gen), labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048, help="training images (validation: a fifth)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps (0: at epoch ends only)")
    # Unset: TRAIN_CHECKPOINT_DIR / TRAIN_LOG_DIR (the volumes in the containers), else ./checkpoints and ./runs.
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--log-dir")
    args = parser.parse_args()

    with api.Run(args.checkpoint_dir, args.log_dir, checkpoint_every=args.checkpoint_every, log_every=10) as run:
        train_set, val_set = cifar_shaped(args.samples, seed=1), cifar_shaped(args.samples // 5, seed=2)
        torch.manual_seed(0)  # the same initial weights on every rank
        model = torchvision.models.resnet18(weights=None)
        model.fc = torch.nn.Linear(model.fc.in_features, 10)  # the new head: 10 classes
        model.to(run.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
        sampler = run.sampler(train_set, args.batch_size)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        if run.resume(model=model, optimizer=optimizer, scheduler=scheduler) and run.is_main:
            print(f"resumed at step {run.step_count}, epoch {run.epoch}")
        ddp = run.wrap(model)

        @run.main_process_only
        def validate() -> float:  # rank 0, the plain model: a DDP forward on one rank would wait for the others
            model.eval()
            with torch.no_grad():
                images, labels = val_set.tensors
                correct = (model(images.to(run.device)).argmax(1) == labels.to(run.device)).sum().item()
            model.train()
            return correct / len(labels)

        for epoch in run.epochs(args.epochs):
            for images, labels in loader:
                images, labels = images.to(run.device), labels.to(run.device)
                loss = torch.nn.functional.cross_entropy(ddp(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if run.step(**{"Loss/train": loss.detach()}):
                    break  # SIGTERM: every rank has committed a checkpoint of this step
            else:
                scheduler.step()
                accuracy = validate()
                if run.is_main:
                    run.log(**{"acc1/val": accuracy})
                    print(f"epoch {epoch}: step {run.step_count}, val acc1 {accuracy:.3f}")


if __name__ == "__main__":
    main()
