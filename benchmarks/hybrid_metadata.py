"""The GGUF keys llama.cpp's converter writes for benchmarks/make_real_size_model.py's hybrid shapes beside the usual
ones: Qwen3.5's gated DeltaNet layers (conversion/qwen.py: Qwen3NextModel, _Qwen35MRopeMixin) and Granite 4.0-H's
Mamba2 layers (conversion/granite.py: GraniteHybridModel; conversion/mamba.py: Mamba2Model)."""

from __future__ import annotations

from real_shapes import Shape

NO_ROPE_CONTEXT = 2**20  # GraniteHybridModel's context length for a hybrid without RoPE (Mamba2Model's default)


def context_length(shape: Shape) -> int:
    """general context length: GraniteHybridModel writes 2**20 in place of the config's for a hybrid (no RoPE)."""
    return NO_ROPE_CONTEXT if shape.mamba2 is not None else shape.max_position_embeddings


def head_count_kv(shape: Shape) -> int | list[int]:
    """A number, or (LFM2Model, GraniteHybridModel) one a layer: none in a convolution / Mamba2 layer."""
    if shape.attention_layers is None:
        return shape.num_key_value_heads
    return [shape.num_key_value_heads if i in shape.attention_layers else 0 for i in range(shape.num_hidden_layers)]


def write_linear_attention(w, shape: Shape) -> None:
    """Qwen3NextModel / _Qwen35MRopeMixin.set_gguf_parameters (no MTP layers)."""
    la, arch = shape.linear_attention, shape.family.arch
    w.add_ssm_conv_kernel(la.conv_kernel)
    w.add_ssm_state_size(la.key_head_dim)
    w.add_ssm_group_count(la.key_heads)
    w.add_ssm_time_step_rank(la.value_heads)
    w.add_ssm_inner_size(la.value_dim)
    w.add_array(f"{arch}.attention.recurrent_layers",  # NOTE: gguf 0.19 has no add_recurrent_layers
                [bool((i + 1) % la.interval) for i in range(shape.num_hidden_layers)])
    w.add_full_attention_interval(la.interval)
    w.add_rope_dimension_count(shape.rotary_dim)
    w.add_rope_dimension_sections([11, 11, 10, 0])  # the released config's mrope_section, padded to 4


def write_mamba2(w, shape: Shape) -> None:
    """GraniteHybridModel.set_gguf_parameters' keys besides the usual ones (its context length: context_length; its
    KV heads a layer: head_count_kv): TextModel's expert counts from a dense config's num_local_experts and
    num_experts_per_tok (0), GraniteMoeModel's shared MLP size, the Mamba2 mixer's (time_step_rank: its heads), and
    rope.scaling.finetuned false, which turns RoPE off in llama.cpp's granitehybrid."""
    m = shape.mamba2
    w.add_expert_count(0)
    w.add_expert_used_count(0)
    w.add_expert_shared_feed_forward_length(shape.intermediate_size)
    w.add_ssm_conv_kernel(m.conv_kernel)
    w.add_ssm_state_size(m.state_size)
    w.add_ssm_group_count(m.groups)
    w.add_ssm_inner_size(m.inner)
    w.add_ssm_time_step_rank(m.heads)
    w.add_rope_scaling_finetuned(False)
