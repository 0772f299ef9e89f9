"""The same workload through Lightning's Trainer with the DDP strategy.

    torchrun --standalone --nproc-per-node=2 -m bench.lightning_run --result out.json

Under torchrun Lightning joins the rendezvous torchrun made. Logger, checkpointing and the progress
bar are off so that only the training loop is timed, as for the other stacks.
"""

import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from bench import common


class Classifier(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)


class TimeSteps(L.Callback):
    def __init__(self, timer: common.StepTimer):
        self.timer = timer

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.timer.step()


def main() -> None:
    args = common.parse_args(__doc__)
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    dataset = common.synthetic_dataset(args)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True, pin_memory=cuda)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    timer = common.StepTimer(args.batch_size, args.steps, device)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=common.world_size() // int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy="ddp", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[TimeSteps(timer)])
    trainer.fit(Classifier(common.build_model(args), args.lr), loader)
    common.write_result(args.result, "lightning", args, timer, device)


if __name__ == "__main__":
    main()
