"""builder/weight_file.py: the staging file becomes the engine's weight file in place, holding only what the final
graph uses, page-aligned, each tensor's bytes unchanged."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from trtbuild.builder import weight_file
from trtbuild.builder.weight_file import ALIGN, StagingWeights, read_external, save_engine_files


def test_the_staging_file_keeps_only_the_used_tensors_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_file, "_COPY_CHUNK", 1000)  # tensors move in several chunks, overlapping their source
    staging = StagingWeights(tmp_path / "rank0.weights.staging")
    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal(n).astype(np.float32) for name, n in
              (("dropped", 3000), ("a", 1500), ("also_dropped", 700), ("b", 5000))}
    tensors = {name: staging.tensor(name, v) for name, v in values.items()}
    shared = onnx.TensorProto()
    shared.CopyFrom(tensors["b"])
    shared.name = "b_again"  # a second initializer over the same bytes
    graph = helper.make_graph([helper.make_node("Add", ["b", "a"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              initializer=[tensors["b"], tensors["a"], shared])
    model = helper.make_model(graph)
    staging.attach(model)

    size = save_engine_files(model, tmp_path / "rank0.onnx", tmp_path / "rank0.weights")

    assert not staging.path.exists()
    saved = onnx.load(str(tmp_path / "rank0.onnx"), load_external_data=False)
    assert not any(p.key == weight_file.STAGING_KEY for p in saved.metadata_props)
    offsets = {}
    for t in saved.graph.initializer:
        name = "b" if t.name == "b_again" else t.name
        np.testing.assert_array_equal(read_external(t, tmp_path), values[name])
        offsets[t.name] = int(next(e.value for e in t.external_data if e.key == "offset"))
    # file order, page-aligned (a's 6000 bytes take two pages), the shared bytes once
    assert offsets == {"a": 0, "b": 2 * ALIGN, "b_again": 2 * ALIGN}
    assert size == 2 * ALIGN + values["b"].nbytes == (tmp_path / "rank0.weights").stat().st_size
