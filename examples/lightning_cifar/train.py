"""A PyTorch Lightning LightningModule and LightningDataModule, run by trainer-launch.

The shape of the Jülich Supercomputing Centre's Lightning slides: the model and its optimisation in a
LightningModule, the data in a LightningDataModule, Lightning's Trainer with the DDP strategy.
trainer-launch starts one process per GPU (or NPROC_PER_NODE CPU processes) under torchrun, with its
topology, preflight, restarts and one-line failure summary; Lightning reads torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and joins the process group torchrun set up for it:

    pip install lightning
    trainer-launch examples/lightning_cifar/train.py --max-epochs 2
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 trainer-launch examples/lightning_cifar/train.py   # per host

No download: the data is synthetic and CIFAR-10-shaped (3x32x32 images, 10 classes).
"""

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class CifarShaped(L.LightningDataModule):
    def __init__(self, samples: int, batch_size: int):
        super().__init__()
        self.samples, self.batch_size = samples, batch_size

    def setup(self, stage: str) -> None:  # every process makes the same tensors from the seeds
        patterns = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))

        def split(size: int, seed: int) -> TensorDataset:
            gen = torch.Generator().manual_seed(seed)
            labels = torch.randint(0, 10, (size,), generator=gen)
            return TensorDataset(patterns[labels] + 0.8 * torch.randn(size, 3, 32, 32, generator=gen), labels)

        self.train_set, self.val_set = split(self.samples, 1), split(self.samples // 5, 2)

    def train_dataloader(self) -> DataLoader:  # Lightning adds the DistributedSampler
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self(images), labels)
        self.log("Loss/train", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("acc1/val", (self(images).argmax(1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--root-dir", default=".", help="Lightning's checkpoints and TensorBoard logs go under it")
    args = parser.parse_args()

    L.seed_everything(0)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun (trainer-launch)
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",  # on CPUs DDP runs over gloo
        devices=local_processes, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local_processes,
        strategy="ddp", max_epochs=args.max_epochs, default_root_dir=args.root_dir,
        enable_progress_bar=False)
    trainer.fit(Classifier(), datamodule=CifarShaped(args.samples, args.batch_size))


if __name__ == "__main__":
    main()
