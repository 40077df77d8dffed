"""Messages on the wire: a pickled header with the tensors pulled out, and the tensors as bytes.

A message is any picklable object with tensors anywhere inside it (dataclass fields, lists, dicts).
`pack` pickles it with a `pickle.Pickler` whose ``reducer_override`` replaces every tensor by its
index in a side list, so no tensor is ever pickled: the header holds the object graph plus, per
tensor, its shape, dtype and where its bytes are, and the bytes travel as flat ``uint8`` views of
the data (any dtype, no conversion). The same tensor object appearing twice in a message travels
once and arrives as one object (pickle's memo).

One transfer per message, where it can be. A message is a *frame*::

    [header length | frame length | header | inline tensor bytes ...]   (+ a tail past FRAME_BYTES)

followed by one transfer per tensor that did not go inline. CPU tensors go inline while their
bytes fit ``inline_budget`` (small ones always), so on gloo a pipeline message (an activation, a
gradient, a request with its arguments) is one transfer: the receiver has the frame's receive
posted before the message exists (a buffer of ``FRAME_BYTES``; the sender sends only the bytes it
uses), while a tensor sent on its own waits for the receiver to post its receive once the frame
arrived. Bigger tensors, and CUDA tensors for NCCL, travel on their own, with no copy. The
receiver opens a frame (`open_frame`: the header's specs, and the inline tensors copied out, so
the frame's buffer can take the next message), receives the tensors the specs list, and
`rebuild` unpickles the body, each index turning back into its tensor.

Why ``reducer_override`` and not ``persistent_id``: pickle calls ``persistent_id`` (Python) for
every object of the message, ints and strings included, while it skips ``reducer_override`` for
the built-in types: packing a pipeline request went from ~36 to ~20 µs here.

Tensors arrive detached (``requires_grad`` is not sent) and as plain ``torch.Tensor`` (a
``Parameter`` arrives as its data). Sparse, quantized, meta and other subclassed tensors are
refused with an `SmpartError` when the message is packed.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from smpart.errors import SmpartError

FRAME_BYTES = 1 << 20
"""Size of the buffer a receiver posts for the next message's first transfer (the *frame*). A
message is sent as one frame when its header and inline tensors fit (the sender sends only the
bytes used); a bigger one sends the first ``FRAME_BYTES`` as the frame and the rest as a tail."""

INLINE_BUDGET = 512 << 10
"""CPU tensors of a message travel inside its frame while their bytes add up to at most this
much (``inline_budget`` of `pack`). Each transfer costs a handshake with the receiver and work on
gloo's I/O thread (here ~100-200 µs of CPU per transfer, half a round trip of latency for one
posted after the frame arrived), far more than copying the bytes into the frame and out again."""

SMALL_BYTES = 1024
"""A CPU tensor this small always travels inside the frame, whatever the budget: a loss, a small
gradient, a routing index (with NCCL, whose budget is 0, they still need no CUDA transfer)."""

GOODBYE = -1
"""Header length written in a frame that carries no message: the sender will send nothing more."""

_LENGTHS = struct.Struct("<qq")  # header length, whole frame length (with a tail)
OUT_OF_BAND = -1  # a tensor spec's offset when the tensor travels on its own

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""What the receiver needs to allocate a tensor: its shape and dtype."""

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

# dtypes travel by name ("float32"): a short string pickles and unpickles faster than a torch.dtype.
_DTYPE_NAME = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
_DTYPE = {name: dtype for dtype, name in _DTYPE_NAME.items()}


@dataclass(slots=True)
class Packed:
    """A message ready to send: its ``frame`` (the first transfer), the ``tail`` when it did not fit,
    and the ``tensors`` that travel on their own, in order."""

    frame: torch.Tensor
    tail: torch.Tensor | None
    tensors: list[torch.Tensor]
    tensor_bytes: int  # payload bytes of all its tensors, inside the frame or not


