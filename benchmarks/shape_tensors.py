"""Each shape's weights as its HF checkpoint lists them, and their names in llama.cpp's GGUF files, for
benchmarks/make_real_size_model.py."""

from __future__ import annotations

from collections.abc import Iterator

from real_shapes import (
    AFMOE,
    ARCEE,
    EXAONE4,
    GEMMA3,
    GEMMAS,
    GLM4,
    GRANITEHYBRID,
    LFM2,
    LFM2MOE,
    OLMO2,
    OLMOE,
    PHI3,
    POST_NORMED,
    QWEN2,
    QWEN35,
    STARCODER2,
    Family,
    Shape,
)

HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",  # GLM-4
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",  # StarCoder 2
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
              **{f"mlp.experts.{p}_proj": f"ffn_{p}_exps" for p in ("gate", "up", "down")}}
# LFM2's names (HF's), and the final norm llama.cpp writes as token_embd_norm
LFM2_TO_GGUF = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
                "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
                "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
                **{f"conv.{p}": f"shortconv.{p}" for p in ("conv", "in_proj", "out_proj")},
                # LFM2-MoE's router, selection bias and stacked experts
                "feed_forward.gate": "ffn_gate_inp", "feed_forward.expert_bias": "exp_probs_b",
                **{f"feed_forward.experts.{w}": f"ffn_{p}_exps" for w, p in (("w1", "gate"), ("w3", "up"),
                                                                              ("w2", "down"))}}
# AFMoE's: its attention gate, four norms, router, selection bias and shared experts
AFMOE_TO_GGUF = {**HF_TO_GGUF, "self_attn.gate_proj": "attn_gate", "post_attention_layernorm": "post_attention_norm",
                 "pre_mlp_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm",
                 "mlp.router.gate": "ffn_gate_inp", "mlp.expert_bias": "exp_probs_b",
                 **{f"mlp.shared_experts.{p}_proj": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}}
# Qwen3.5's (Qwen3_5TextModel): its pre-MLP norm as post_attention_norm, the gated DeltaNet's projections, taps, decay
# (A_log, stored as ssm_a = -exp(A_log)), dt bias, gated norm and output
QWEN35_TO_GGUF = {**HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                  **{f"linear_attn.{hf}": g for hf, g in (
                      ("in_proj_qkv", "attn_qkv"), ("in_proj_z", "attn_gate"), ("in_proj_b", "ssm_beta"),
                      ("in_proj_a", "ssm_alpha"), ("conv1d", "ssm_conv1d"), ("norm", "ssm_norm"),
                      ("out_proj", "ssm_out"))}}
QWEN35_WHOLE = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}  # names without a .weight
# Granite 4.0-H's (GraniteMoeHybridForCausalLM), as llama.cpp's GraniteHybridModel writes them: the Mamba2 mixer's
# projections, taps and their biases, gated norm; its decay (A_log, stored as ssm_a = -exp(A_log)), skip D and dt bias;
# the shared MLP's input_linear split into gate and up halves (named here as such), its output_linear
GRANITEHYBRID_TO_GGUF = {**HF_TO_GGUF, **{f"mamba.{hf}": g for hf, g in (
    ("in_proj", "ssm_in"), ("conv1d", "ssm_conv1d"), ("norm", "ssm_norm"), ("out_proj", "ssm_out"))},
    "shared_mlp.gate_proj": "ffn_gate", "shared_mlp.up_proj": "ffn_up", "shared_mlp.output_linear": "ffn_down"}
MAMBA2_WHOLE = {"mamba.A_log": "ssm_a", "mamba.D": "ssm_d", "mamba.dt_bias": "ssm_dt.bias"}  # names without a .weight
WHOLE = {QWEN35: QWEN35_WHOLE, GRANITEHYBRID: MAMBA2_WHOLE}
# Gemma 2 / 3's four norms: their post_attention_layernorm normalizes the attention's output
GEMMA_TO_GGUF = {**HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def lfm2_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """LFM2's weights: a convolution (in_proj, each channel's 3 taps, out_proj) or an attention per layer."""
    h, kv, f = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    q = shape.num_attention_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "operator_norm.weight", (h,)
        if i in shape.attention_layers:
            yield from ((p + f"self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", q), ("k", kv), ("v", kv)))
            yield from ((p + f"self_attn.{x}_layernorm.weight", (shape.head_dim,)) for x in "qk")
            yield p + "self_attn.out_proj.weight", (h, q)
        else:  # the taps as llama.cpp holds them, [hidden, 3] (HF: [hidden, 1, 3])
            yield from ((p + "conv.in_proj.weight", (3 * h, h)), (p + "conv.conv.weight", (h, 3)),
                        (p + "conv.out_proj.weight", (h, h)))
        yield p + "ffn_norm.weight", (h,)
        if shape.experts and i >= shape.dense_layers:  # the router, its selection bias, the experts stacked
            e = shape.experts
            yield from ((p + "feed_forward.gate.weight", (e, h)), (p + "feed_forward.expert_bias.bias", (e,)))
            yield from ((p + f"feed_forward.experts.{w}.weight", (e, f, h)) for w in ("w1", "w3"))
            yield p + "feed_forward.experts.w2.weight", (e, h, f)
            continue
        dense = shape.dense_intermediate_size or f
        yield from ((p + "feed_forward.w1.weight", (dense, h)), (p + "feed_forward.w3.weight", (dense, h)),
                    (p + "feed_forward.w2.weight", (h, dense)))
    yield "model.embedding_norm.weight", (h,)


