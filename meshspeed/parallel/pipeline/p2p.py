"""Messages between virtual stages: activations to the next one, gradients to the previous.

    link = Link(stage=s, stages=p, chunks=v, group=pp_group)
    link.send_activation(y, micro=3, chunk=1)   # to virtual stage 1 * p + s + 1
    x = link.recv_activation(micro=3, chunk=1)  # from virtual stage 1 * p + s - 1

Note [virtual stages and their neighbours]
Chunk c of stage s is virtual stage c * p + s, so a model of v * p chunks runs 0, 1, ...,
p - 1 on stages 0..p-1, then wraps: virtual stage p is chunk 1 of stage 0. The next of
(s, c) is (s + 1, c), or (0, c + 1) from the last stage; the previous is (s - 1, c), or
(p - 1, c - 1) from stage 0. With one stage and several chunks the neighbour is this very
process: such messages are kept in a dictionary (cloned, as a real transfer would copy),
never sent.

Note [one tag per message]
Each message between two ranks has its own tag: (direction, micro-batch, the sender's
chunk, the tensor's index, header or data), packed into 31 bits. Within one batch no two
messages on a pair of ranks share a tag, so a receive can only match the message it is
for, whatever order the two ranks issue them in (with p = 2 and v > 1, activations and
gradients travel between the same two stages both ways). Gloo pairs sends and receives
by tag. NCCL ignores tags and pairs them in issue order; for every schedule of
schedule.py each stage happens to send to a neighbour in the order that neighbour
receives (test_runtime.py checks it for p up to 8), but NCCL is untested here.

Note [shapes once, checked every micro-batch]
Every activation tensor is preceded by a header of 12 int64 (96 bytes): the number of
tensors in the message, whether they are a tuple, the dtype, how it is compressed (Note
[compressed activations between stages] in compress.py; packed into the dtype's slot,
which for an uncompressed tensor is the dtype's code as before) and the shape. The receiver
allocates its buffers from the headers, and both sides compare each micro-batch's headers
with the first micro-batch's for the same chunk. A stage whose output changes shape,
dtype or count mid-batch raises `PipelineShapeError` naming both, and so does its
receiver: the sender sends all its headers before checking, and the receiver reads all of
them (header 0 says how many) before checking, so neither waits for bytes that would not
fit (a hang, or a misread buffer) and no sent message is left unread.

Note [tuples: only floating tensors carry gradients]
A stage may pass a tuple of tensors, such as (hidden, attention_mask). Gradients flow
back for its floating-point tensors only; integer and boolean tensors (masks, ids) get
none and nothing is sent for them. A floating tensor that the next stage did not use, or
did not differentiate through, has no gradient either, and none is sent: each backward
first sends a small int64 tensor of flags, one per floating tensor, then the gradients
that exist, so the sender of the activation backpropagates exactly what a one-process
backward would (an unused output leaves its parameters' .grad None, not zeros, and
their hooks do not fire). Gradients carry no header: they have the shape and dtype of
the activation they belong to, and travel compressed as it did.

Buffers and headers are allocated on `device` (the stage's parameters' device); only
CPU tensors over gloo are tested here.
"""

from __future__ import annotations

import torch

from meshspeed import comm
from meshspeed.parallel.pipeline.compress import MODES, decode, encode, wire_mode, wire_spec

_HEADER = 12  # int64 slots: count, is_tuple, dtype code, ndim, up to 8 dims
_MAX_DIMS = _HEADER - 4
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.int8, torch.int16]

# Note [one tag per message]: the field widths, lowest first
_PART_BITS, _INDEX_BITS, _DIRECTION_BITS, _CHUNK_BITS, _MICRO_BITS = 1, 4, 1, 6, 19
MAX_TENSORS, MAX_CHUNKS, MAX_MICRO_BATCHES = 1 << _INDEX_BITS, 1 << _CHUNK_BITS, 1 << _MICRO_BITS
_ACTIVATION, _GRADIENT = 0, 1
_HEAD, _DATA = 0, 1


