"""Messages on the wire: a pickled header with the tensors pulled out, then the tensors as bytes.

A message is any picklable object with tensors anywhere inside it (dataclass fields, lists, dicts).
`pack` pickles it with a `pickle.Pickler` whose ``reducer_override`` replaces every tensor by its
index in a side list, so no tensor is ever pickled: the header holds the object graph plus, per
tensor, its shape and dtype, and the tensors travel separately as flat ``uint8`` views of their
data (any dtype, no conversion). `unpack` reads the header's tensor specs, the caller receives
that many byte buffers, and `rebuild` unpickles the body, each index turning back into its
buffer viewed as its dtype and shape. The same tensor object appearing twice in a message
travels once and arrives as one object (pickle's memo).

Why ``reducer_override`` and not ``persistent_id``: pickle calls ``persistent_id`` (Python) for
every object of the message, ints and strings included, while it skips ``reducer_override`` for
the built-in types: packing a pipeline request went from ~36 to ~20 µs here.

Tensors arrive detached (``requires_grad`` is not sent) and as plain ``torch.Tensor`` (a
``Parameter`` arrives as its data). Sparse, quantized, meta and other subclassed tensors are
refused with an `SmpartError` when the message is packed.

The header frame: the header is sent as a fixed-size first frame (``FRAME_BYTES``; its first 8
bytes are the header's length, the rest its first bytes) and, only when the header does not fit,
a tail with the remaining bytes. The receiver can post the frame's receive before it knows the
size, and a small message costs one header send instead of a length plus a payload.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from typing import Any

import torch

from smpart.errors import SmpartError

FRAME_BYTES = 4096
"""Size of the first header frame; a header longer than ``FRAME_BYTES - 8`` sends a tail. Most
headers fit (a request with its arguments' metadata is ~0.5 KB, a step's result ~2 KB): a tail is a
second transfer, which waits for the receiver to post it once the frame arrived."""

GOODBYE = -1
"""Length written in a frame that carries no message: the sender will send nothing more."""

_LENGTH = struct.Struct("<q")

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""What the receiver needs to allocate a tensor: its shape and dtype."""

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

# dtypes travel by name ("float32"): a short string pickles and unpickles faster than a torch.dtype.
_DTYPE_NAME = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
_DTYPE = {name: dtype for dtype, name in _DTYPE_NAME.items()}


#: A CPU tensor this small travels inside the header: a separate transfer (a handshake with the
#: receiver each) would cost far more than its bytes (a loss, a small gradient, a routing index).
INLINE_BYTES = 1024


class _TensorPickler(pickle.Pickler):
    """Pickles an object graph, replacing each tensor by its index in ``self.tensors``, or, for a
    small CPU tensor, by its bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self.inline_bytes = 0

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        _check_sendable(obj)
        size = obj.numel() * obj.element_size()
        if obj.device.type == "cpu" and size <= INLINE_BYTES:
            self.inline_bytes += size
            data = bytes(to_wire(obj.detach()).numpy()) if size else b""
            return _inline_tensor, (data, tuple(obj.shape), _DTYPE_NAME[obj.dtype])
        self.tensors.append(obj)
        return _received_tensor, (len(self.tensors) - 1,)


_rebuilding = threading.local()  # the tensors of the message this thread is rebuilding


def _received_tensor(index: int) -> torch.Tensor:
    return _rebuilding.tensors[index]


def _inline_tensor(data: bytes, shape: tuple[int, ...], dtype_name: str) -> torch.Tensor:
    spec = (shape, _DTYPE[dtype_name])
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else empty_for(spec)
    return from_wire(buffer, spec)


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


def pack(message: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header of ``message`` and its tensors, in the order the header lists them.

    Raises whatever pickling raises (the caller wraps it) or `SmpartError` for unsendable tensors.
    """
    header, tensors, _ = pack_counted(message)
    return header, tensors


def pack_counted(message: Any) -> tuple[bytes, list[torch.Tensor], int]:
    """`pack`, and the bytes of the tensors that went inside the header."""
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    pickler.dump(message)
    specs = [(tuple(t.shape), _DTYPE_NAME[t.dtype]) for t in pickler.tensors]
    header = pickle.dumps((specs, buffer.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    return header, pickler.tensors, pickler.inline_bytes


def unpack(header: bytes) -> tuple[list[TensorSpec], bytes]:
    """The tensor specs and the pickled body of a header made by `pack`."""
    specs, body = pickle.loads(header)
    return [(shape, _DTYPE[name]) for shape, name in specs], body


def rebuild(body: bytes, tensors: list[torch.Tensor]) -> Any:
    """The message, from the body `unpack` returned and its received tensors."""
    _rebuilding.tensors = tensors
    try:
        return pickle.loads(body)
    finally:
        _rebuilding.tensors = None


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


def frame(header: bytes | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed-size first frame for ``header`` (None: a goodbye) and the tail, if it needs one."""
    raw = bytearray(FRAME_BYTES)
    if header is None:
        _LENGTH.pack_into(raw, 0, GOODBYE)
        return torch.frombuffer(raw, dtype=torch.uint8), None
    _LENGTH.pack_into(raw, 0, len(header))
    room = FRAME_BYTES - _LENGTH.size
    raw[_LENGTH.size : _LENGTH.size + min(room, len(header))] = header[:room]
    tail = None
    if len(header) > room:
        tail = torch.frombuffer(bytearray(header[room:]), dtype=torch.uint8)
    return torch.frombuffer(raw, dtype=torch.uint8), tail


def frame_length(frame_tensor: torch.Tensor) -> int:
    """The header length a received frame announces (`GOODBYE` for a goodbye)."""
    return _LENGTH.unpack_from(frame_tensor.numpy().tobytes(), 0)[0]


def tail_size(length: int) -> int:
    """How many header bytes follow the frame for a header of ``length`` bytes."""
    return max(0, length - (FRAME_BYTES - _LENGTH.size))


def header_of(frame_tensor: torch.Tensor, tail: torch.Tensor | None, length: int) -> bytes:
    """The header bytes, joined from a received frame and tail."""
    head = frame_tensor.numpy().tobytes()[_LENGTH.size : _LENGTH.size + length]
    return head if tail is None else head + tail.numpy().tobytes()