def afmoe_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """AFMoE's weights: attention with its output gate and per-head q / k norms, four norms, a dense MLP or a router
    with its selection bias, the experts stacked and the shared experts."""
    h, kv, f = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    q = shape.num_attention_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield from ((p + f"self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", q), ("k", kv), ("v", kv),
                                                                             ("gate", q)))
        yield from ((p + f"self_attn.{x}_norm.weight", (shape.head_dim,)) for x in "qk")
        yield p + "self_attn.o_proj.weight", (h, q)
        yield from ((p + f"{n}.weight", (h,)) for n in ("post_attention_layernorm", "pre_mlp_layernorm"))
        if i < shape.dense_layers:
            d = shape.dense_intermediate_size
            yield from ((p + "mlp.gate_proj.weight", (d, h)), (p + "mlp.up_proj.weight", (d, h)),
                        (p + "mlp.down_proj.weight", (h, d)))
        else:
            e, s = shape.experts, shape.shared_experts * f
            yield from ((p + "mlp.router.gate.weight", (e, h)), (p + "mlp.expert_bias.bias", (e,)))
            yield from ((p + f"mlp.experts.{x}_proj.weight", (e, f, h)) for x in ("gate", "up"))
            yield p + "mlp.experts.down_proj.weight", (e, h, f)
            yield from ((p + f"mlp.shared_experts.{x}_proj.weight", (s, h)) for x in ("gate", "up"))
            yield p + "mlp.shared_experts.down_proj.weight", (h, s)
        yield p + "post_mlp_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (shape.vocab_size, h)


def qwen35_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3.5's weights: a gated DeltaNet (q / k / v and z projections, each q / k / v channel's taps as llama.cpp
    holds them, squeezed, per value head a decay, dt bias, beta and alpha rows, a gated norm over each head, its output)
    or every `interval`-th layer gated attention (q_proj: each head's query then its gate), per-head q / k norms."""
    h, f, la = shape.hidden_size, shape.intermediate_size, shape.linear_attention
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        if (i + 1) % la.interval:
            a = p + "linear_attn."
            yield from ((a + "in_proj_qkv.weight", (2 * la.key_dim + la.value_dim, h)),
                        (a + "in_proj_z.weight", (la.value_dim, h)), (a + "in_proj_b.weight", (la.value_heads, h)),
                        (a + "in_proj_a.weight", (la.value_heads, h)),
                        (a + "conv1d.weight", (2 * la.key_dim + la.value_dim, la.conv_kernel)),
                        (a + "dt_bias", (la.value_heads,)), (a + "A_log", (la.value_heads,)),
                        (a + "norm.weight", (la.value_head_dim,)), (a + "out_proj.weight", (h, la.value_dim)))
        else:
            yield from ((p + f"self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", 2 * q), ("k", kv), ("v", kv)))
            yield from ((p + f"self_attn.{x}_norm.weight", (shape.head_dim,)) for x in "qk")
            yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield from ((p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f)))
    yield "model.norm.weight", (h,)


