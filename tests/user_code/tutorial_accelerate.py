"""accelerate's minimal training loop (its README's "Accelerate in a few lines": an Accelerator, prepare(),
accelerator.backward()), as users write it; only the data are local (random tensors).

    trainer-launch tutorial_accelerate.py        (on CPUs: ACCELERATE_USE_CPU=1, or every rank trains alone)
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

accelerator = Accelerator()
device = accelerator.device
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
dataset = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=gen), torch.randint(0, 3, (256,), generator=gen))
data = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)

model, optimizer, data = accelerator.prepare(model, optimizer, data)

model.train()
for epoch in range(2):
    for source, targets in data:
        source, targets = source.to(device), targets.to(device)
        optimizer.zero_grad()
        output = model(source)
        loss = F.cross_entropy(output, targets)
        accelerator.backward(loss)
        optimizer.step()
    accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}")
print(f"process {accelerator.process_index} of {accelerator.num_processes}: {accelerator.distributed_type}", flush=True)
