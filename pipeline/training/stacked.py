"""Fused arrays of any module (torch.func): k members of one module config
trained as one vmapped module, so a step launches each kernel once for all k
(vmap's batching rules turn a batched convolution into a grouped one, a
batched linear into a batched matmul, as HFTA does by hand for the built-in
families in pipeline/training/fusion.py).

Layout: the members' tensors are stacked, one stacked tensor per parameter
and buffer name, member i at row i. Each member's own module stays, its
parameters and buffers views of its rows: its optimiser (any torch.optim
one, with its own hyper-parameters) and schedule step those views, its
`state_dict()` is a plain module's checkpoint, and loading one writes its
rows. The forward reads the stacked tensors through `functional_call` under
`vmap`, so batch norm keeps per-member statistics (its running buffers are
stacked too, updated in place row by row); dropout draws each member's own
mask. After backward, each stacked gradient is handed to the members as
views of its rows, and the members' optimisers step.

A module vmap rejects (an op without a batching rule, in-place state that is
not a buffer, data-dependent control flow) cannot fuse: `check_members`
(members.py) finds that before a run, with this class, and its members pack.
"""
from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.func import functional_call, vmap


class StackedArray:
    """Members' modules (one architecture, on one device) trained as one vmapped module, with `loss`
    ((logits, labels) -> a 0-d mean) for each. The modules keep training their own weights: each
    parameter and buffer becomes a view of the member's row of a stacked tensor. Member i is the i-th
    module given; after `drop(j)` the members after j move down one."""

    def __init__(self, nets: list[nn.Module], loss):
        if not nets:
            raise ValueError("a fused array needs one or more modules")
        self.nets = list(nets)
        self._base = copy.deepcopy(nets[0]).to("meta")  # the architecture functional_call runs
        self._loss = loss
        self._stack()
        # in_dims: a member's parameters and buffers are its rows; the batch is every member's
        self._member_losses = vmap(self._member_loss, in_dims=(0, 0, None, None), randomness="different")
        self._member_logits = vmap(self._forward, in_dims=(0, 0, None), randomness="different")

    @property
    def members(self) -> int:
        return len(self.nets)

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each member's loss on (x, y) in training mode, shape [k]. Members share no weights, so
        backpropagating the sum gives each member exactly its own gradient (handed to its parameters)."""
        self._base.train()
        return self._member_losses(self.params, self.buffers, x, y)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Each member's logits in evaluation mode, [k, N, classes]."""
        self._base.eval()
        return self._member_logits(self.params, self.buffers, x)

    def compile(self, options: dict) -> None:
        """The vmapped forward and loss compiled by torch.compile with `options` (a member leaving changes
        the stacked tensors' shapes, and so compiles them anew on the next step)."""
        self._member_losses = torch.compile(self._member_losses, **options)
        self._member_logits = torch.compile(self._member_logits, **options)

    def drop(self, i: int) -> None:
        """Member i leaves: the others are stacked anew (their weights and statistics unchanged, their
        parameters the same objects, so their optimisers carry on), and nothing holds member i's memory."""
        if self.members == 1:
            raise ValueError("the last member of a fused array cannot leave it")
        del self.nets[i]
        self._stack()

    def _forward(self, params, buffers, x):
        return functional_call(self._base, (params, buffers), (x,))

    def _member_loss(self, params, buffers, x, y):
        return self._loss(self._forward(params, buffers, x), y)

    def _stack(self) -> None:
        """Stack the members' tensors (a copy) and make each member's tensors views of its rows."""
        named = [(dict(net.named_parameters()), dict(net.named_buffers())) for net in self.nets]
        with torch.no_grad():
            self.params = {name: torch.stack([params[name] for params, _ in named]).requires_grad_(p.requires_grad)
                           for name, p in named[0][0].items()}
            self.buffers = {name: torch.stack([buffers[name] for _, buffers in named]) for name in named[0][1]}
        for name, stacked in self.params.items():
            own = [params[name] for params, _ in named]
            for i, p in enumerate(own):
                p.data = stacked.detach()[i]  # the same Parameter object: an optimiser keeps it
                p.grad = None  # a view of the old stacked gradient would keep every member's rows
            if stacked.requires_grad:
                stacked.register_post_accumulate_grad_hook(functools.partial(_hand_out, own))
        for name, stacked in self.buffers.items():
            owner, _, leaf = name.rpartition(".")
            for i, net in enumerate(self.nets):
                setattr(net.get_submodule(owner), leaf, stacked[i])


def _hand_out(own: list[nn.Parameter], stacked: torch.Tensor) -> None:
    """`stacked`'s gradient, accumulated: each member's parameter (`own`) takes its row (a view), and the
    stacked one lets it go, so the next backward starts from none."""
    for i, p in enumerate(own):
        p.grad = stacked.grad[i]
    stacked.grad = None