def granite_hybrid_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Granite 4.0-H's weights: a Mamba2 mixer (in_proj's z | x B C | dt rows; each x / B / C channel's taps as
    llama.cpp holds them, squeezed, and their biases; per head a dt bias, decay and skip, A and D as [heads, 1]; the
    gated norm as [groups, inner / groups]; out_proj) or, in Shape.attention_layers, attention; a dense MLP in each."""
    h, f, m = shape.hidden_size, shape.intermediate_size, shape.mamba2
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        if i in shape.attention_layers:
            yield from ((p + f"self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", q), ("k", kv), ("v", kv)))
            yield p + "self_attn.o_proj.weight", (h, q)
        else:
            a = p + "mamba."
            yield from ((a + "in_proj.weight", (m.in_proj_rows, h)), (a + "conv1d.weight", (m.conv_dim, m.conv_kernel)),
                        (a + "conv1d.bias", (m.conv_dim,)), (a + "dt_bias", (m.heads,)), (a + "A_log", (m.heads, 1)),
                        (a + "D", (m.heads, 1)), (a + "norm.weight", (m.groups, m.inner // m.groups)),
                        (a + "out_proj.weight", (h, m.inner)))
        yield p + "post_attention_layernorm.weight", (h,)
        yield from ((p + "shared_mlp.gate_proj.weight", (f, h)), (p + "shared_mlp.up_proj.weight", (f, h)),
                    (p + "shared_mlp.output_linear.weight", (h, f)))
    yield "model.norm.weight", (h,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (shape.vocab_size, h)


def hf_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every weight, in the order HF checkpoints list them per layer."""
    if shape.family in (LFM2, LFM2MOE):
        yield from lfm2_tensors(shape)
        return
    if shape.family is AFMOE:
        yield from afmoe_tensors(shape)
        return
    if shape.family is QWEN35:
        yield from qwen35_tensors(shape)
        return
    if shape.family is GRANITEHYBRID:
        yield from granite_hybrid_tensors(shape)
        return
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    q = shape.num_attention_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        biased = shape.family is STARCODER2  # LayerNorms and every projection with biases
        if shape.family not in (OLMO2, EXAONE4):  # which normalize the attention's and MLP's outputs, not inputs
            yield p + "input_layernorm.weight", (h,)
            yield from [(p + "input_layernorm.bias", (h,))] if biased else []
        if shape.family is PHI3:  # fused, as Phi-3 holds them
            yield p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)) if shape.family is not PHI3 else ():
            yield p + f"self_attn.{proj}.weight", (rows, h)
            if shape.family in (QWEN2, GLM4, STARCODER2):
                yield p + f"self_attn.{proj}.bias", (rows,)
        if shape.family in (GEMMA3, OLMO2, OLMOE, EXAONE4):  # per head, or (OLMo 2, OLMoE) over the whole projection
            per_head = shape.family in (GEMMA3, EXAONE4)
            yield p + "self_attn.q_norm.weight", (shape.head_dim if per_head else q,)
            yield p + "self_attn.k_norm.weight", (shape.head_dim if per_head else kv,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield from [(p + "self_attn.o_proj.bias", (h,))] if biased else []
        if shape.family is GLM4:
            yield p + "post_self_attn_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield from [(p + "post_attention_layernorm.bias", (h,))] if biased else []
        if shape.family in GEMMAS:
            yield p + "pre_feedforward_layernorm.weight", (h,)
        if shape.experts:  # the router, and the experts stacked as llama.cpp's converters write them
            e, f = shape.experts, shape.intermediate_size
            yield p + "mlp.gate.weight", (e, h)
            yield from ((p + f"mlp.experts.{x}_proj.weight", (e, f, h)) for x in ("gate", "up"))
            yield p + "mlp.experts.down_proj.weight", (e, h, f)
        elif biased:  # StarCoder 2's names
            f = shape.intermediate_size
            yield from ((p + "mlp.c_fc.weight", (f, h)), (p + "mlp.c_fc.bias", (f,)), (p + "mlp.c_proj.weight", (h, f)),
                        (p + "mlp.c_proj.bias", (h,)))
        elif shape.family in (PHI3, GLM4):
            yield p + "mlp.gate_up_proj.weight", (2 * shape.intermediate_size, h)
        else:
            if shape.family is not ARCEE:  # whose MLP has no gate
                yield p + "mlp.gate_proj.weight", (shape.intermediate_size, h)
            yield p + "mlp.up_proj.weight", (shape.intermediate_size, h)
        if not shape.experts and not biased:
            yield p + "mlp.down_proj.weight", (h, shape.intermediate_size)
        if shape.family in POST_NORMED:
            yield p + "post_feedforward_layernorm.weight", (h,)
        if shape.family is GLM4:
            yield p + "post_mlp_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if shape.family is STARCODER2:
        yield "model.norm.bias", (h,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (shape.vocab_size, h)


def gguf_name(hf_name: str, family: Family) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.norm.bias": "output_norm.bias", "lm_head.weight": "output.weight",
           "model.embedding_norm.weight": "token_embd_norm.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    if rest in WHOLE.get(family, {}):
        return f"blk.{i}.{WHOLE[family][rest]}"
    module, kind = rest.rsplit(".", 1)
    names = GEMMA_TO_GGUF if family in POST_NORMED else LFM2_TO_GGUF if family in (LFM2, LFM2MOE) else \
        AFMOE_TO_GGUF if family is AFMOE else QWEN35_TO_GGUF if family is QWEN35 else \
        GRANITEHYBRID_TO_GGUF if family is GRANITEHYBRID else HF_TO_GGUF
    return f"blk.{i}.{names[module]}.{kind}"