class PipelineShapeError(RuntimeError):
    """A stage's output changed shape, dtype or count within one batch, or cannot be sent."""


def tag(direction: int, micro: int, chunk: int, index: int, part: int) -> int:
    """The tag of one message (Note [one tag per message]); < 2**31."""
    t = micro
    for value, bits in ((chunk, _CHUNK_BITS), (direction, _DIRECTION_BITS), (index, _INDEX_BITS),
                        (part, _PART_BITS)):
        t = t << bits | value
    return t


def flatten(value) -> tuple[list[torch.Tensor], bool]:
    """(the tensors of a stage's input or output, whether it was a tuple)."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return list(value), True
    kinds = [type(t).__name__ for t in value] if isinstance(value, (tuple, list)) else type(value).__name__
    raise PipelineShapeError(f"a pipeline stage must pass a tensor or a non-empty tuple of tensors to "
                             f"the next stage, got {kinds}")


def floating(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a message that carry gradients back (Note [tuples: only floating ...])."""
    return [t for t in tensors if t.is_floating_point()]


# (is_tuple, (shape, dtype, how it travels: compress.wire_mode) each)
Spec = tuple[bool, tuple[tuple[torch.Size, torch.dtype, str], ...]]


def _header(t: torch.Tensor, count: int, is_tuple: bool, wire: str) -> torch.Tensor:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise PipelineShapeError(f"a pipeline activation must be a tensor of at most {_MAX_DIMS} "
                                 f"dims in one of {_DTYPES}, got {tuple(t.shape)} {t.dtype}")
    h = torch.zeros(_HEADER, dtype=torch.int64)
    code = _DTYPES.index(t.dtype) + len(_DTYPES) * MODES.index(wire)  # "none": the dtype's code
    h[0], h[1], h[2], h[3] = count, int(is_tuple), code, t.dim()
    h[4 : 4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _read(h: torch.Tensor) -> tuple[int, bool, torch.Size, torch.dtype, str]:
    count, is_tuple, code, ndim = (int(v) for v in h[:4])
    if not (1 <= count <= MAX_TENSORS and 0 <= code < len(_DTYPES) * len(MODES) and 0 <= ndim <= _MAX_DIMS):
        raise PipelineShapeError(f"a pipeline activation header is unreadable ({h.tolist()}): the "
                                 "two stages disagree on the message order")
    shape = torch.Size(int(d) for d in h[4 : 4 + ndim])
    return count, bool(is_tuple), shape, _DTYPES[code % len(_DTYPES)], MODES[code // len(_DTYPES)]


def _describe(spec: Spec) -> str:
    is_tuple, parts = spec
    each = [f"{tuple(shape)} {dtype}" + (f" sent as {wire}" if wire != "none" else "")
            for shape, dtype, wire in parts]
    return f"a tuple of ({', '.join(each)})" if is_tuple else each[0]


def _changed(what: str, spec: Spec, first: Spec) -> str:
    return (f"{what} is {_describe(spec)}, the first micro-batch's was {_describe(first)}; every "
            "micro-batch of a batch must give the next stage the same shapes (pad, or use equal "
            "micro-batches)")


# Note [receives posted together]
# gloo moves a message only once its receive is posted, and a receive posted while the
# sender's compute thread holds the core waits for the sender's I/O thread to wake: a
# header received, then the data, paid that wake-up twice per transfer (2.5-5 ms against
# 0.5 ms for one message, measured in benchmarks/pipeline_findings.md). From a chunk's
# second micro-batch on the shapes are known, so the header and data receives are posted
# together and waited in turn; the header is still checked before the data is used, and a
# changed shape is still the same PipelineShapeError. Gradients likewise: their flags and
# the gradients at once, when the first micro-batch had a gradient for every output.


class Link:
    """This stage's point-to-point traffic with the neighbouring virtual stages in `group`
    (whose ranks are the stage ids). `compression`: "none", "bf16" or "int8", how floating
    activations and their gradients travel (Note [compressed activations between stages]
    in compress.py); every stage of a pipeline must use the same."""

    def __init__(self, stage: int, stages: int, chunks: int, group, device: torch.device | None = None,
                 compression: str = "none"):
        if chunks > MAX_CHUNKS:
            raise ValueError(f"a pipeline stage holds at most {MAX_CHUNKS} model chunks, got {chunks}")
        wire_mode(torch.float32, compression)  # a ValueError naming the modes if unknown
        self.stage, self.stages, self.chunks, self.group = stage, stages, chunks, group
        self.compression = compression
        self.device = device or torch.device("cpu")
        self._sent: dict[int, Spec] = {}  # chunk -> the first micro-batch's output
        self._received: dict[int, Spec] = {}  # chunk -> the first micro-batch's input
        self._pending: list[tuple[object, torch.Tensor]] = []  # sends in flight, their buffers
        self._local: dict[int, torch.Tensor] = {}  # tag -> a message to this very stage
        self._all_flagged: dict[int, bool] = {}  # chunk -> every output had a gradient (first micro)
        self._sent_all_grads: dict[int, bool] = {}  # chunk -> every input had one (first micro)

    # -- neighbours (Note [virtual stages and their neighbours]) --------------------------------
    def next_of(self, chunk: int) -> tuple[int, int]:
        """(stage, chunk) of the virtual stage after this stage's `chunk`."""
        return (0, chunk + 1) if self.stage == self.stages - 1 else (self.stage + 1, chunk)

    def prev_of(self, chunk: int) -> tuple[int, int]:
        """(stage, chunk) of the virtual stage before this stage's `chunk`."""
        return (self.stages - 1, chunk - 1) if self.stage == 0 else (self.stage - 1, chunk)

    def name(self, stage: int, chunk: int) -> str:
        return f"stage {stage}" + (f" chunk {chunk}" if self.chunks > 1 else "")

    # -- activations -----------------------------------------------------------------------------
    def send_activation(self, value, micro: int, chunk: int) -> None:
        tensors, is_tuple = flatten(value)
        if len(tensors) > MAX_TENSORS:
            raise PipelineShapeError(f"{self.name(self.stage, chunk)} passes {len(tensors)} tensors to "
                                     f"the next stage; at most {MAX_TENSORS} can be sent")
        _check_micro(micro)
        dst = self.next_of(chunk)[0]
        wires = [wire_mode(t.dtype, self.compression) for t in tensors]
        headers = [_header(t, len(tensors), is_tuple, w).to(self.device) for t, w in zip(tensors, wires)]
        for i, h in enumerate(headers):  # all of them before the check (Note [shapes once, ...])
            self._send(h, dst, tag(_ACTIVATION, micro, chunk, i, _HEAD))
        spec = (is_tuple, tuple((t.shape, t.dtype, w) for t, w in zip(tensors, wires)))
        first = self._sent.setdefault(chunk, spec)
        if spec != first:
            # the receiver has posted data receives of the first shapes (Note [receives posted
            # together]): fill them with zeros, so nothing is left waiting, then fail
            for i, part in enumerate(first[1]):
                shape, dtype = wire_spec(*part)
                self._send(torch.zeros(shape, dtype=dtype, device=self.device), dst,
                           tag(_ACTIVATION, micro, chunk, i, _DATA))
            raise PipelineShapeError(_changed(f"{self.name(self.stage, chunk)}: micro-batch {micro}'s "
                                              "output", spec, first))
        for i, (t, w) in enumerate(zip(tensors, wires)):
            self._send(encode(t, w), dst, tag(_ACTIVATION, micro, chunk, i, _DATA))

    def recv_activation(self, micro: int, chunk: int):
        """The input of this stage's `chunk` for `micro`: a tensor, or a tuple of them."""
        src, src_chunk = self.prev_of(chunk)
        if chunk in self._received and src != self.stage:
            return self._recv_expected(micro, chunk, src, src_chunk)
        h = self._recv(self._empty(_HEADER, torch.int64), src, tag(_ACTIVATION, micro, src_chunk, 0, _HEAD))
        count, is_tuple, *part = _read(h)
        parts = [tuple(part)]
        for i in range(1, count):
            h = self._recv(self._empty(_HEADER, torch.int64), src,
                           tag(_ACTIVATION, micro, src_chunk, i, _HEAD))
            parts.append(_read(h)[2:])
        spec = (is_tuple, tuple(parts))
        self._check_compression(spec, micro, chunk, src, src_chunk)
        first = self._received.setdefault(chunk, spec)
        if spec != first:
            raise PipelineShapeError(_changed(f"{self.name(self.stage, chunk)}: micro-batch {micro}'s input "
                                              f"from {self.name(src, src_chunk)}", spec, first))
        tensors = [decode(self._recv(self._empty(*wire_spec(*part)), src,
                                     tag(_ACTIVATION, micro, src_chunk, i, _DATA)), *part)
                   for i, part in enumerate(parts)]
        return tuple(tensors) if is_tuple else tensors[0]

    def _check_compression(self, spec: Spec, micro: int, chunk: int, src: int, src_chunk: int) -> None:
        for shape, dtype, wire in spec[1]:
            if wire != wire_mode(dtype, self.compression):
                raise PipelineShapeError(
                    f"{self.name(self.stage, chunk)}: micro-batch {micro}'s input from "
                    f"{self.name(src, src_chunk)} is {tuple(shape)} {dtype} sent as {wire}, but this stage's "
                    f"activation compression is {self.compression!r}: pipeline.activation_compression "
                    "must be the same on every stage")

    def _recv_expected(self, micro: int, chunk: int, src: int, src_chunk: int):
        """Note [receives posted together]: headers and data in flight at once, the data
        into buffers of the first micro-batch's shapes; the headers are still checked."""
        first = self._received[chunk]
        is_tuple, parts = first
        heads = [self._empty(_HEADER, torch.int64) for _ in parts]
        datas = [self._empty(*wire_spec(*part)) for part in parts]
        head_works = [comm.irecv(h, src=src, group=self.group, tag=tag(_ACTIVATION, micro, src_chunk, i, _HEAD))
                      for i, h in enumerate(heads)]
        data_works = [comm.irecv(d, src=src, group=self.group, tag=tag(_ACTIVATION, micro, src_chunk, i, _DATA))
                      for i, d in enumerate(datas)]
        for work in head_works:
            work.wait()
        got = [_read(h) for h in heads]
        spec = (got[0][1], tuple(g[2:] for g in got))
        if got[0][0] != len(parts) or spec != first:
            for work in data_works:  # the sender fills them with zeros before it fails
                work.wait()
            raise PipelineShapeError(_changed(f"{self.name(self.stage, chunk)}: micro-batch {micro}'s input "
                                              f"from {self.name(src, src_chunk)}", spec, first))
        for work in data_works:
            work.wait()
        tensors = [decode(d, *part) for d, part in zip(datas, parts)]
        return tuple(tensors) if is_tuple else tensors[0]

    # -- gradients (Note [tuples: only floating tensors carry gradients]) -------------------------
    def send_grads(self, grads: list[torch.Tensor | None], micro: int, chunk: int,
                   likes: list[torch.Tensor] | None = None) -> None:
        """Send the gradients of this chunk's floating inputs (None: it has none) to the
        previous virtual stage: their flags, then the ones that exist. Once the first
        micro-batch had all of them, a missing one goes as zeros of `likes[i]`'s shape
        (flagged absent: Note [receives posted together])."""
        dst = self.prev_of(chunk)[0]
        flags = torch.tensor([g is not None for g in grads], dtype=torch.int64, device=self.device)
        self._send(flags, dst, tag(_GRADIENT, micro, chunk, 0, _HEAD))
        complete = self._sent_all_grads.setdefault(chunk, all(g is not None for g in grads))
        for i, g in enumerate(grads):
            if g is not None:
                self._send(encode(g, wire_mode(g.dtype, self.compression)), dst,
                           tag(_GRADIENT, micro, chunk, i, _DATA))
            elif complete and dst != self.stage:
                if likes is None:
                    raise ValueError("send_grads: a gradient missing after a complete first micro-batch "
                                     "needs likes= (the inputs) to fill its posted receive")
                zeros = torch.zeros_like(likes[i], memory_format=torch.contiguous_format)
                self._send(encode(zeros, wire_mode(zeros.dtype, self.compression)), dst,
                           tag(_GRADIENT, micro, chunk, i, _DATA))

    def recv_grads(self, outputs: list[torch.Tensor], micro: int, chunk: int) -> list[torch.Tensor | None]:
        """The gradients of this chunk's floating `outputs` from the next virtual stage
        (None where it has none)."""
        src, src_chunk = self.next_of(chunk)
        if src != self.stage and self._all_flagged.get(chunk):
            return self._recv_all_grads(outputs, micro, chunk, src, src_chunk)
        flags = self._recv(self._empty(len(outputs), torch.int64), src,
                           tag(_GRADIENT, micro, src_chunk, 0, _HEAD)).tolist()
        self._all_flagged.setdefault(chunk, all(flags))
        return [self._decode_grad(self._recv(self._grad_buffer(y), src, tag(_GRADIENT, micro, src_chunk, i, _DATA)),
                                  y) if flag else None
                for i, (y, flag) in enumerate(zip(outputs, flags))]

    def _grad_buffer(self, y: torch.Tensor) -> torch.Tensor:
        """Where the gradient of output `y` arrives: y's shape and dtype, or compressed."""
        wire = wire_mode(y.dtype, self.compression)
        if wire == "none":  # as before compression existed (a buffer on y's device)
            return torch.empty_like(y, memory_format=torch.contiguous_format)
        return self._empty(*wire_spec(y.shape, y.dtype, wire))

    def _decode_grad(self, buf: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return decode(buf, y.shape, y.dtype, wire_mode(y.dtype, self.compression))

    def _recv_all_grads(self, outputs, micro: int, chunk: int, src: int, src_chunk: int):
        """Every output had a gradient in the first micro-batch: flags and gradients posted
        together (Note [receives posted together]); a gradient now missing arrives as
        zeros and is returned as None, as usual."""
        flags_buf = self._empty(len(outputs), torch.int64)
        grads = [self._grad_buffer(y) for y in outputs]
        flag_work = comm.irecv(flags_buf, src=src, group=self.group, tag=tag(_GRADIENT, micro, src_chunk, 0, _HEAD))
        works = [comm.irecv(g, src=src, group=self.group, tag=tag(_GRADIENT, micro, src_chunk, i, _DATA))
                 for i, g in enumerate(grads)]
        flag_work.wait()
        for work in works:  # an absent one arrives as zeros (send_grads)
            work.wait()
        return [self._decode_grad(g, y) if flag else None
                for flag, g, y in zip(flags_buf.tolist(), grads, outputs)]

    # -- transport -------------------------------------------------------------------------------
    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _send(self, t: torch.Tensor, dst: int, message: int) -> None:
        if dst == self.stage:
            self._local[message] = t.clone()
            return
        still = []
        for work, buf in self._pending:  # let go of what has arrived (GPipe sends m of them)
            if work.is_completed():
                work.wait()
            else:
                still.append((work, buf))
        still.append((comm.isend(t, dst=dst, group=self.group, tag=message), t))
        self._pending = still

    def _recv(self, t: torch.Tensor, src: int, message: int) -> torch.Tensor:
        if src != self.stage:
            comm.recv(t, src=src, group=self.group, tag=message)
            return t
        if message not in self._local:
            raise RuntimeError(f"stage {self.stage} waits for a message from one of its own chunks "
                               "that has not run yet: the schedule runs a virtual stage before the "
                               "one it depends on")
        return self._local.pop(message)

    def drain(self) -> None:
        """Wait until every send has been handed over (at the end of a batch, also on failure)."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()
        self._local.clear()


def _check_micro(micro: int) -> None:
    if not 0 <= micro < MAX_MICRO_BATCHES:
        raise ValueError(f"micro-batch index {micro} cannot be tagged: use fewer than "
                         f"{MAX_MICRO_BATCHES} micro-batches per batch")
