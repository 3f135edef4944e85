"""Engine weights outside the ONNX graph, as ONNX external data: the graph file stays small and has no size limit.

While a network is built and rewritten, every initializer of at least INLINE_MAX_BYTES lives in a staging file
beside the engine and the ModelProto holds only its name, type, shape and (file name, offset, length). The staging
file's path is recorded in the model's metadata (STAGING_KEY), so every pass finds it through the model alone.
Passes read such a constant when they need its values and append the tensors they make; the tensors they drop
are left behind in the staging file. `save_engine_files` then moves the initializers the final graph uses to the
front of the staging file, page-aligned so that ONNX Runtime can map them, cuts off the rest, and renames it to
the engine's weight file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

STAGING_KEY = "trtbuild.staging_weights"
INLINE_MAX_BYTES = 1024  # smaller initializers (shapes, split sizes, norms of tiny models) stay in the graph file
ALIGN = 4096  # page-aligned offsets: ONNX Runtime maps external data rather than copying it
_COPY_CHUNK = 64 << 20
_PLAIN_DTYPES = {np.dtype(t) for t in (np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.int32,
                                        np.int64, np.bool_)}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _external(tensor: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _point_at(tensor: TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


class StagingWeights:
    """Append-only staging file for the large initializers of a network under construction."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).resolve()
        self.path.touch()

    @classmethod
    def of(cls, model: onnx.ModelProto) -> StagingWeights | None:
        """The staging file a model under construction writes to, or None for an all-in-memory model."""
        path = next((p.value for p in model.metadata_props if p.key == STAGING_KEY), None)
        return None if path is None else cls(Path(path))

    def attach(self, model: onnx.ModelProto) -> None:
        entry = model.metadata_props.add()
        entry.key, entry.value = STAGING_KEY, str(self.path)

    def tensor(self, name: str, value: np.ndarray) -> TensorProto:
        """A TensorProto for `value`: in the graph when small, else appended here and referred to."""
        value = np.ascontiguousarray(value)
        if value.nbytes < INLINE_MAX_BYTES:
            return numpy_helper.from_array(value, name)
        if value.dtype in _PLAIN_DTYPES:  # ONNX's raw layout is numpy's: write the array itself, no copy
            data_type, raw = onnx.helper.np_dtype_to_tensor_dtype(value.dtype), memoryview(value.reshape(-1))
        else:  # packed or custom types (int4, float8, bfloat16): ONNX's own serialisation
            full = numpy_helper.from_array(value, name)
            data_type, raw = full.data_type, full.raw_data
        with open(self.path, "ab") as f:
            offset = _aligned(f.tell())
            f.truncate(offset)
            f.seek(offset)
            f.write(raw)
        # NOTE: a fresh message, never one whose raw_data was cleared: protobuf keeps a cleared field's bytes in the
        # message's arena until the message is freed, so every weight would stay in memory until the build ends.
        t = TensorProto(name=name, data_type=data_type, dims=value.shape)
        _point_at(t, self.path.name, offset, raw.nbytes if isinstance(raw, memoryview) else len(raw))
        return t

    def read(self, tensor: TensorProto) -> np.ndarray:
        return read_external(tensor, self.path.parent)


def make_initializer(staging: StagingWeights | None, name: str, value: np.ndarray) -> TensorProto:
    """The initializer `name`: in the staging file when there is one and it is large, else in the graph."""
    return staging.tensor(name, value) if staging else numpy_helper.from_array(np.ascontiguousarray(value), name)


def read_external(tensor: TensorProto, base_dir: Path) -> np.ndarray:
    """The values of an initializer stored as external data, in a file in `base_dir`."""
    info = _external(tensor)
    path = Path(base_dir) / info["location"]
    offset, length = int(info.get("offset", 0)), int(info["length"])
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(f"{path}: initializer {tensor.name} is truncated")
    inline = TensorProto()
    inline.CopyFrom(tensor)
    inline.data_location = TensorProto.DEFAULT
    del inline.external_data[:]
    inline.raw_data = raw
    return numpy_helper.to_array(inline)


def save_engine_files(model: onnx.ModelProto, graph_path: Path, weights_path: Path) -> int:
    """Write the graph to `graph_path` and the external initializers it uses to `weights_path` (on the staging
    file's filesystem); the staging file becomes that file. Returns the weight file's size in bytes."""
    staging = StagingWeights.of(model)
    graph_path, weights_path = Path(graph_path), Path(weights_path)
    external = [t for t in model.graph.initializer if is_external(t)]
    if staging is None and external:
        raise ValueError("the model has external initializers but no staging file")
    if staging is not None and (elsewhere := [t.name for t in external
                                              if _external(t)["location"] != staging.path.name]):
        raise ValueError(f"initializers {elsewhere[:3]} are not in the staging file {staging.path.name}")
    for entry in [p for p in model.metadata_props if p.key == STAGING_KEY]:
        model.metadata_props.remove(entry)
    if staging is None:
        weights_path.write_bytes(b"")
    else:
        _compact(staging.path, external, weights_path.name)
        os.replace(staging.path, weights_path)
    onnx.save_model(model, str(graph_path))
    return weights_path.stat().st_size


def _compact(path: Path, tensors: list[TensorProto], location: str) -> None:
    """Move the used initializers of staging file `path` to its front, in file order, page-aligned, and truncate it
    there; point `tensors` at their new places in a file called `location`. NOTE: in place, not copied to a new
    file: an 8B build's staging file (checkpoint-form weights, then the packed ones) is ~2.4x its engine, and a copy
    would need the engine's size again on the disk. Each tensor moves towards the front (the ones before it take at
    most the space they took), so a forward copy never overwrites what it has yet to read."""
    moved: dict[int, int] = {}  # old offset -> new offset (two initializers may share one tensor's bytes)
    end = 0
    with open(path, "r+b") as f:
        for t in sorted(tensors, key=lambda t: int(_external(t).get("offset", 0))):
            source, length = int(_external(t).get("offset", 0)), int(_external(t)["length"])
            if source not in moved:
                moved[source] = dest = _aligned(end)
                for start in range(0, length, _COPY_CHUNK):
                    if dest == source:
                        break
                    f.seek(source + start)
                    chunk = f.read(min(_COPY_CHUNK, length - start))
                    f.seek(dest + start)
                    f.write(chunk)
                end = max(end, dest + length)
            _point_at(t, location, moved[source], length)
        f.truncate(end)
