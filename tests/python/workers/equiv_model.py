"""Model and data shared by equiv_worker.py and its single-process reference."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 14, 300)   # 16800 weights: several partitions
        self.fc2 = torch.nn.Linear(300, 5)
        # Never used by forward(): its gradient is pushed by step() as zeros.
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = torch.relu(self.conv(x.unsqueeze(1))).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def batches(steps, global_batch, seed=7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(global_batch, 16, generator=g)
        y = torch.randint(0, 5, (global_batch,), generator=g)
        yield x, y
