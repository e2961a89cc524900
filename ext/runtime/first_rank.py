"""The first rank's values of a list of tensors (a model's buffers, its parameters at wrap time)
given to every rank over one asynchronous broadcast of their bytes."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class FirstRankValues:
    """Broadcasts the first rank's values of `tensors` in one flat byte buffer, packed with the
    largest elements first, so that each tensor starts at a multiple of its own element size
    (whatever the mix of dtypes). The buffer and its typed views are kept while the same tensors
    (same objects, shapes and dtypes) are given again: a broadcast each iteration costs two
    multi-tensor copies, not one dispatch per tensor."""

    def __init__(self, process_group):
        self.process_group = process_group
        self.source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self.given: list[torch.Tensor] = []  # the tensors the buffer is laid out for, as given
        self.layout: list[tuple[torch.dtype, torch.Size]] = []  # their dtypes and shapes then
        self.ordered: list[torch.Tensor] = []  # the same, largest elements first
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # the flat buffer's span of each of `ordered`, in its dtype and shape
        self.work = None  # the last broadcast, which the buffer's next use waits for (a backward pass
        # that raised leaves it unwaited)

    def start(self, tensors: list[torch.Tensor]) -> Callable[[], None]:
        """Start giving every rank the first rank's values of `tensors` as they are now. Returns
        what completes it: the wait, then the values written into `tensors` on every rank (the
        first rank's too, which may have changed them since)."""
        if not tensors:
            return lambda: None
        if self.work is not None:
            self.work.wait()
        self._pack_for(tensors)
        flat, views, ordered = self.flat, self.views, self.ordered
        with torch.no_grad():
            torch._foreach_copy_(views, ordered)
        work = self.work = dist.broadcast(flat, src=self.source, group=self.process_group, async_op=True)

        def complete() -> None:
            work.wait()
            with torch.no_grad():
                torch._foreach_copy_(ordered, views)
        return complete

    def _pack_for(self, tensors: list[torch.Tensor]) -> None:
        """(Re)build the flat buffer unless it is laid out for these very tensors already."""
        layout = [(tensor.dtype, tensor.shape) for tensor in tensors]
        if layout == self.layout and all(new is old for new, old in zip(tensors, self.given)):
            return
        ordered = sorted(tensors, key=lambda tensor: -tensor.element_size())
        sizes = [tensor.numel() * tensor.element_size() for tensor in ordered]
        self.flat = torch.empty(sum(sizes), dtype=torch.uint8, device=ordered[0].device)
        self.views = [part.view(tensor.dtype).view(tensor.shape)
                      for part, tensor in zip(torch.split(self.flat, sizes), ordered)]
        self.given, self.layout, self.ordered = list(tensors), layout, ordered


def broadcast_from_first(tensors: list[torch.Tensor], process_group) -> None:
    """Give every rank the first rank's values of `tensors`, once (``FirstRankValues``)."""
    FirstRankValues(process_group).start(tensors)()
