"""The `trtbuild::PagedAttention` contract: the CPU lowering (builder/lower_cpu.py) against the numpy reference.

One packed batch mixes a decode token, a fresh prefill, a continuing prefill chunk and a decode token that starts a
new block, over shuffled, non-contiguous block tables, with GQA (4 query heads, 2 KV heads) and 4-token blocks.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from trtbuild.builder.engine_dir import CPU_ENGINE_FILE
from trtbuild.builder.graph import GraphBuilder
from trtbuild.builder.lower_cpu import lower_paged_attention
from trtbuild.plugins import paged_attention as pa

HEADS, KV_HEADS, HEAD, BLOCK, LAYERS, NUM_BLOCKS, WIDTH, MAX_POS = 4, 2, 8, 4, 2, 24, 6, 64
SCALE = HEAD**-0.5
# (past length, new tokens): decode, fresh prefill, continuing prefill chunk, decode whose token opens a new block
SEQS = [(9, 1), (0, 6), (5, 4), (4, 1)]
TOL = 1e-5


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Random q/k/v/pool and a packed batch layout; `owned_past` marks the pool slots the op may read."""
    rng = np.random.default_rng(seed)
    num_tokens = sum(n for _, n in SEQS)
    perm = rng.permutation(NUM_BLOCKS)
    needed = [-(-(p + n) // BLOCK) for p, n in SEQS]
    free = perm[sum(needed):]
    tables = np.full((len(SEQS), WIDTH), free[0], dtype=np.int64)  # padding entries point at a free block
    owned_past = np.zeros((NUM_BLOCKS, BLOCK), dtype=bool)
    taken = 0
    for b, (p, _) in enumerate(SEQS):
        tables[b, : needed[b]] = perm[taken : taken + needed[b]]
        taken += needed[b]
        for j in range(p):
            owned_past[tables[b, j // BLOCK], j % BLOCK] = True
    assert any(np.any(np.diff(t[:n]) != 1) for t, n in zip(tables, needed, strict=True) if n > 1), "not shuffled"
    inv_freq = 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)
    angles = np.arange(MAX_POS)[:, None] * inv_freq[None, :]
    return {
        "q": rng.standard_normal((num_tokens, HEADS * HEAD)).astype(np.float32),
        "k": rng.standard_normal((num_tokens, KV_HEADS * HEAD)).astype(np.float32),
        "v": rng.standard_normal((num_tokens, KV_HEADS * HEAD)).astype(np.float32),
        "kv_cache": rng.standard_normal((NUM_BLOCKS, LAYERS, 2, KV_HEADS, BLOCK, HEAD)).astype(np.float32),
        "block_tables": tables,
        "past_lengths": np.array([p for p, _ in SEQS], dtype=np.int64),
        "query_start_loc": np.concatenate([[0], np.cumsum([n for _, n in SEQS])]).astype(np.int64),
        "position_ids": np.concatenate([np.arange(p, p + n) for p, n in SEQS]).astype(np.int64),
        "rope_cos": np.cos(angles).astype(np.float32),
        "rope_sin": np.sin(angles).astype(np.float32),
        "owned_past": owned_past,
    }


def paged_attention_model(layers: list[int], rotary: bool, max_pos: int = MAX_POS, window: int = 0,
                          softcap: float = 0.0, sinks: dict[int, np.ndarray] | None = None) -> onnx.ModelProto:
    """PagedAttention node(s) alone, every input a graph input; layer l reads q{l}, k{l}, v{l}. `sinks`: layer ->
    its per-head sinks, an initializer at input 10 as the network writes it (after 3 empty names when not rotary)."""
    g = GraphBuilder()
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shared = [g.input("kv_cache", f32, ["num_blocks", LAYERS, 2, KV_HEADS, BLOCK, HEAD]),
              g.input("block_tables", i64, ["batch", WIDTH]), g.input("past_lengths", i64, ["batch"]),
              g.input("query_start_loc", i64, ["batch_plus_1"])]
    rope = [g.input("position_ids", i64, ["T"]), g.input("rope_cos", f32, [max_pos, HEAD // 2]),
            g.input("rope_sin", f32, [max_pos, HEAD // 2])] if rotary else []
    for layer in layers:
        widths = {"q": HEADS * HEAD, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD}
        qkv = [g.input(f"{n}{layer}", f32, ["T", w]) for n, w in widths.items()]
        outs = [f"{n}{layer}" for n in pa.OUTPUTS]
        extra = [] if sinks is None else ([] if rotary else ["", "", ""]) + [
            g.const(np.asarray(sinks[layer], np.float32), f"sinks{layer}")]
        g.op(pa.OP_TYPE, qkv + shared + rope + extra, domain=pa.DOMAIN, outputs=outs, name=f"layers.{layer}.paged",
             layer_idx=layer, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD, tokens_per_block=BLOCK,
             scale=float(SCALE), rotary=int(rotary), **({"window": window} if window else {}),
             **({"softcap": softcap} if softcap else {}))
        g.output(outs[0], f32, ["T", HEADS * HEAD])
        g.output(outs[1], f32, ["T", KV_HEADS, HEAD])
        g.output(outs[2], f32, ["T", KV_HEADS, HEAD])
    return g.model("paged_attention", {pa.DOMAIN: pa.OPSET_VERSION})


def lowered(layers: list[int], rotary: bool, max_pos: int = MAX_POS, window: int = 0, variant: str = "split",
            softcap: float = 0.0, sinks: dict[int, np.ndarray] | None = None) -> onnx.ModelProto:
    model = paged_attention_model(layers, rotary, max_pos, window, softcap, sinks)
    onnx.checker.check_model(model, full_check=True)
    assert lower_paged_attention(model, variant) == len(layers)
    onnx.checker.check_model(model, full_check=True)
    assert not any(n.domain == pa.DOMAIN for n in model.graph.node)
    assert pa.DOMAIN not in {o.domain for o in model.opset_import}
    return model


def run(model: onnx.ModelProto, data: dict[str, np.ndarray], layers: list[int], rotary: bool) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: data[n] for n in ("kv_cache", "block_tables", "past_lengths", "query_start_loc")}
    if rotary:
        feeds.update({n: data[n] for n in ("position_ids", "rope_cos", "rope_sin")})
    for layer in layers:
        feeds.update({f"{n}{layer}": data[n] for n in "qkv"})
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds), strict=True))


def reference(data: dict[str, np.ndarray], layer: int, rotary: bool, window: int = 0, softcap: float = 0.0,
              sinks: np.ndarray | None = None):
    rope = {n: data[n] for n in ("position_ids", "rope_cos", "rope_sin")} if rotary else {}
    return pa.reference_paged_attention(
        data["q"], data["k"], data["v"], data["kv_cache"], data["block_tables"], data["past_lengths"],
        data["query_start_loc"], layer_idx=layer, num_heads=HEADS, num_kv_heads=KV_HEADS, head_size=HEAD,
        scale=SCALE, window=window, softcap=softcap, sinks=sinks, **rope)


def assert_matches_reference(got: dict, data: dict, layer: int, rotary: bool, window: int = 0,
                             softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    for name, want in zip(pa.OUTPUTS, reference(data, layer, rotary, window, softcap, sinks), strict=True):
        np.testing.assert_allclose(got[f"{name}{layer}"], want, rtol=TOL, atol=TOL, err_msg=f"{name} of layer {layer}")


@pytest.mark.parametrize("rotary", [False, True], ids=["no_rope", "rope"])
def test_lowering_matches_reference(rotary):
    data = batch()
    got = run(lowered([1], rotary), data, [1], rotary)
    assert got["attn_out1"].shape == (len(data["q"]), HEADS * HEAD)
    assert_matches_reference(got, data, 1, rotary)
    # rope really rotates (position 0 is the identity, later positions are not)
    k_new = got["k_new1"].reshape(len(data["k"]), -1)
    assert np.allclose(k_new, data["k"]) != rotary


@pytest.mark.parametrize("variant", ["split", "concat"])
@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_lowering_applies_a_sliding_window(variant, window):
    """Each query sees its last `window` keys: within the pool, across the pool / new-key boundary, among new keys
    only, and (40) all of them; two layers share the windowed masks."""
    data = batch(window)
    got = run(lowered([0, 1], True, window=window, variant=variant), data, [0, 1], True)
    for layer in (0, 1):
        assert_matches_reference(got, data, layer, True, window)


@pytest.mark.parametrize("variant", ["split", "concat"])
@pytest.mark.parametrize(("softcap", "window", "q_gain"), [(1.0, 0, 1.0), (50.0, 0, 20.0), (2.0, 3, 1.0),
                                                           (5.0, 0, 1000.0)],
                         ids=["tight", "gemma2_cap", "windowed", "huge_scores"])
def test_lowering_soft_caps_the_scores(variant, softcap, window, q_gain):
    """Scores become softcap * tanh(score / softcap) (Tanh between the scaled scores and the masks), in both
    variants, with a sliding window, and with scores far past the cap; the soft-cap changes the output."""
    data = batch(7)
    data["q"] *= np.float32(q_gain)
    got = run(lowered([0, 1], True, window=window, variant=variant, softcap=softcap), data, [0, 1], True)
    for layer in (0, 1):
        assert_matches_reference(got, data, layer, True, window, softcap)
    uncapped = reference(data, 1, True, window)[0]
    assert not np.allclose(got["attn_out1"], uncapped, atol=1e-3)


# gpt-oss's attention sinks per layer: one far above every score (the sink is the maximum), one far below (no effect)
SINKS = {0: np.array([-2.0, 0.5, 3.0, 8.0], np.float32), 1: np.array([1.0, -1.0, 0.0, -40.0], np.float32)}


@pytest.mark.parametrize("variant", ["split", "concat"])
@pytest.mark.parametrize(("rotary", "window"), [(True, 0), (False, 0), (True, 3)], ids=["rope", "no_rope", "window3"])
def test_lowering_adds_the_attention_sinks(variant, rotary, window):
    """Each query head's sink is one more score column in the softmax, sliced off after it: two layers with their own
    sinks (initializers at input 10; without RoPE behind three empty names), with a sliding window; the batch-layout
    part of the column is emitted once; without sinks the graph has no such column."""
    data = batch(8)
    model = lowered([0, 1], rotary, window=window, variant=variant, sinks=SINKS)
    got = run(model, data, [0, 1], rotary)
    for layer in (0, 1):
        assert_matches_reference(got, data, layer, rotary, window, sinks=SINKS[layer])
    plain = reference(data, 0, rotary, window)[0]
    assert not np.allclose(got["attn_out0"], plain, atol=1e-3)
    expands = [n for n in model.graph.node if n.op_type == "Expand" and "metadata" not in n.name]
    assert len(expands) == 2  # one sink column per layer
    assert not [n for n in lowered([0, 1], rotary, window=window, variant=variant).graph.node
                if n.op_type == "Expand" and "metadata" not in n.name]


@pytest.mark.parametrize("variant", ["split", "concat"])
def test_lowering_adds_the_sinks_over_an_int8_pool(variant):
    """A quantized pool takes the standard-op lowering: the sinks join the softmax there too (in logit units, not
    the K scale's), the V scale multiplies only the weighted values."""
    data = batch(9)
    scales = (0.03, 0.02)
    pool = np.concatenate([np.clip(np.rint(data["kv_cache"][:, :, i:i + 1] / np.float32(s)), -127, 127)
                           for i, s in enumerate(scales)], axis=2).astype(np.int8)
    model = paged_attention_model([1], False, sinks=SINKS)
    next(i for i in model.graph.input if i.name == "kv_cache").type.tensor_type.elem_type = TensorProto.INT8
    node = next(n for n in model.graph.node if n.domain == pa.DOMAIN)
    node.attribute.extend([onnx.helper.make_attribute("kv_cache_quant_algo", "int8"),
                           onnx.helper.make_attribute("kv_cache_scale", list(scales))])
    assert lower_paged_attention(model, variant) == 1
    got = run(model, dict(data, kv_cache=pool), [1], False)["attn_out1"]

    def stored(x: np.ndarray, s: float) -> np.ndarray:  # what the pool will hold, dequantized
        return np.clip(np.rint(x / np.float32(s)), -127, 127).astype(np.float32) * np.float32(s)

    deq = pool.astype(np.float32) * np.array(scales, np.float32)[None, None, :, None, None, None]
    want = reference(dict(data, k=stored(data["k"], scales[0]), v=stored(data["v"], scales[1]), kv_cache=deq), 1,
                     False, sinks=SINKS[1])[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_a_step_may_pack_more_tokens_than_the_rope_table_has_rows():
    """The table has max_seq_len rows; a step packs up to max_num_tokens tokens of many sequences, often more."""
    data = batch()
    rows = int(data["position_ids"].max()) + 1
    assert rows < len(data["q"])
    data["rope_cos"], data["rope_sin"] = data["rope_cos"][:rows], data["rope_sin"][:rows]
    assert_matches_reference(run(lowered([0], True, rows), data, [0], True), data, 0, True)


@pytest.mark.parametrize("rotary", [False, True], ids=["no_rope", "rope"])
def test_two_layers_share_one_pool_and_one_metadata_subgraph(rotary):
    """Layers 0 and 1 read their own half of the pool; the batch-layout index arithmetic is emitted once."""
    data = batch(seed=1)
    model = lowered([0, 1], rotary)
    got = run(model, data, [0, 1], rotary)
    for layer in (0, 1):
        assert_matches_reference(got, data, layer, rotary)
    assert not np.allclose(got["attn_out0"], got["attn_out1"])  # different layers, different cache halves
    metadata = [n for n in model.graph.node if n.name.startswith("paged_attention_metadata/")]
    single = [n for n in lowered([1], rotary).graph.node if n.name.startswith("paged_attention_metadata/")]
    assert metadata and len(metadata) == len(single)


# NOTE: padding positions may gather any slot and are then masked, so the pool must hold finite values (the runtime
# only ever writes engine outputs into it); finite garbage of any size must not leak.
@pytest.mark.parametrize("garbage", [1e30, -3e30, 7.0], ids=["1e30", "-3e30", "7"])
@pytest.mark.parametrize("rotary", [False, True], ids=["no_rope", "rope"])
def test_unowned_pool_slots_are_never_read(garbage, rotary):
    """Garbage everywhere but the past tokens' slots of this layer (other layer, free blocks, owned slots not yet
    written) and out-of-range ids in block-table entries past the past tokens' blocks leave every output
    bit-identical."""
    data = batch(seed=2)
    model = lowered([1], rotary)
    clean = run(model, data, [1], rotary)
    dirty_pool = np.full_like(data["kv_cache"], garbage)
    keep = data["owned_past"][:, None, None, :, None]  # [block, K|V, kv_head, offset, head]
    dirty_pool[:, 1] = np.where(keep, data["kv_cache"][:, 1], garbage)
    assert np.count_nonzero(data["owned_past"]) == sum(p for p, _ in SEQS)
    dirty_tables = data["block_tables"].copy()
    for b, (p, _) in enumerate(SEQS):
        dirty_tables[b, -(-p // BLOCK) :] = [-1, 10**9][b % 2]
    dirty_data = dict(data, kv_cache=dirty_pool, block_tables=dirty_tables)
    dirty = run(model, dirty_data, [1], rotary)
    for name in clean:
        assert np.isfinite(dirty[name]).all(), name
        np.testing.assert_array_equal(dirty[name], clean[name], err_msg=name)
    assert_matches_reference(dirty, dirty_data, 1, rotary)


def test_past_tokens_come_from_the_pool():
    """Changing a past token's K in the pool changes the output of the sequence that owns it, and only that one."""
    data = batch(seed=3)
    model = lowered([1], rotary=False)
    before = run(model, data, [1], False)["attn_out1"]
    pool = data["kv_cache"].copy()
    b, j = 2, 3  # sequence 2 (continuing chunk), past token 3
    pool[data["block_tables"][b, j // BLOCK], 1, 0, :, j % BLOCK] += 5.0
    after = run(model, dict(data, kv_cache=pool), [1], False)["attn_out1"]
    start, end = data["query_start_loc"][b], data["query_start_loc"][b + 1]
    changed = np.flatnonzero(np.abs(after - before).max(axis=1) > 1e-6)
    assert changed.tolist() == list(range(start, end))


def assert_pool_read_only_by_gathers(model: onnx.ModelProto, num_layers: int) -> None:
    consumers = collections.defaultdict(list)
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            consumers[name].append((node, i))
    ops = collections.Counter(n.op_type for n, _ in consumers["kv_cache"])
    assert ops == {"Reshape": num_layers, "Shape": ops["Shape"]} and ops["Shape"] >= 1, ops
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for reshape, _ in consumers["kv_cache"]:
        if reshape.op_type != "Reshape":
            continue
        assert reshape.input[0] == "kv_cache"
        target = initializers[reshape.input[1]].tolist()
        assert len(target) == 2 and target[0] == -1  # [rows, block x head]: a view of the pool, no copy
        users = consumers[reshape.output[0]]
        assert users and all(n.op_type == "Gather" and i == 0 for n, i in users), [n.op_type for n, _ in users]
    for shape, _ in consumers["kv_cache"]:
        if shape.op_type == "Shape":
            assert all(n.op_type == "Slice" for n, _ in consumers[shape.output[0]])
    # the cache is never written or rebuilt by the graph
    assert not {"ScatterND", "ScatterElements", "TensorScatter"} & {n.op_type for n in model.graph.node}


def test_lowered_op_reads_the_pool_only_through_gathers():
    model = lowered([0, 1], rotary=True)
    assert_pool_read_only_by_gathers(model, num_layers=2)
    flat = [n for n in model.graph.node if n.op_type == "Reshape" and n.input[0] == "kv_cache"]
    shape = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == flat[0].input[1]))
    assert shape.tolist() == [-1, BLOCK * HEAD]  # whole blocks of one (layer, K|V, head)


def test_engine_reads_the_pool_only_through_gathers(random_hf_model, engine_from_hf):
    engine_dir = engine_from_hf(random_hf_model("qwen3"), max_batch_size=4, max_num_tokens=256, attention="split")
    model = onnx.load(str(engine_dir / CPU_ENGINE_FILE))
    assert_pool_read_only_by_gathers(model, num_layers=2)


def test_a_native_attention_engine_gives_the_pool_only_to_its_paged_attention_nodes(random_hf_model, engine_from_hf):
    engine_dir = engine_from_hf(random_hf_model("qwen3"), max_batch_size=4, max_num_tokens=256, attention="native")
    graph = onnx.load(str(engine_dir / CPU_ENGINE_FILE), load_external_data=False).graph
    readers = [n for n in graph.node if "kv_cache" in n.input]
    assert len(readers) == 2 and all(n.domain == pa.DOMAIN and n.op_type == pa.OP_TYPE for n in readers)
