"""Safetensors files read as zero-copy views of a memory map, and written one tensor at a time.

The format is small: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the raw little-endian bytes. It is handled here rather than by the ``safetensors``
package because of what host memory costs, measured in ``tests/models/test_models_io.py``:

- Reading: ``safe_open(...).get_tensor`` copies each tensor out of its map. Loading a
  214 MB model onto 8 devices held 34.3 MB of transient host memory that way (two copies
  of its largest, 16.8 MB tensor), and 0.1 MB with the views here, which each device
  slices its shard from.
- Writing: ``safetensors.numpy.save_file`` takes every tensor at once, so an export would
  hold the whole model in host memory (a 7B model in fp32 is 28 GB);
  :func:`write_safetensors` produces and writes one tensor at a time.

The header is checked on opening, so a bad file fails in one line naming the file and
the tensor before anything is read. The package reads these files back in the tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

from podsjax.models.model_config import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """safetensors dtype string ("F32", "BF16", ...) of a numpy/jax dtype."""
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in safetensors") from None


# The reference reader's cap: a larger header is not a real checkpoint, so it is not read into memory.
MAX_HEADER_BYTES = 100_000_000


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(path: str, name: str, info: Any, data_bytes: int) -> None:
    """Raises CheckpointError unless ``info`` describes a tensor lying inside the data section."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry must be an object, got {info!r:.60}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where}: unsupported dtype {dtype!r:.60} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative ints, got {shape!r:.60}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets must be two non-negative ints, got {offsets!r:.60}")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets {offsets} begin after they end")
    if end > data_bytes:
        raise CheckpointError(f"{where}: data_offsets {offsets} run past the end of the file "
                              f"({data_bytes} data bytes; truncated?)")
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, "
                              f"but shape {shape} of {dtype} needs {nbytes}")


class SafetensorsFile:
    """Lazily memory-maps one .safetensors file; ``get`` returns zero-copy views.

    The whole header is validated on opening, so a corrupt file fails before any tensor
    is read (raising :class:`CheckpointError`, which names the file and the tensor).
    """

    def __init__(self, path: str):
        self.path = path
        file_bytes = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > min(file_bytes - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: corrupt safetensors header (length {size}, file {file_bytes} bytes)")
            try:
                header = json.loads(f.read(size).decode("utf-8"))
            except (ValueError, RecursionError) as err:  # also UnicodeDecodeError
                raise CheckpointError(f"{path}: corrupt safetensors header ({err})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header must be a JSON object, got a {type(header).__name__}")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise CheckpointError(f"{path}: __metadata__ must be an object, got {self.metadata!r:.60}")
        self._data_start = 8 + size
        for name, info in header.items():
            _check_entry(path, name, info, file_bytes - self._data_start)
        self.header: dict[str, dict[str, Any]] = header
        self._map: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype string ("F32", "BF16", "I64", ...) of tensor ``name``."""
        return self.header[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only view into the mapped file."""
        info = self.header[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write_safetensors(
    path: str,
    entries: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Writes tensors one at a time, each produced on demand by its callable.

    Args:
        path: output file.
        entries: ``(name, shape, dtype, produce)``; ``produce()`` must return an array of
            exactly that shape and dtype. Only one produced array is alive at a time.
        metadata: string metadata; ``{"format": "pt"}`` is what transformers expects.

    Returns:
        Bytes of tensor data written.
    """
    entries = list(entries)
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype, produce in entries:
            array = np.ascontiguousarray(produce())
            if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(f"{name}: produced {array.shape} {array.dtype}, declared {shape} {dtype}")
            f.write(array.reshape(-1).view(np.uint8).data)  # bytes view: works for bf16 too
            del array
    return offset
