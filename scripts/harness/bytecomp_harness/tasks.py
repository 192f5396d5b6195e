"""Training tasks with held-out data for bench-cluster's accuracy runs and
for lr_sweep (docs/cluster.md, "Accuracy").

A task gives a model, the training batch of (step, rank) for a world of
`world` processes, a held-out set, and its training settings (TRAIN):
learning rate, schedule, steps, evaluation interval and target accuracy.
The settings were chosen by `python3 -m bytecomp_harness.lr_sweep`
(single process, the global batch: exactly what every process sees after
exact averaging), see docs/cluster.md: a task without settings is refused
by name rather than run at a guessed rate.

  digits   sklearn's handwritten digits (1797 8x8 images, 10 classes; the
           demo's MLP 64-512-256-10, client/python/bytecomp/examples/digits.py),
           360 held out
  cancer   sklearn's breast cancer Wisconsin set (569 x 30 features,
           2 classes; MLP 30-512-256-2, features standardised with the
           training split's mean and deviation), 114 held out
  mlp      synthetic: x ~ N(0, 1)^256, label argmax(x W) of a fixed random
           teacher W; MLP 256-512-512-10; every step fresh samples, a
           fixed held-out set of 2048 from another seed
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

# Per task: lr (SGD, momentum 0.9), schedule ("constant" or "cosine": lr
# cos-annealed to 0 over `steps`), per-process batch, training steps,
# evaluation every `eval_every` steps, target held-out accuracy (percent)
# for time-to-accuracy. Chosen by lr_sweep on 2026-12-02 (docs/cluster.md).
TRAIN = {
    "digits": {"lr": 0.1, "momentum": 0.9, "schedule": "constant", "batch": 16,
               "steps": 300, "eval_every": 20, "target": 95.0},
    "cancer": {"lr": 0.03, "momentum": 0.9, "schedule": "constant", "batch": 16,
               "steps": 200, "eval_every": 10, "target": 97.0},
    "mlp": {"lr": 0.03, "momentum": 0.9, "schedule": "constant", "batch": 32,
            "steps": 200, "eval_every": 20, "target": 65.0},
}
TASKS = ("digits", "cancer", "mlp")


class TabularMLP(torch.nn.Module):
    """in -> hidden -> hidden/2 -> classes (the digits demo's shape)."""

    def __init__(self, inputs, classes, hidden=512):
        super().__init__()
        self.fc1 = torch.nn.Linear(inputs, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden // 2)
        self.fc3 = torch.nn.Linear(hidden // 2, classes)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def settings(name, overrides=None):
    if name not in TRAIN:
        raise ValueError("task %r has no training settings (one of %s); choose them with "
                         "python3 -m bytecomp_harness.lr_sweep first" % (name, ", ".join(TRAIN)))
    s = dict(TRAIN[name])
    for k, v in (overrides or {}).items():
        if v is not None:
            s[k] = v
    return s


def lr_at(s, step):
    if s["schedule"] == "constant":
        return s["lr"]
    if s["schedule"] == "cosine":
        return s["lr"] * 0.5 * (1 + math.cos(math.pi * min(step, s["steps"]) / s["steps"]))
    raise ValueError("schedule %r: expected constant or cosine" % s["schedule"])


class Task:
    def __init__(self, name, seed=1):
        if name not in TASKS:
            raise ValueError("task %r: expected one of %s" % (name, ", ".join(TASKS)))
        self.name = name
        self.seed = seed
        if name == "digits":
            from sklearn.datasets import load_digits
            d = load_digits()
            x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
            self._split(x, y, 360, standardise=False)
        elif name == "cancer":
            from sklearn.datasets import load_breast_cancer
            d = load_breast_cancer()
            self._split(d.data.astype(np.float32), d.target.astype(np.int64), 114,
                        standardise=True)
        else:
            self.teacher = torch.randn(256, 10, generator=torch.Generator().manual_seed(12345))
            g = torch.Generator().manual_seed(777)
            x = torch.randn(2048, 256, generator=g)
            self.x_test, self.y_test = x, (x @ self.teacher).argmax(1)
            self.x_train = None

    def _split(self, x, y, test, standardise):
        # The split is fixed (seed 0, as the digits demo); the data order of
        # training varies with the run's seed.
        perm = np.random.RandomState(0).permutation(len(y))
        te, tr = perm[:test], perm[test:]
        if standardise:
            mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-6
            x = (x - mu) / sd
        self.x_train, self.y_train = torch.from_numpy(x[tr]), torch.from_numpy(y[tr])
        self.x_test, self.y_test = torch.from_numpy(x[te]), torch.from_numpy(y[te])

    def model(self):
        if self.name == "digits":
            from bytecomp.examples.digits import MLP
            return MLP()
        if self.name == "cancer":
            return TabularMLP(30, 2)
        from bytecomp_harness.cluster_worker import Mlp
        return Mlp()

    def batch(self, step, rank, world, batch):
        """This rank's share of the global batch of `step`: real sets are
        walked in a permutation per epoch (seeded by the run's seed and the
        epoch), world * batch samples a step; synthetic samples are fresh."""
        if self.x_train is None:
            g = torch.Generator().manual_seed((self.seed * 1000003 + step) * 1009 + rank)
            x = torch.randn(batch, 256, generator=g)
            return x, (x @ self.teacher).argmax(1)
        gb = world * batch
        per_epoch = len(self.y_train) // gb
        epoch, s = divmod(step, per_epoch)
        perm = torch.randperm(len(self.y_train), generator=torch.Generator().manual_seed(
            self.seed * 1000 + epoch))
        idx = perm[s * gb + rank * batch: s * gb + (rank + 1) * batch]
        return self.x_train[idx], self.y_train[idx]

    def evaluate(self, model, rank=0, world=1):
        """(sum of losses, correct, count) of this rank's shard of the
        held-out set."""
        shard = slice(rank, len(self.y_test), world)
        with torch.no_grad():
            out = model(self.x_test[shard])
            y = self.y_test[shard]
            return (float(F.cross_entropy(out, y, reduction="sum")),
                    float((out.argmax(1) == y).sum()), float(len(y)))
