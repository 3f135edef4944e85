"""Safetensors files read one tensor at a time and written as a stream, so no stage holds a whole model in memory.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} and the
raw little-endian tensor bytes. Reads use plain file reads, not a memory map: pages of a mapped multi-GB file
stay in the process's resident set for as long as it is mapped, which would count the whole file against the
converter's and the builder's memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 8  # the header is padded with spaces to a multiple of 8 bytes, as the reference writer does


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file."""


class SafetensorsFile(Mapping[str, torch.Tensor]):
    """Read-only mapping name -> tensor over one .safetensors file; a tensor is read from disk on each lookup."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError("file shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SafetensorsError(f"header length {n} exceeds the file size {size}")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"header is not JSON ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"bad header entry for {name!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or self._data_start + end > size:
                raise SafetensorsError(f"tensor {name!r} lies outside the file (truncated?)")
            self._entries[name] = (dtype, shape, self._data_start + begin, end - begin)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name][0]

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = self._entries[name]
        buf = bytearray(nbytes)
        with open(self.path, "rb") as f:
            f.seek(offset)
            if f.readinto(buf) != nbytes:
                raise SafetensorsError(f"tensor {name!r} is truncated")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


class SafetensorsWriter:
    """Writes a .safetensors file one tensor at a time, so a tensor may be freed right after it is written.

    The header (names, dtypes, shapes, offsets) comes first in the format but is known only at the end: the data
    goes to `<path>.data` as it arrives, and `close()` writes the header and moves the data behind it with
    copy_file_range (a copy inside the kernel: no user-space buffer holds it).
    """

    def __init__(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._data = open(self._data_path, "wb")  # noqa: SIM115 (closed by close())
        self._offset = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._header:
            raise ValueError(f"{self.path}: tensor {name} written twice")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        start = self._offset  # NOTE: safetensors requires tensors back to back, without padding
        self._data.write(memoryview(data))
        self._header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [start, start + data.nbytes]}
        self._offset = start + data.nbytes

    def close(self) -> None:
        self._data.close()
        raw = json.dumps(self._header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % _ALIGN)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(raw)) + raw)
            out.flush()
            remaining = self._offset
            while remaining > 0:
                copied = os.copy_file_range(data.fileno(), out.fileno(), remaining)
                if copied == 0:
                    raise OSError(f"{self._data_path} ended {remaining} bytes early")
                remaining -= copied
        self._data_path.unlink()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._data.close()
            self._data_path.unlink(missing_ok=True)
