"""trtbuild::GatedDeltaNet (Qwen3.5's linear attention): the numpy reference of plugins/gated_delta.py against
transformers' own recurrence, and the native CPU kernel (cpu_ops/gated_delta.cc) run by ONNX Runtime against the
reference: a packed batch of a fresh prefill, a continuing chunk and decode tokens, two value heads per key head,
states updated in place in their slots (the others untouched), a stale slot ignored where the past is 0, and bad
slots refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from trtbuild import cpu_ops
from trtbuild.plugins import gated_delta as gd

KEY_HEADS, VALUE_HEADS, DK, DV, SLOTS, LAYERS = 2, 4, 8, 16, 6, 3
CHANNELS = 2 * KEY_HEADS * DK + VALUE_HEADS * DV
SEQS = [(0, 5), (7, 3), (12, 1), (3, 1)]  # (past length, new tokens)
SEQ_SLOTS = [4, 0, 2, 5]
# (new tokens, slot): sequence 0's state after 2 of its 5 tokens kept in slot 1, sequence 1's after all 3 in slot 3
CHECKPOINTS = [[2, 1], [3, 3], [0, -1], [0, -1]]
INT64 = ("state_slots", "past_lengths", "query_start_loc", "state_checkpoints")
EPS = 1e-6

native = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None,
                            reason=f"the native CPU op library is unavailable: {cpu_ops.unavailable_reason()}")


def inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = sum(n for _, n in SEQS)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return {"mixed_qkv": f(tokens, CHANNELS), "z": f(tokens, VALUE_HEADS * DV), "b": f(tokens, VALUE_HEADS),
            "a": f(tokens, VALUE_HEADS), "A": -np.exp(f(VALUE_HEADS) * 0.5), "dt_bias": f(VALUE_HEADS),
            "norm_weight": 1 + 0.1 * f(DV), "recurrent_state": f(SLOTS, LAYERS, VALUE_HEADS, DK, DV),
            "state_slots": np.array(SEQ_SLOTS, dtype=np.int64),
            "past_lengths": np.array([p for p, _ in SEQS], dtype=np.int64),
            "query_start_loc": np.cumsum([0] + [n for _, n in SEQS]).astype(np.int64),
            "state_checkpoints": np.array(CHECKPOINTS, dtype=np.int64)}


def test_the_reference_is_transformers_recurrence():
    """One sequence from a zero state: the reference equals transformers' torch_recurrent_gated_delta_rule on the
    SiLU'd, split inputs, followed by the gated RMSNorm, and leaves transformers' final state in its slot."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    feeds = inputs(1)
    n = 6
    x = torch.nn.functional.silu(torch.tensor(feeds["mixed_qkv"][:n]))
    kd = KEY_HEADS * DK
    q, k, v = x[:, :kd], x[:, kd:2 * kd], x[:, 2 * kd:]
    beta = torch.sigmoid(torch.tensor(feeds["b"][:n]))
    g = torch.tensor(feeds["A"]) * torch.nn.functional.softplus(
        torch.tensor(feeds["a"][:n]) + torch.tensor(feeds["dt_bias"]))
    out, final = torch_recurrent_gated_delta_rule(
        q.reshape(1, n, KEY_HEADS, DK), k.reshape(1, n, KEY_HEADS, DK), v.reshape(1, n, VALUE_HEADS, DV),
        g=g[None], beta=beta[None], initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = out[0].numpy()  # [n, value heads, DV]
    z, weight = feeds["z"][:n].reshape(n, VALUE_HEADS, DV), feeds["norm_weight"]
    expected = o / np.sqrt((o * o).mean(-1, keepdims=True) + EPS) * weight * (z / (1 + np.exp(-z)))
    state = np.zeros((1, 1, VALUE_HEADS, DK, DV), dtype=np.float32)
    y = gd.reference_gated_delta(feeds["mixed_qkv"][:n], feeds["z"][:n], feeds["b"][:n], feeds["a"][:n],
                                 feeds["A"], feeds["dt_bias"], weight, state, np.array([0]), np.array([0]),
                                 np.array([0, n]), state_layer=0, epsilon=EPS)
    np.testing.assert_allclose(y, expected.reshape(n, -1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state[0, 0], final[0].numpy(), rtol=1e-5, atol=1e-6)


def model(tiled: int = 0, checkpoints: bool = True) -> onnx.ModelProto:
    """The op alone; without `checkpoints`, as engines built before state_checkpoints have it (11 inputs)."""
    names = gd.INPUTS if checkpoints else gd.INPUTS[:-1]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {"mixed_qkv": ["T", CHANNELS], "z": ["T", VALUE_HEADS * DV], "b": ["T", VALUE_HEADS],
              "a": ["T", VALUE_HEADS], "A": [VALUE_HEADS], "dt_bias": [VALUE_HEADS], "norm_weight": [DV],
              "recurrent_state": ["S", LAYERS, VALUE_HEADS, DK, DV], "state_slots": ["B"], "past_lengths": ["B"],
              "query_start_loc": ["B1"], "state_checkpoints": ["B", 2]}
    ins = [helper.make_tensor_value_info(n, i64 if n in INT64 else f32,
                                         shapes[n]) for n in names]
    node = helper.make_node(gd.OP_TYPE, list(names), ["y"], domain=gd.DOMAIN, state_layer=1, epsilon=EPS,
                            tiled=tiled)
    graph = helper.make_graph([node], "gated_delta", ins, [helper.make_tensor_value_info("y", f32, ["T", "V"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(gd.DOMAIN, 1)])


def session(tiled: int = 0, checkpoints: bool = True) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(cpu_ops.library_path()))
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model(tiled, checkpoints).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


@native
@pytest.mark.parametrize("tiled", [0, 1])
def test_native_kernel_matches_the_reference_and_updates_the_states_in_place(tiled):
    """tiled 1: value head h reads key head h % key heads (a GGUF's order) instead of h // 2."""
    feeds = inputs()
    expected_state = feeds["recurrent_state"].copy()
    expected = gd.reference_gated_delta(*(feeds[n] for n in gd.INPUTS[:7]), expected_state,
                                        *(feeds[n] for n in gd.INPUTS[8:]), state_layer=1, epsilon=EPS,
                                        tiled=bool(tiled))
    before = feeds["recurrent_state"].copy()
    (y,) = session(tiled).run(None, feeds)
    np.testing.assert_allclose(y, expected, rtol=2e-4, atol=2e-5)
    states = feeds["recurrent_state"]  # the array the engine was given, changed where the op wrote
    np.testing.assert_allclose(states, expected_state, rtol=2e-4, atol=2e-5)
    written = SEQ_SLOTS + [slot for n, slot in CHECKPOINTS if n]
    untouched = [s for s in range(SLOTS) if s not in written]
    assert np.array_equal(states[untouched], before[untouched])
    assert np.array_equal(states[:, [0, 2]], before[:, [0, 2]])  # other layers' states
    assert not np.array_equal(states[written, 1], before[written, 1])


@native
def test_a_checkpoint_holds_the_state_after_its_tokens():
    """Sequence 0's checkpoint (after 2 of its 5 tokens) is the state a step of those 2 tokens alone leaves, and
    sequence 1's (after all 3) its slot's; without the input (an engine built before it) no checkpoint is written."""
    feeds = inputs()
    states = feeds["recurrent_state"]
    alone = dict(feeds, recurrent_state=states.copy(), state_slots=feeds["state_slots"][:1],
                 past_lengths=feeds["past_lengths"][:1], query_start_loc=np.array([0, 2], dtype=np.int64),
                 state_checkpoints=np.zeros((1, 2), dtype=np.int64),
                 **{n: feeds[n][:2] for n in ("mixed_qkv", "z", "b", "a")})
    session().run(None, alone)
    session().run(None, feeds)
    np.testing.assert_allclose(states[1, 1], alone["recurrent_state"][SEQ_SLOTS[0], 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(states[3, 1], states[SEQ_SLOTS[1], 1])
    old = inputs()
    del old["state_checkpoints"]
    before = old["recurrent_state"].copy()
    (y,) = session(checkpoints=False).run(None, old)
    np.testing.assert_array_equal(old["recurrent_state"][[1, 3]], before[[1, 3]])
    (z,) = session().run(None, inputs())
    np.testing.assert_array_equal(y, z)


@native
def test_a_sequence_without_a_past_ignores_what_its_slot_held():
    feeds = inputs()
    (first,) = session().run(None, dict(feeds, recurrent_state=feeds["recurrent_state"].copy()))
    stale = feeds["recurrent_state"].copy()
    stale[SEQ_SLOTS[0]] = 1e3
    (second,) = session().run(None, dict(feeds, recurrent_state=stale))
    rows = slice(0, SEQS[0][1])  # sequence 0's tokens (past 0)
    np.testing.assert_array_equal(first[rows], second[rows])


@native
@pytest.mark.parametrize("slots, message", [([4, 0, 2, 4], "share a state slot"), ([4, 0, 2, 6], "outside")])
def test_bad_state_slots_are_refused(slots, message):
    feeds = dict(inputs(), state_slots=np.array(slots, dtype=np.int64))
    with pytest.raises(Exception, match=message):
        session().run(None, feeds)


@native
@pytest.mark.parametrize("checkpoint, message", [([6, 1], "more tokens than"), ([2, 0], "share a state slot"),
                                                 ([2, 6], "outside recurrent_state"), ([2, 3], "share a state slot")])
def test_bad_state_checkpoints_are_refused(checkpoint, message):
    """Past a sequence's tokens, on a running sequence's slot or another checkpoint's, outside the array."""
    feeds = inputs()
    feeds["state_checkpoints"][0] = checkpoint
    with pytest.raises(Exception, match=message):
        session().run(None, feeds)
