"""Minimal safetensors reader (memory-mapped) and streaming writer.

The ``safetensors`` package reads whole files into dicts (and its numpy backend has no
bfloat16). Loading a sharded model with one-tensor peak host memory needs lazy reads,
and exporting needs to stream tensors to disk one at a time, so the (simple) format is
handled here: 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

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


class SafetensorsFile:
    """Lazily memory-maps one .safetensors file; ``get`` returns zero-copy views."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", raw)
            if size > os.path.getsize(path) - 8:
                raise ValueError(f"{path}: corrupt safetensors header (length {size})")
            try:
                header = json.loads(f.read(size))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: corrupt safetensors header ({err})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header: dict[str, dict[str, Any]] = header
        self._data_start = 8 + size
        self._map: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only view into the mapped file."""
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} byte range does not match its shape/dtype")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        if self._data_start + end > self._map.size:
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(dtype).reshape(info["shape"])


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