@dataclass(slots=True)
class Incoming:
    """A received frame, opened: the ``specs`` of the tensors still to receive (in order) and what
    `rebuild` needs besides them."""

    specs: list[TensorSpec]
    body: bytes
    inline: dict[int, torch.Tensor]  # tensor index -> tensor that came in the frame
    order: list[int]  # tensor index of each spec in ``specs``


class _TensorPickler(pickle.Pickler):
    """Pickles an object graph, replacing each tensor by its index in ``self.tensors``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.file = file
        self.tensors: list[torch.Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        _check_sendable(obj)
        self.tensors.append(obj)
        return _received_tensor, (len(self.tensors) - 1,)


_rebuilding = threading.local()  # the tensors of the message this thread is rebuilding


def _received_tensor(index: int) -> torch.Tensor:
    return _rebuilding.tensors[index]


def _check_sendable(tensor: torch.Tensor) -> None:
    kind = None
    if type(tensor) not in _PLAIN_TENSOR_TYPES:
        kind = f"a {type(tensor).__name__} (tensor subclass)"
    elif tensor.layout != torch.strided:
        kind = f"a {tensor.layout} tensor"
    elif tensor.is_quantized:
        kind = "a quantized tensor"
    elif tensor.device.type == "meta":
        kind = "a meta tensor (it has no data)"
    if kind is not None:
        raise SmpartError(
            f"a message holds {kind}; only dense tensors with data can be sent between processes: "
            "send plain tensors (e.g. .to_dense(), .dequantize()) or plain data instead"
        )


def pack(message: Any, inline_budget: int = INLINE_BUDGET) -> Packed:
    """``message`` as a frame (header, then the CPU tensors that fit ``inline_budget``), a tail if
    the frame would pass ``FRAME_BYTES``, and the tensors that travel on their own.

    Raises whatever pickling raises (the caller wraps it) or `SmpartError` for unsendable tensors.
    """
    body, tensors = _pickled(message)
    specs, inline, separate = [], [], []
    offset = total = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        total += size
        if tensor.device.type == "cpu" and (size <= SMALL_BYTES or offset + size <= inline_budget):
            specs.append((tuple(tensor.shape), _DTYPE_NAME[tensor.dtype], offset))
            inline.append((offset, size, tensor))
            offset += size
        else:
            specs.append((tuple(tensor.shape), _DTYPE_NAME[tensor.dtype], OUT_OF_BAND))
            separate.append(tensor)
    header = pickle.dumps((specs, body), protocol=pickle.HIGHEST_PROTOCOL)
    start = _LENGTHS.size + len(header)
    raw = numpy.empty(start + offset, dtype=numpy.uint8)
    _LENGTHS.pack_into(raw, 0, len(header), start + offset)
    raw[_LENGTHS.size : start] = numpy.frombuffer(header, dtype=numpy.uint8)
    for at, size, tensor in inline:
        if size:
            raw[start + at : start + at + size] = host_bytes(tensor)
    whole = torch.from_numpy(raw)
    if raw.size <= FRAME_BYTES:
        return Packed(whole, None, separate, total)
    return Packed(whole[:FRAME_BYTES], whole[FRAME_BYTES:], separate, total)


_picklers = threading.local()  # one pickler per thread, reused: making one costs more than using it


def _pickled(message: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``message`` pickled with its tensors replaced by indices, and those tensors."""
    pickler = getattr(_picklers, "pickler", None) or _TensorPickler(io.BytesIO())
    _picklers.pickler = None  # taken: a pack inside this one (from some __reduce__) makes its own
    file = pickler.file
    try:
        pickler.dump(message)
        return file.getvalue(), pickler.tensors
    finally:
        pickler.tensors = []
        pickler.clear_memo()
        file.seek(0)
        file.truncate()
        _picklers.pickler = pickler


def goodbye() -> torch.Tensor:
    """The frame that says the sender will send nothing more."""
    frame = torch.zeros(_LENGTHS.size, dtype=torch.uint8)
    _LENGTHS.pack_into(frame.numpy(), 0, GOODBYE, _LENGTHS.size)
    return frame


def frame_lengths(frame: torch.Tensor) -> tuple[int, int]:
    """The header length a received frame announces (`GOODBYE` for a goodbye) and the whole
    frame's length (tail included)."""
    return _LENGTHS.unpack_from(frame.numpy(), 0)


