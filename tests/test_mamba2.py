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
# (new tokens, slot): sequence 0's state after 2 of its 5 tokens kept in slot 1, sequence 1's after all 3 in slot 3
CHECKPOINTS = [[2, 1], [3, 3], [0, -1], [0, -1]]
INT64 = ("state_slots", "past_lengths", "query_start_loc", "state_checkpoints")
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
            "query_start_loc": np.cumsum([0] + [n for _, n in SEQS]).astype(np.int64),
            "state_checkpoints": np.array(CHECKPOINTS, dtype=np.int64)}


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


def session(checkpoints: bool = True) -> ort.InferenceSession:
    """The op alone; without `checkpoints`, as engines built before state_checkpoints have it (11 inputs)."""
    names = mamba2.INPUTS if checkpoints else mamba2.INPUTS[:-1]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {"xbc": ["T", CHANNELS], "z": ["T", INNER], "dt": ["T", HEADS], "A": [HEADS], "dt_bias": [HEADS],
              "D": [HEADS], "norm_weight": [INNER], "recurrent_state": ["S", LAYERS, HEADS, HEAD_DIM, STATE],
              "state_slots": ["B"], "past_lengths": ["B"], "query_start_loc": ["B1"], "state_checkpoints": ["B", 2]}
    ins = [helper.make_tensor_value_info(n, i64 if n in INT64 else f32,
                                         shapes[n]) for n in names]
    node = helper.make_node(mamba2.OP_TYPE, list(names), ["y"], domain=mamba2.DOMAIN, state_layer=1,
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
    untouched = [s for s in range(SLOTS) if s not in SEQ_SLOTS + [slot for n, slot in CHECKPOINTS if n]]
    assert np.array_equal(states[untouched], before[untouched]) and np.array_equal(states[:, [0, 2]],
                                                                                   before[:, [0, 2]])


@native
def test_a_checkpoint_holds_the_state_after_its_tokens():
    """As tests/test_gated_delta.py's: sequence 0's checkpoint is the state its first 2 tokens alone leave; without
    the input nothing is written there."""
    feeds = inputs()
    states = feeds["recurrent_state"]
    alone = dict(feeds, recurrent_state=states.copy(), state_slots=feeds["state_slots"][:1],
                 past_lengths=feeds["past_lengths"][:1], query_start_loc=np.array([0, 2], dtype=np.int64),
                 state_checkpoints=np.zeros((1, 2), dtype=np.int64), **{n: feeds[n][:2] for n in ("xbc", "z", "dt")})
    session().run(None, alone)
    session().run(None, feeds)
    np.testing.assert_allclose(states[1, 1], alone["recurrent_state"][SEQ_SLOTS[0], 1], rtol=1e-5, atol=1e-6)
    old = inputs()
    del old["state_checkpoints"]
    before = old["recurrent_state"].copy()
    session(checkpoints=False).run(None, old)
    np.testing.assert_array_equal(old["recurrent_state"][[1, 3]], before[[1, 3]])


@native
@pytest.mark.parametrize("slots, message", [([4, 0, 2, 4], "share a state slot"), ([4, 0, 2, 6], "outside")])
def test_bad_state_slots_are_refused(slots, message):
    with pytest.raises(Exception, match=message):
        session().run(None, dict(inputs(), state_slots=np.array(slots, dtype=np.int64)))
