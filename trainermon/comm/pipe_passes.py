"""The micro-batch a torch.distributed.pipelining stage works on, as its schedule says it.

A pipeline schedule runs a stage's passes out of micro-batch order (1F1B: backward k after forward
k+pp-s-1; LoopedBFS: backwards in reverse order; interleaved: several stages per rank), and batches one
micro-batch's sends with another's receives. Counting forwards or gradient hooks then numbers them wrongly;
the stage's own calls carry the micro-batch index (`forward_one_chunk(k)`, `backward_one_chunk(k)`,
`get_fwd_send_ops(k)`, ...). `adapters/pipelining.py` wraps those calls and writes here what they say; the
comm probe and the micro-batch gradient taps read it. Process-wide (not per thread): autograd runs a
CUDA backward's hooks on its own threads, inside the stage's backward call."""

from __future__ import annotations


class _PipePasses:
    def __init__(self) -> None:
        self.micro: int | None = None  # the pass running or that ran last this step (None: no stage pass)
        self.backward: int | None = None  # the stage backward running now (None: none)
        self.tagging = False  # a collected step: the stage's p2p ops' tensors are labelled in `tensors`
        self.tensors: dict[int, int] = {}  # id(tensor of a stage's P2POp) -> its micro-batch

    def reset(self, tagging: bool) -> None:
        """At a step's start (the comm probe's collected steps): no pass seen yet."""
        self.micro = None
        self.tensors.clear()
        self.tagging = tagging


PIPE = _PipePasses()