def tail_size(length: int) -> int:
    """How many bytes follow the frame for a whole frame of ``length`` bytes."""
    return max(0, length - FRAME_BYTES)


def open_frame(frame: torch.Tensor, tail: torch.Tensor | None) -> Incoming:
    """The header and inline tensors of a received frame (and its tail). ``frame`` may be reused
    afterwards: what is taken from it is copied."""
    header_length, length = frame_lengths(frame)
    raw = frame.numpy() if tail is None else numpy.concatenate([frame.numpy()[:FRAME_BYTES], tail.numpy()])
    start = _LENGTHS.size + header_length
    specs, body = pickle.loads(raw[_LENGTHS.size : start])
    incoming = Incoming([], body, {}, [])
    for index, (shape, name, offset) in enumerate(specs):
        spec = (shape, _DTYPE[name])
        if offset == OUT_OF_BAND:
            incoming.specs.append(spec)
            incoming.order.append(index)
        else:
            size = nbytes(spec)
            # its own storage (the frame's buffer takes the next message)
            incoming.inline[index] = from_host_bytes(raw[start + offset : start + offset + size], spec)
    return incoming


def rebuild(incoming: Incoming, received: list[torch.Tensor]) -> Any:
    """The message, from its opened frame and its tensors received on their own (in spec order)."""
    tensors = dict(incoming.inline)
    tensors.update(zip(incoming.order, received, strict=True))
    _rebuilding.tensors = tensors
    try:
        return pickle.loads(incoming.body)
    finally:
        _rebuilding.tensors = None


#: The dtypes numpy holds as they are: their bytes are read and viewed through numpy, a few times
#: cheaper per call than torch's views for the small tensors most messages carry (``bfloat16``
#: and the float8 types take torch's way).
_NUMPY_DTYPE = {
    torch.float64: numpy.float64, torch.float32: numpy.float32, torch.float16: numpy.float16,
    torch.int64: numpy.int64, torch.int32: numpy.int32, torch.int16: numpy.int16, torch.int8: numpy.int8,
    torch.uint8: numpy.uint8, torch.bool: numpy.bool_, torch.complex128: numpy.complex128,
    torch.complex64: numpy.complex64,
}


def host_bytes(tensor: torch.Tensor) -> numpy.ndarray:
    """A CPU tensor's data as flat contiguous ``uint8`` (no copy where it is contiguous)."""
    if tensor.dtype in _NUMPY_DTYPE and not tensor.is_conj() and not tensor.is_neg():
        return numpy.ascontiguousarray(tensor.detach().numpy()).reshape(-1).view(numpy.uint8)
    return to_wire(tensor).numpy()


def from_host_bytes(data: numpy.ndarray, spec: TensorSpec) -> torch.Tensor:
    """A tensor of ``spec`` holding a copy of the bytes ``data``."""
    shape, dtype = spec
    kind = _NUMPY_DTYPE.get(dtype)
    if kind is not None:
        return torch.from_numpy(data.copy().view(kind).reshape(shape))
    if not data.size:  # numpy's empty array cannot be viewed by torch
        return from_wire(empty_for(spec), spec)
    return from_wire(torch.from_numpy(data.copy()), spec)


def nbytes(spec: TensorSpec) -> int:
    shape, dtype = spec
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def to_wire(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``tensor``'s data as a flat contiguous ``uint8`` tensor (on ``device`` if given), no copy if
    it already is contiguous and on that device."""
    tensor = tensor.detach()
    if device is not None:
        tensor = tensor.to(device)
    return tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def empty_for(spec: TensorSpec, device: torch.device | None = None) -> torch.Tensor:
    """A ``uint8`` buffer to receive a tensor of ``spec`` into."""
    return torch.empty(nbytes(spec), dtype=torch.uint8, device=device)


def from_wire(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The received ``buffer`` viewed as the tensor ``spec`` describes (no copy)."""
    shape, dtype = spec
    return buffer.view(dtype).reshape(shape)
