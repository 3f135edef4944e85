"""trtbuild::Mamba2Scan (Granite 4.0-H's Mamba2 layers): the numpy reference of plugins/mamba2.py against
transformers' recurrence step (mamba2_selective_state_update) and gated group norm, and the native CPU kernel
(cpu_ops/mamba2.cc) run by ONNX Runtime against the reference: a packed batch of a fresh prefill, a continuing chunk
and decode tokens, two groups of heads, states updated in place in their slots, bad slots refused. Logits of whole
models against transformers: tests/test_hf_parity.py (granite4_h, granite4_h_moe)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from trtbuild import cpu_ops
from trtbuild.plugins import mamba2

HEADS, HEAD_DIM, STATE, GROUPS, SLOTS, LAYERS = 4, 8, 16, 2, 6, 3
INNER = HEADS * HEAD_DIM
CHANNELS = INNER + 2 * GROUPS * STATE
SEQS = [(0, 5), (7, 3), (12, 1), (3, 1)]  # (past length, new tokens)
SEQ_SLOTS = [4, 0, 2, 5]
EPS = 1e-5

native = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                            reason=f"the native CPU op library is unavailable: {cpu_ops.unavailable_reason()}")


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = sum(n for _, n in SEQS)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"xbc": f(tokens, CHANNELS), "z": f(tokens, INNER), "dt": f(tokens, HEADS),
            "A": -np.exp(f(HEADS) * 0.5), "dt_bias": f(HEADS), "D": f(HEADS), "norm_weight": 1 + 0.1 * f(INNER),
            "recurrent_state": f(SLOTS, LAYERS, HEADS, HEAD_DIM, STATE),
            "state_slots": np.array(SEQ_SLOTS, dtype=np.int64),
            "past_lengths": np.array([p for p, _ in SEQS], dtype=np.int64),
            "query_start_loc": np.cumsum([0] + [n for _, n in SEQS]).astype(np.int64)}


def test_the_reference_is_transformers_recurrence_and_gated_norm():
    """Token by token from a zero state, transformers' single-step update and its RMSNormGated (norm after the gate,
    over each group's channels) give the reference's rows and final state."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridRMSNormGated,
        mamba2_selective_state_update,
    )

    feeds, n = inputs(1), 6
    u = torch.nn.functional.silu(torch.tensor(feeds["xbc"][:n]))
    x, b, c = u[:, :INNER], u[:, INNER:INNER + GROUPS * STATE], u[:, INNER + GROUPS * STATE:]
    state = torch.zeros(1, HEADS, HEAD_DIM, STATE)
    expand = lambda v: torch.tensor(v)[:, None].expand(-1, HEAD_DIM)  # noqa: E731
    norm = GraniteMoeHybridRMSNormGated(INNER, group_size=INNER // GROUPS, eps=EPS)
    norm.weight.data = torch.tensor(feeds["norm_weight"])
    rows = []
    for t in range(n):
        out = mamba2_selective_state_update(
            state, x[t].view(1, HEADS, HEAD_DIM), torch.tensor(feeds["dt"][t])[None, :, None].expand(-1, -1, HEAD_DIM),
            torch.tensor(feeds["A"])[:, None, None].expand(-1, HEAD_DIM, STATE), b[t].view(1, GROUPS, STATE),
            c[t].view(1, GROUPS, STATE), expand(feeds["D"]), dt_bias=expand(feeds["dt_bias"]), dt_softplus=True)
        rows.append(norm(out.reshape(1, INNER), torch.tensor(feeds["z"][t:t + 1]))[0])
    ours = np.zeros((1, 1, HEADS, HEAD_DIM, STATE), dtype=np.float32)
    y = mamba2.reference_mamba2(*(feeds[k][:n] for k in ("xbc", "z", "dt")), *(feeds[k] for k in mamba2.INPUTS[3:7]),
                                ours, np.array([0]), np.array([0]), np.array([0, n]), state_layer=0,
                                num_groups=GROUPS, epsilon=EPS)
    np.testing.assert_allclose(y, torch.stack(rows).detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ours[0, 0], state[0].numpy(), rtol=1e-5, atol=1e-6)


def session() -> ort.InferenceSession:
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {"xbc": ["T", CHANNELS], "z": ["T", INNER], "dt": ["T", HEADS], "A": [HEADS], "dt_bias": [HEADS],
              "D": [HEADS], "norm_weight": [INNER], "recurrent_state": ["S", LAYERS, HEADS, HEAD_DIM, STATE],
              "state_slots": ["B"], "past_lengths": ["B"], "query_start_loc": ["B1"]}
    ins = [helper.make_tensor_value_info(n, i64 if n in ("state_slots", "past_lengths", "query_start_loc") else f32,
                                         shapes[n]) for n in mamba2.INPUTS]
    node = helper.make_node(mamba2.OP_TYPE, list(mamba2.INPUTS), ["y"], domain=mamba2.DOMAIN, state_layer=1,
                            num_groups=GROUPS, epsilon=EPS)
    graph = helper.make_graph([node], "mamba2", ins, [helper.make_tensor_value_info("y", f32, ["T", INNER])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(mamba2.DOMAIN, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@native
def test_native_kernel_matches_the_reference_and_updates_the_states_in_place():
    feeds = inputs()
    expected_state = feeds["recurrent_state"].copy()
    expected = mamba2.reference_mamba2(*(feeds[n] for n in mamba2.INPUTS[:7]), expected_state,
                                       *(feeds[n] for n in mamba2.INPUTS[8:]), state_layer=1, num_groups=GROUPS,
                                       epsilon=EPS)
    before = feeds["recurrent_state"].copy()
    (y,) = session().run(None, feeds)
    np.testing.assert_allclose(y, expected, rtol=2e-4, atol=2e-5)
    states = feeds["recurrent_state"]
    np.testing.assert_allclose(states, expected_state, rtol=2e-4, atol=2e-5)
    untouched = [s for s in range(SLOTS) if s not in SEQ_SLOTS]
    assert np.array_equal(states[untouched], before[untouched]) and np.array_equal(states[:, [0, 2]],
                                                                                   before[:, [0, 2]])


@native
@pytest.mark.parametrize("slots, message", [([4, 0, 2, 4], "share a state slot"), ([4, 0, 2, 6], "outside")])
def test_bad_state_slots_are_refused(slots, message):
    with pytest.raises(Exception, match=message):
        session().run(None, dict(inputs(), state_slots=np.array(slots, dtype=np.int64)))
