"""The model families and released shapes benchmarks/make_real_size_model.py makes random-weight models of: what each
family's GGUF and tokenizer carry besides the weights, and each shape's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What a model family's GGUF and tokenizer carry besides the weights."""

    arch: str  # general.architecture
    pre: str  # tokenizer.ggml.pre
    digits: str  # the pre-tokenizer's digit group
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    chat_template: str
    marks: str = ""  # what the pre-tokenizer's letter runs take besides \p{L} (Qwen3.5's: \p{M})


QWEN2 = Family(
    "qwen2", "qwen2", r"\p{N}", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = Family(
    "llama", "llama-bpe", r"\p{N}{1,3}",
    ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>",
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}")
# Phi-3.5-mini's layout (fused q/k/v and gate/up, LongRoPE) with a byte-level BPE, as Phi-4 pairs the phi3
# architecture with one; Phi-3's specials (llama.cpp looks up <unk>, <s> and </s> in any model named phi3).
PHI3 = Family(
    "phi3", "llama-bpe", r"\p{N}{1,3}",
    ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    None, "<|end|>", "<|endoftext|>",
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# SmolLM3: Llama 3's tokenizer and layout, every fourth layer without RoPE
SMOLLM3 = Family("smollm3", LLAMA3.pre, LLAMA3.digits, LLAMA3.specials, LLAMA3.bos, LLAMA3.eos, LLAMA3.pad,
                 LLAMA3.chat_template)
# Gemma 2 / 3: GeGLU, sandwich norms, sliding-window layers; with a byte-level BPE in place of Gemma's SentencePiece
# vocabulary (the weights and the compute are the released models'), and Gemma's turn markers
_GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                   "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA3 = Family("gemma3", LLAMA3.pre, LLAMA3.digits, ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                "<bos>", "<end_of_turn>", "<pad>", _GEMMA_TEMPLATE)
GEMMA2 = Family("gemma2", *(getattr(GEMMA3, f) for f in ("pre", "digits", "specials", "bos", "eos", "pad",
                                                           "chat_template")))
GEMMAS = (GEMMA2, GEMMA3)
# Granite 3: Llama's layout and llama.cpp's permuted q / k, with its multipliers (Shape.multipliers)
GRANITE = Family("granite", LLAMA3.pre, LLAMA3.digits, ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"),
                 None, "<|end_of_text|>", "<|end_of_text|>",
                 "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
                 "<|end_of_text|>\n{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant"
                 "<|end_of_role|>{% endif %}")
# OLMo 2: norms after the attention and the MLP only, q / k norms over the whole projections
OLMO2 = Family("olmo2", LLAMA3.pre, LLAMA3.digits, ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"), None,
               "<|endoftext|>", "<|pad|>", QWEN2.chat_template)
# OLMoE: a mixture of experts (64 of 1024 features, 8 a token, not renormalized); q / k norms over the whole
# projections, norms before attention and MLP
OLMOE = Family("olmoe", LLAMA3.pre, LLAMA3.digits, OLMO2.specials, None, OLMO2.eos, OLMO2.pad, QWEN2.chat_template)
# Granite MoE: Granite's multipliers and layout, its MLPs mixtures of experts (its GGUF: experts stacked, as OLMoE's)
GRANITEMOE = Family("granitemoe", *(getattr(GRANITE, f) for f in ("pre", "digits", "specials", "bos", "eos", "pad",
                                                                   "chat_template")))
# gpt-oss (benchmarks/make_gpt_oss_gguf.py): o200k_harmony's 21 added tokens, ids 199998-200018 in this order
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                    "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                    *(f"<|reserved_{i}|>" for i in range(200009, 200012)), "<|call|>",
                    *(f"<|reserved_{i}|>" for i in range(200013, 200018)), "<|endofprompt|>")
# The harmony format as gpt-oss's template renders a conversation without tools: its system message (identity, cutoff,
# date, reasoning effort, channels); a leading system / developer message as the developer's instructions; assistant
# turns as their final channel, except a last one being trained on (no generation prompt), which carries its analysis
# and ends in <|return|>; then <|start|>assistant for the model to pick its channel
_HARMONY_TEMPLATE = (
    '{{- "<|start|>system<|message|>" + (model_identity if model_identity is defined else "You are ChatGPT, a large '
    'language model trained by OpenAI.") + "\\nKnowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d")'
    ' + "\\n\\nReasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\\n\\n# Valid '
    'channels: analysis, commentary, final. Channel must be included for every message.<|end|>" }}'
    '{%- set turns = messages %}{%- if messages and messages[0].role in ["system", "developer"] %}'
    '{{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "\\n\\n<|end|>" }}'
    '{%- set turns = messages[1:] %}{%- endif %}'
    '{%- for m in turns %}{%- if m.role == "user" %}{{- "<|start|>user<|message|>" + m.content + "<|end|>" }}'
    '{%- elif m.role == "assistant" and loop.last and not add_generation_prompt %}{%- if m.thinking is defined %}'
    '{{- "<|start|>assistant<|channel|>analysis<|message|>" + m.thinking + "<|end|>" }}{%- endif %}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|return|>" }}'
    '{%- elif m.role == "assistant" %}{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" }}'
    '{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}')
GPT_OSS = Family("gpt-oss", "gpt-4o", LLAMA3.digits, HARMONY_SPECIALS, "<|startoftext|>", "<|return|>", "<|endoftext|>",
                 _HARMONY_TEMPLATE)
# ERNIE 4.5: Llama's layout with interleaved RoPE (q / k rows stored as in HF)
ERNIE = Family("ernie4_5", LLAMA3.pre, LLAMA3.digits, ("<unk>", "<s>", "</s>", "<|end_of_sentence|>"), "<s>",
               "</s>", "<unk>", "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
# GLM-4: interleaved RoPE over half of each head, q / k / v biases, gate and up fused, norms before and after
# attention and MLP
GLM4 = Family("glm4", "glm4", LLAMA3.digits, ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>",
                                              "<|assistant|>"), None, "<|endoftext|>", "<|endoftext|>",
              "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# EXAONE 4: OLMo 2's norms after attention and MLP, per-head q / k norms
EXAONE4 = Family("exaone4", LLAMA3.pre, LLAMA3.digits, ("[PAD]", "[BOS]", "[|endofturn|]", "[|system|]", "[|user|]",
                                                         "[|assistant|]"), "[BOS]", "[|endofturn|]", "[PAD]",
                 "{% for m in messages %}[|{{ m['role'] }}|]{{ m['content'] }}[|endofturn|]\n{% endfor %}"
                 "{% if add_generation_prompt %}[|assistant|]{% endif %}")
# Arcee (AFM-4.5B): Llama's layout with an MLP without a gate (relu(up(x))^2), Llama 3's tokenizer kind
ARCEE = Family("arcee", LLAMA3.pre, LLAMA3.digits, LLAMA3.specials, LLAMA3.bos, LLAMA3.eos, LLAMA3.pad,
               LLAMA3.chat_template)
# StarCoder 2: LayerNorms and every projection with biases, a GELU MLP without a gate; its FIM specials, digits one by
# one (llama.cpp's "starcoder" pre-tokenizer)
STARCODER2 = Family("starcoder2", "starcoder", r"\p{N}", ("<|endoftext|>", "<fim_prefix>", "<fim_middle>",
                                                           "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"),
                    None, "<|endoftext|>", "<|endoftext|>", QWEN2.chat_template)
# LFM2: short convolution layers among attention layers (Shape.attention_layers), per-head q / k norms, Llama 3's
# pre-tokenizer kind (llama.cpp's "lfm2"), ChatML turns
LFM2 = Family("lfm2", "lfm2", LLAMA3.digits, ("<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>",
                                              "<|im_end|>"), "<|startoftext|>", "<|im_end|>", "<|pad|>",
              "{{ bos_token }}" + QWEN2.chat_template)
# LFM2-MoE: LFM2's layers, a dense MLP in the first Shape.dense_layers, experts after them
LFM2MOE = Family("lfm2moe", *(getattr(LFM2, f) for f in ("pre", "digits", "specials", "bos", "eos", "pad",
                                                          "chat_template")))
# AFMoE (Arcee's Trinity): Llama 3's tokenizer here; the attention's output gate, four norms, leading dense layers
# (Shape.dense_layers), then experts beside Shape.shared_experts shared ones
AFMOE = Family("afmoe", *(getattr(LLAMA3, f) for f in ("pre", "digits", "specials", "bos", "eos", "pad",
                                                        "chat_template")))
# Qwen3.5 (llama.cpp's qwen35): gated DeltaNet layers (Shape.linear_attention) among full attention layers with an
# output gate (q_proj twice as tall: each head's query then its gate), partial multi-section RoPE, norms stored as
# 1 + w; Qwen2's specials and ChatML, its pre-tokenizer's letter runs taking combining marks
QWEN35 = Family("qwen35", "qwen35", QWEN2.digits, QWEN2.specials, None, QWEN2.eos, QWEN2.pad, QWEN2.chat_template,
                r"\p{M}")
# Granite 4.0-H (llama.cpp's granitehybrid): Mamba2 layers (Shape.mamba2) among a few attention layers without RoPE
# (Shape.attention_layers), a dense shared MLP, Granite's multipliers; Granite's role markers and <|pad|>, and a
# cl100k-like pre-tokenizer (llama.cpp's "dbrx": Llama 3's regex)
GRANITEHYBRID = Family("granitehybrid", "dbrx", LLAMA3.digits, (*GRANITE.specials, "<|pad|>"), None, GRANITE.eos,
                       "<|pad|>", GRANITE.chat_template)
# the families whose GGUF names the norms after attention / MLP as Gemma's
POST_NORMED = (GEMMA2, GEMMA3, OLMO2, EXAONE4)
# the families llama.cpp's LlamaModel converts: q / k rows permuted
PERMUTED = (LLAMA3, SMOLLM3, GRANITE, GRANITEMOE, ARCEE, AFMOE, GRANITEHYBRID)  # GraniteHybridModel too, RoPE or not
LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3.5's gated DeltaNet layers: every `interval`-th layer is full attention, the others these."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    interval: int = 4

    @property
    def key_dim(self) -> int:
        return self.key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.value_heads * self.value_head_dim


@dataclass(frozen=True)
class Mamba2:
    """Granite 4.0-H's Mamba2 layers: `heads` heads of `head_dim` (inner: twice the hidden size), a state of
    `state_size` per head, B and C in `groups` groups, taps of `conv_kernel` with biases; no projection biases."""

    heads: int
    head_dim: int
    state_size: int
    groups: int = 1
    conv_kernel: int = 4

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # the convolved channels: x | B | C
        return self.inner + 2 * self.groups * self.state_size

    @property
    def in_proj_rows(self) -> int:  # z | x B C | dt
        return self.inner + self.conv_dim + self.heads


@dataclass(frozen=True)
class Shape:
    family: Family
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None  # Phi-3's, which llama.cpp ignores and engines are built within
    partial_rotary_factor: float = 1.0  # Phi-4-mini rotates 3/4 of each head
    head_size: int | None = None  # where it is not hidden / heads (Gemma: 256)
    multipliers: dict | None = None  # Granite's, under their HF config names
    experts: int = 0  # a mixture of experts: this many of intermediate_size features, experts_per_tok a token
    experts_per_tok: int = 0
    attention_layers: tuple[int, ...] | None = None  # LFM2, Granite 4.0-H: the layers with attention
    dense_layers: int = 0  # LFM2-MoE: the first this many layers' MLPs are dense, of dense_intermediate_size
    dense_intermediate_size: int = 0
    shared_experts: int = 0  # AFMoE: shared experts of intermediate_size features beside the routed ones
    linear_attention: LinearAttention | None = None  # Qwen3.5: its gated DeltaNet layers
    mamba2: Mamba2 | None = None  # Granite 4.0-H: its Mamba2 layers, those not in attention_layers

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _longrope(pairs: int) -> dict:
    """LongRoPE factors in the released ones' ranges (short 1-2, long 1-50; multiples of 1/64, which float32 holds),
    original context 4096."""
    return dict(rope_type="longrope", short_factor=[1 + i / 64 for i in range(pairs)],
                long_factor=[1 + i for i in range(pairs)], original_max_position_embeddings=4096)


SHAPES = {  # the released models' configs
    "0.5b": Shape(QWEN2, 896, 24, 14, 2, 4864, 151936, True, 1e6),
    "1.5b": Shape(QWEN2, 1536, 28, 12, 2, 8960, 151936, False, 1e6),
    "llama-1b": Shape(LLAMA3, 2048, 16, 32, 8, 8192, 128256, True, 5e5, dict(LLAMA3_ROPE, factor=32.0), 131072, 1e-5),
    "llama-8b": Shape(LLAMA3, 4096, 32, 32, 8, 14336, 128256, False, 5e5, dict(LLAMA3_ROPE, factor=8.0), 131072, 1e-5),
    "phi3-mini": Shape(PHI3, 3072, 32, 32, 32, 8192, 32064, False, 1e4, _longrope(48), 131072, 1e-5, 262144),
    "smollm3-3b": Shape(SMOLLM3, 2048, 36, 16, 4, 11008, 128256, True, 5e6, None, 65536),
    "phi4-mini": Shape(PHI3, 3072, 32, 24, 8, 8192, 200064, True, 1e4, _longrope(48), 131072, 1e-5, None, 0.75),
    # Gemma 3 1B: every sixth layer full, the others windowed (512); Gemma 2 2B: every second (4096), soft-capped
    "gemma3-1b": Shape(GEMMA3, 1152, 26, 4, 1, 6912, 262144, True, 1e6, None, 32768, 1e-6, 512, head_size=256),
    "gemma3-4b": Shape(GEMMA3, 2560, 34, 8, 4, 10240, 262144, True, 1e6, dict(rope_type="linear", factor=8.0), 131072,
                       1e-6, 1024, head_size=256),
    "gemma2-2b": Shape(GEMMA2, 2304, 26, 8, 4, 9216, 256000, True, 1e4, None, 8192, 1e-6, 4096, head_size=256),
    "olmo2-1b": Shape(OLMO2, 2048, 16, 16, 16, 8192, 100352, False, 5e5, None, 4096),
    "granite-moe-3b": Shape(GRANITEMOE, 1536, 32, 24, 8, 512, 49155, True, 1e7, None, 131072, 1e-6,
                            multipliers=dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                             residual_multiplier=0.22, logits_scaling=6.0), experts=40,
                            experts_per_tok=8),
    "olmoe-1b-7b": Shape(OLMOE, 2048, 16, 16, 16, 1024, 50304, False, 1e4, None, 4096, 1e-5, experts=64,
                         experts_per_tok=8),
    "ernie4.5-0.3b": Shape(ERNIE, 1024, 18, 16, 2, 3072, 103424, True, 5e5, None, 131072, 1e-5, head_size=128),
    "exaone4-1.2b": Shape(EXAONE4, 2048, 30, 32, 8, 4096, 102400, True, 1e6, dict(LLAMA3_ROPE, factor=16.0), 65536,
                          1e-5, head_size=64),
    "glm4-9b": Shape(GLM4, 4096, 40, 32, 2, 13696, 151552, False, 1e4, None, 32768, 1e-5, None, 0.5, head_size=128),
    "afm-4.5b": Shape(ARCEE, 2560, 36, 20, 4, 18432, 128004, False, 1e4, dict(
        rope_type="yarn", factor=20.0, original_max_position_embeddings=4096), 65536, 1e-5, head_size=128),
    "starcoder2-3b": Shape(STARCODER2, 3072, 30, 24, 2, 12288, 49152, True, 999999.4420358813, None, 16384, 1e-5),
    # LFM2-1.2B: 6 attention layers of 16, the MLP's 8192 features (block_ff_dim 12288, auto-adjusted), kernel 3
    "lfm2-1.2b": Shape(LFM2, 2048, 16, 32, 8, 8192, 65536, True, 1e6, None, 128000, 1e-5,
                       attention_layers=(2, 5, 8, 10, 12, 14)),
    # LFM2-8B-A1B: 24 layers (6 with attention), two dense MLPs of 7168, then 32 experts of 1792, 4 a token
    "lfm2-8b-a1b": Shape(LFM2MOE, 2048, 24, 32, 8, 1792, 65536, True, 1e6, None, 128000, 1e-5, experts=32,
                         experts_per_tok=4, attention_layers=(2, 6, 10, 14, 18, 21), dense_layers=2,
                         dense_intermediate_size=7168),
    # a Trinity-Nano-like AFMoE (6.1B, ~1B active: llama.cpp sizes 56 layers as 6B): 2 dense MLPs of 3072, then
    # 128 experts of 256 (8 a token) and a shared one; three sliding layers (2048) with RoPE, then a full one
    "afmoe-6b-a1b": Shape(AFMOE, 1024, 56, 8, 2, 256, 200192, False, 1e4, None, 131072, 1e-5, 2048, head_size=128,
                          experts=128, experts_per_tok=8, dense_layers=2, dense_intermediate_size=3072,
                          shared_experts=1),
    # Qwen3.5-0.8B's text model: 18 gated DeltaNet layers (16 key / value heads of 128, kernel 4), every fourth
    # layer full attention (8 heads, 2 KV, of 256, RoPE over 64 of each); tied embeddings
    "qwen3.5-0.8b": Shape(QWEN35, 1024, 24, 8, 2, 3584, 248320, True, 1e7, None, 262144, 1e-6,
                          partial_rotary_factor=0.25, head_size=256,
                          linear_attention=LinearAttention(16, 16, 128, 128, 4)),
    # Granite 4.0-H-Micro-like (illustrative values in its shape, not the released config): 40 layers, attention (16
    # heads, 4 KV, of 128, no RoPE) in layers 9, 19, 29 and 39, Mamba2 in the others (64 heads of 64, state 128, one
    # group, kernel 4); a dense shared MLP of 8192 in every layer; tied embeddings; a vocabulary that llama.cpp's
    # converter does not pad further (a multiple of 8, its pad_vocab_size_multiple for hybrids)
    "granite4-h-micro": Shape(GRANITEHYBRID, 2048, 40, 16, 4, 8192, 100352, True, 1e4, None, 131072, 1e-5,
                              multipliers=dict(embedding_multiplier=12.0, attention_multiplier=0.0078125,
                                               residual_multiplier=0.22, logits_scaling=8.0),
                              attention_layers=(9, 19, 29, 39), mamba2=Mamba2(64, 64, 128)),
    "granite-2b": Shape(GRANITE, 2048, 40, 32, 8, 8192, 49159, True, 1e7, None, 131072, 1e-5, multipliers=dict(
        embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0)),
}
