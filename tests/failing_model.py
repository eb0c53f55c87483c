"""A member's module that passes every check the driver makes before training (its build, forward and
memory estimate run in the driver's process) and fails in the process that trains it: a member that
fails mid-run, for tests of what a failure leaves."""
import multiprocessing

from torch import nn


class FailsWhereItTrains(nn.Module):
    def __init__(self, num_classes: int, **_ignored):  # takes the arguments of the module it stands in for
        super().__init__()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))

    def forward(self, x):
        if multiprocessing.parent_process() is not None:  # a trainer (the driver is the top process)
            raise RuntimeError("planted failure: this member fails where it trains")
        return self.head(x)
