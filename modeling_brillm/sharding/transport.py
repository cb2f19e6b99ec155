"""The collectives of the sharded trainer (or nothing, with one process), counting the bytes sent to others."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist


class Transport:
    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        self.bytes_sent = 0

    def _count(self, send_counts: list[int], row_bytes: int):
        self.bytes_sent += row_bytes * (sum(send_counts) - send_counts[self.rank])

    def route(self, dest: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """For items bound for processes `dest`: the order grouping them by destination, and the counts sent to
        and received from each process."""
        order, send = torch.argsort(dest, stable=True), torch.bincount(dest, minlength=self.world)
        recv = send
        if self.world > 1:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group)
            self._count([1] * self.world, send.element_size())
        return order, send.tolist(), recv.tolist()

    def exchange(self, tensor: torch.Tensor, send: list[int], recv: list[int], differentiable: bool) -> torch.Tensor:
        """Rows `tensor[sum(send[:r]):...]` go to process r; the rows received, by sending process. Differentiable:
        the backward sends the received rows' gradients back."""
        if self.world == 1:
            return tensor
        row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
        self._count(send, row_bytes)
        out = tensor.new_empty(sum(recv), *tensor.shape[1:])
        if not differentiable:
            dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)
            return out
        from torch.distributed.nn.functional import all_to_all_single

        self._count(recv, row_bytes)  # the backward's rows
        with warnings.catch_warnings():  # deprecated in favour of a functional collective without autograd
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_to_all_single")
            return all_to_all_single(out, tensor.contiguous(), recv, send, group=self.group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the processes, in place."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self.group)
            self.bytes_sent += 2 * tensor.numel() * tensor.element_size() * (self.world - 1) // self.world  # ring
        return tensor

    def to_main(self, tensors: list[torch.Tensor], rank: int):
        """Process `rank`'s `tensors` into process 0's (buffers of the same shapes); a no-op elsewhere."""
        if rank == 0 or self.rank not in (0, rank):
            return
        for t in tensors:
            if self.rank == rank:
                dist.send(t.contiguous(), 0, group=self.group)
            else:
                dist.recv(t, rank, group=self.group)

    def barrier(self):
        if self.world > 1:
            dist.barrier(group=self.group)
