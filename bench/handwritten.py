"""The DDP loop tutorials teach and users copy: DistributedSampler + DataLoader + DDP + loss.item().

    torchrun --standalone --nproc-per-node=2 -m bench.handwritten --result out.json
"""

import gc
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from bench import common


def main() -> None:
    args = common.parse_args(__doc__)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    dataset = common.synthetic_dataset(args)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, pin_memory=cuda)
    model = DDP(common.build_model(args).to(device), device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    criterion = torch.nn.CrossEntropyLoss()
    timer = common.StepTimer(args.batch_size, args.steps, device)

    model.train()
    sampler.set_epoch(0)
    running_loss = 0.0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        running_loss += loss.item()
        timer.step()

    common.write_result(args.result, "handwritten", args, timer, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # DDP's reducer holds the process group in reference cycles: freed at the interpreter's exit instead, its
    # gloo threads aborted 2 of 12 plain-torchrun runs (SIGABRT) after the result was written.
    gc.collect()
