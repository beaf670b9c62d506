"""The whole optimizer step as one CUDA graph (``train.cuda_graphs: step``).

A step of a small model on a fast GPU launches about a thousand kernels; the host's time to
launch them (and the autograd engine's between forward and backward) leaves the GPU idle for
milliseconds per step. Captured once, the step is one ``replay`` call: every micro-batch's
forward and backward, the gradient clipping and the fused AdamW update.

What a replay reads must live at the addresses the capture saw: the micro-batches are copied
into static input buffers, the learning rate into one device tensor per parameter group (the
scheduler keeps writing Python floats into the optimizer, which checkpoints save as before),
and the gradients are the ones the captured backward allocated. The optimizer is made with
``capturable=True``, so its step counts live on the device too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

Batch = dict[str, torch.Tensor]
StepBody = Callable[[list[Batch]], torch.Tensor]

class CaptureError(RuntimeError):
    """The step did not capture (an operation in it is not allowed in a CUDA graph)."""


WARMUP_STEPS = 3  # eager steps before the capture: compilation, the optimizer's state, cuBLAS workspaces


class StepGraph:
    """Runs ``body`` (one optimizer step's device work on its micro-batches, returning the
    summed loss on the device) eagerly for ``warmup`` steps, then captures it and replays it.

    The eager steps and the capture run on a side stream, as CUDA graph capture requires of
    the work it follows; replays run on the current stream.
    """

    def __init__(self, body: StepBody, optimizer: torch.optim.Optimizer, *, device: torch.device,
                 warmup: int = WARMUP_STEPS):
        self.body = body
        self.optimizer = optimizer
        self.warmup = warmup
        self.eager_steps = 0
        self.stream = torch.cuda.Stream(device)
        self.lrs = [torch.tensor(float(group["lr"]), device=device) for group in optimizer.param_groups]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[Batch] = []
        self.loss: torch.Tensor | None = None

    def __call__(self, batches: list[Batch]) -> torch.Tensor:
        """One optimizer step on ``batches``; returns its loss (a tensor of its own)."""
        # The eager steps read the same buffers as the graph: torch.compile traces once, for
        # these (contiguous) tensors, and never again during the capture.
        if not self.inputs:
            self.inputs = [{key: value.contiguous().clone() for key, value in batch.items()} for batch in batches]
        for static, batch in zip(self.inputs, batches, strict=True):
            for key, value in batch.items():
                static[key].copy_(value)
        if self.graph is None and self.eager_steps < self.warmup:
            self.eager_steps += 1
            with self._side_stream():
                return self.body(self.inputs)
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.loss is not None
        for lr, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])
        self.graph.replay()
        return self.loss.clone()  # the next replay overwrites self.loss

    def _capture(self) -> None:
        groups = self.optimizer.param_groups
        floats = [group["lr"] for group in groups]
        for group, lr in zip(groups, self.lrs, strict=True):
            group["lr"] = lr  # the captured update reads the rate from the device
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data thread may pin host memory meanwhile (global mode forbids it).
            with self._side_stream(), torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.loss = self.body(self.inputs)
        except RuntimeError as err:
            raise CaptureError(
                f"train.cuda_graphs step: the optimizer step could not be captured as a CUDA graph "
                f"({str(err).splitlines()[0]}); something in it synchronises with the host or "
                f"allocates outside the graph. Set train.cuda_graphs: true (each compiled graph) or false."
            ) from err
        finally:
            for group, lr in zip(groups, floats, strict=True):
                group["lr"] = lr
        self.graph = graph

    @contextmanager
    def _side_stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)
