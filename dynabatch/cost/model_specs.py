"""Transformer shapes for the analytic cost model: a spec, named presets, and parameter counts.

A :class:`TransformerSpec` holds only what the cost model needs (widths, depths, vocabulary,
FFN type, key/value heads, norm and bias layout, storage dtype). Presets give the published shapes
of the models in the DynaPipe (T5, GPT) and TeraPipe (GPT-3 13B/175B) papers and of the Llama-style
decoders people fine-tune today (Llama 3, Qwen2.5, Mistral); each model family builds a spec from a
Hugging Face config (``dynabatch.models.families.analytic_spec``).

A model is a sequence of *layer kinds* (:func:`layer_kinds`); ``gpt`` is any decoder-only block
(GPT-2: LayerNorm, biases, GELU MLP; Llama-style: RMSNorm, no biases, gated MLP, grouped-query
attention, rotary positions, the spec's fields say which)::

    causal:   embedding, gpt x L, lm_head
    seq2seq:  embedding, t5_encoder x L_enc, decoder_embedding, t5_decoder x L_dec, lm_head

``embedding`` owns the token table (and GPT's learned positions, T5's encoder relative-position
bias table); ``decoder_embedding`` is the seam of T5's two stacks: the encoder's final norm, the
decoder-side lookup into the shared table and the decoder's relative-position bias table;
``lm_head`` is the final norm, the output projection (its weight counted only when untied) and the
loss. :func:`layer_param_count` matches the parameter counts of Hugging Face's ``T5Block`` /
``GPT2Block`` (built without a relative-position bias) exactly, and the sum over
:func:`layer_kinds` matches ``T5ForConditionalGeneration`` / ``GPT2LMHeadModel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.core.sequence import CAUSAL, SEQ2SEQ, SEQUENCE_KINDS, is_seq2seq, sequence_kind

FAMILIES = SEQUENCE_KINDS
LAYER_KINDS: dict[str, tuple[str, ...]] = {
    SEQ2SEQ: ("embedding", "t5_encoder", "decoder_embedding", "t5_decoder", "lm_head", "t5_enc_attn", "t5_enc_ffn"),
    CAUSAL: ("embedding", "gpt", "lm_head", "gpt_attn", "gpt_mlp"),
}
"""The layer kinds each sequence kind is made of (``gpt_attn`` / ``gpt_mlp`` and ``t5_enc_attn`` / ``t5_enc_ffn``:
the halves of a block that a stage boundary cuts, :data:`BLOCK_HALVES`)."""
BLOCK_HALVES: dict[str, tuple[str, str]] = {"gpt": ("gpt_attn", "gpt_mlp"), "t5_encoder": ("t5_enc_attn", "t5_enc_ffn")}
"""Block kinds a layer split may cut inside, and their two halves in model order: the attention half (``gpt_attn``:
the first norm, self-attention and its residual add; ``t5_enc_attn``: HF's ``T5LayerSelfAttention``, the same with
the relative-position bias) and the feed-forward half (``gpt_mlp``: the second norm, the MLP and its residual add;
``t5_enc_ffn``: HF's ``T5LayerFF``)."""
ATTENTION_HALVES = tuple(pair[0] for pair in BLOCK_HALVES.values())
"""The first halves of :data:`BLOCK_HALVES`: norm, self-attention, residual add."""
FFN_HALVES = tuple(pair[1] for pair in BLOCK_HALVES.values())
"""The second halves of :data:`BLOCK_HALVES`: norm, feed-forward, residual add (no attention, no mask or bias)."""
BLOCK_KINDS = ("gpt", "t5_encoder", "t5_decoder", *ATTENTION_HALVES, *FFN_HALVES)
"""Transformer blocks and block halves: every pipeline stage holds at least one, cuts fall just before one, and
full recomputation checkpoints each."""
CAUSAL_ATTENTION_KINDS = ("gpt", BLOCK_HALVES["gpt"][0])
"""Decoder-only layer kinds that run attention: a whole block, or its attention half."""
ENCODER_ATTENTION_KINDS = ("t5_encoder", BLOCK_HALVES["t5_encoder"][0])
"""T5 encoder layer kinds that run self-attention (and so need the encoder's mask and position bias)."""
NORMS = ("layer", "rms")
BIASES = ("all", "qkv", "none")


@dataclass(frozen=True)
class TransformerSpec:
    """The shape of a T5 (encoder-decoder) or GPT (decoder-only) transformer.

    T5 layers have no biases and use RMSNorm (one weight vector); GPT layers have biases and
    LayerNorm (weight and bias), as in the Hugging Face and Megatron implementations.
    """

    family: str
    """Sequence kind, ``causal`` or ``seq2seq`` (legacy ``gpt``/``t5`` accepted)."""
    d_model: int
    """Hidden size."""
    num_heads: int
    """Attention heads."""
    d_kv: int
    """Width of one head; ``num_heads * d_kv`` is the attention inner width (T5-11B: 128 x 128 over d_model 1024)."""
    d_ff: int
    """FFN inner width."""
    num_layers: int
    """Encoder layers (T5) or transformer blocks (GPT)."""
    num_decoder_layers: int
    """Decoder layers (T5); 0 for GPT."""
    vocab_size: int
    """Rows of the token table and columns of the logits."""
    gated_ffn: bool = False
    """Gated FFN (T5 v1.1 gated-GELU: two input projections and an elementwise product)."""
    dtype_bytes: int = 2
    """Bytes per parameter / activation element in the compute dtype (2 for bf16/fp16, 4 for fp32)."""
    tie_embeddings: bool = True
    """Output projection shares the token table (original T5, GPT); T5 v1.1 unties it."""
    max_positions: int = 0
    """Rows of GPT's learned position table; 0 for T5 (relative positions)."""
    relative_attention_num_buckets: int = 32
    """T5's relative-position buckets (a ``buckets x heads`` table per stack); unused for GPT."""
    num_kv_heads: int = 0
    """Key/value heads of grouped-query attention (Llama 3, Qwen2, Mistral); 0 = ``num_heads``."""
    norm: str = "layer"
    """Causal blocks: ``layer`` (LayerNorm, weight and bias: GPT-2) or ``rms`` (RMSNorm, weight: Llama).
    Seq2seq (T5) always uses RMSNorm."""
    biases: str = "all"
    """Causal blocks: linear-layer biases, ``all`` (GPT-2), ``qkv`` (Qwen2: Q/K/V only) or ``none`` (Llama)."""
    fused_qkv: bool = False
    """One projection computes Q, K and V (GPT-2's ``c_attn``); else three (T5, Llama). Under autocast each
    projection saves its own half-precision copy of its fp32 input."""
    qk_norm: bool = False
    """Causal blocks: RMSNorm over each head of Q and K (Qwen3; ``2 d_kv`` weights per block)."""
    ffn_saved: float = 0.0
    """FFN-wide tensors the activation path keeps for backward (:mod:`dynabatch.cost.activation_memory`,
    measured for a HF config's activation); 0: the textbook count, 3 gated, 2 plain (the presets)."""

    @property
    def ffn_saved_tensors(self) -> float:
        """:attr:`ffn_saved`, or the textbook count when it is 0."""
        return self.ffn_saved or (3.0 if self.gated_ffn else 2.0)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "family", sequence_kind(self.family))
        except ValueError:
            raise ValueError(f"family {self.family!r} is not supported; valid families: {', '.join(FAMILIES)}") from None
        if self.norm not in NORMS or self.biases not in BIASES:
            raise ValueError(f"norm must be one of {NORMS} and biases one of {BIASES}, got {self.norm!r}, {self.biases!r}")
        for name in ("d_model", "num_heads", "d_kv", "d_ff", "num_layers", "vocab_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not is_seq2seq(self.family) and self.num_decoder_layers != 0:
            raise ValueError(
                f"a gpt spec has no decoder stack; num_decoder_layers must be 0, got {self.num_decoder_layers}"
            )
        if is_seq2seq(self.family) and self.num_decoder_layers < 1:
            raise ValueError(f"a t5 spec needs num_decoder_layers >= 1, got {self.num_decoder_layers}")
        kv = self.kv_heads
        if kv < 1 or self.num_heads % kv:
            raise ValueError(f"num_kv_heads must divide num_heads {self.num_heads}, got {self.num_kv_heads}")
        if self.max_positions < 0 or self.relative_attention_num_buckets < 0:
            raise ValueError(
                f"max_positions and relative_attention_num_buckets must be >= 0, "
                f"got {self.max_positions} and {self.relative_attention_num_buckets}"
            )

    @property
    def rms_norm(self) -> bool:
        """RMSNorm (T5 always, causal blocks with ``norm="rms"``) rather than LayerNorm."""
        return self.norm == "rms" or is_seq2seq(self.family)

    @property
    def d_attn(self) -> int:
        """Attention inner width ``num_heads * d_kv``."""
        return self.num_heads * self.d_kv

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_heads`` without grouped-query attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def d_kv_attn(self) -> int:
        """Width of the key (and of the value) projection, ``kv_heads * d_kv``."""
        return self.kv_heads * self.d_kv

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Kinds valid for this family (see :data:`LAYER_KINDS`)."""
        return LAYER_KINDS[self.family]


def _t5(d_model: int, heads: int, d_kv: int, d_ff: int, layers: int, v1_1: bool) -> TransformerSpec:
    return TransformerSpec(
        "t5", d_model, heads, d_kv, d_ff, layers, layers, vocab_size=32128, gated_ffn=v1_1, tie_embeddings=not v1_1
    )


def _gpt(d_model: int, heads: int, layers: int, positions: int = 2048) -> TransformerSpec:
    return TransformerSpec(
        "gpt", d_model, heads, d_model // heads, 4 * d_model, layers, 0, vocab_size=50257, max_positions=positions
    )


def _llama(d_model: int, layers: int, heads: int, kv_heads: int, d_ff: int, vocab: int, tied: bool,
           qkv_bias: bool = False) -> TransformerSpec:
    """A Llama-style decoder: RMSNorm, gated SiLU MLP, grouped-query attention, rotary positions."""
    return TransformerSpec(CAUSAL, d_model, heads, d_model // heads, d_ff, layers, 0, vocab_size=vocab, gated_ffn=True,
                           tie_embeddings=tied, max_positions=0, num_kv_heads=kv_heads, norm="rms",
                           biases="qkv" if qkv_bias else "none")


PRESETS: dict[str, TransformerSpec] = {
    # Original T5 (Raffel et al. 2020, Table 14; HF t5-base .. t5-11b configs): ReLU FFN, tied head.
    "t5-base": _t5(768, 12, 64, 3072, 12, v1_1=False),  # 223M
    "t5-large": _t5(1024, 16, 64, 4096, 24, v1_1=False),  # 738M
    "t5-3b": _t5(1024, 32, 128, 16384, 24, v1_1=False),  # 2.85B
    "t5-11b": _t5(1024, 128, 128, 65536, 24, v1_1=False),  # 11.3B
    # T5 v1.1 (HF google/t5-v1_1-*): gated-GELU FFN, untied head.
    "t5-v1_1-base": _t5(768, 12, 64, 2048, 12, v1_1=True),  # 248M
    "t5-v1_1-large": _t5(1024, 16, 64, 2816, 24, v1_1=True),  # 783M
    "t5-v1_1-xl": _t5(2048, 32, 64, 5120, 24, v1_1=True),  # 2.85B
    "t5-v1_1-xxl": _t5(4096, 64, 64, 10240, 24, v1_1=True),  # 11.1B
    # GPT-3 family shapes (Brown et al. 2020, Table 2.1), GPT-2 vocabulary, 2048 positions, d_ff = 4 d.
    # The paper lists 1.3B with 24 heads of 128 (inconsistent with d=2048); 16 x 128 is used, as in
    # GPT-Neo 1.3B. 13B lists d=5140; 5120 = 40 x 128 is used, as in TeraPipe and Megatron.
    "gpt-350m": _gpt(1024, 16, 24),  # 356M (GPT-2 medium shape)
    "gpt-760m": _gpt(1536, 16, 24),  # 760M
    "gpt-1.3b": _gpt(2048, 16, 24),  # 1.32B
    "gpt-2.7b": _gpt(2560, 32, 32),  # 2.65B
    "gpt-6.7b": _gpt(4096, 32, 32),  # 6.66B
    "gpt3-13b": _gpt(5120, 40, 40),  # 12.9B
    "gpt3-175b": _gpt(12288, 96, 96),  # 174.6B
    # Llama-style decoders (HF config.json of meta-llama/Llama-3.2-1B, Meta-Llama-3-8B, Meta-Llama-3-70B,
    # Qwen/Qwen2.5-0.5B, Qwen2.5-7B, mistralai/Mistral-7B-v0.1): GQA, gated MLP, RMSNorm, rotary.
    "llama3.2-1b": _llama(2048, 16, 32, 8, 8192, 128256, tied=True),  # 1.24B
    "llama3-8b": _llama(4096, 32, 32, 8, 14336, 128256, tied=False),  # 8.03B
    "llama3-70b": _llama(8192, 80, 64, 8, 28672, 128256, tied=False),  # 70.55B
    "qwen2.5-0.5b": _llama(896, 24, 14, 2, 4864, 151936, tied=True, qkv_bias=True),  # 494M
    "qwen2.5-7b": _llama(3584, 28, 28, 4, 18944, 152064, tied=False, qkv_bias=True),  # 7.62B
    "mistral-7b": _llama(4096, 32, 32, 8, 14336, 32000, tied=False),  # 7.24B
}
"""Named model shapes; comments give the parameter count :func:`num_params` computes."""


def model_spec(name: str) -> TransformerSpec:
    """The preset called ``name`` (see :data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model spec {name!r}; valid names: {', '.join(PRESETS)}")
    return PRESETS[name]


def check_kind(spec: TransformerSpec, kind: str) -> None:
    """``ValueError`` naming the valid kinds when ``kind`` is not one of ``spec``'s."""
    if kind not in spec.layer_kinds:
        valid = ", ".join(spec.layer_kinds)
        raise ValueError(f"unknown layer kind {kind!r} for a {spec.family} model; valid kinds: {valid}")


def layer_param_count(spec: TransformerSpec, kind: str) -> int:
    """Parameters of one layer of ``kind`` (see the module docstring for what each kind holds)."""
    check_kind(spec, kind)
    d, a, f, v = spec.d_model, spec.d_attn, spec.d_ff, spec.vocab_size
    if not is_seq2seq(spec.family):
        norm = 2 * d if spec.norm == "layer" else d  # LayerNorm: weight + bias; RMSNorm: weight
        if kind == "gpt":  # 2 norms, Q/K/V and output projections, FFN (2 or 3 matrices), biases
            return sum(layer_param_count(spec, half) for half in BLOCK_HALVES["gpt"])
        if kind == "gpt_attn":  # norm, Q/K/V and output projections (+ biases, Q/K norms)
            kv = spec.d_kv_attn
            bias = {"all": (a + 2 * kv) + d, "qkv": a + 2 * kv, "none": 0}
            qk_norm = 2 * spec.d_kv if spec.qk_norm else 0
            return norm + d * (a + 2 * kv) + a * d + bias[spec.biases] + qk_norm
        if kind == "gpt_mlp":  # norm, FFN (2 or 3 matrices) (+ biases)
            ffn = d * f * (3 if spec.gated_ffn else 2)
            bias = f * (2 if spec.gated_ffn else 1) + d if spec.biases == "all" else 0
            return norm + ffn + bias
        if kind == "embedding":
            return v * d + spec.max_positions * d
        return norm + (0 if spec.tie_embeddings else v * d)  # lm_head: final norm (+ untied head)
    ffn = d * f * (3 if spec.gated_ffn else 2)
    attention = 4 * d * a + d  # q, k, v, o and the sub-layer's norm
    bias_table = spec.relative_attention_num_buckets * spec.num_heads
    if kind == "t5_encoder":
        return sum(layer_param_count(spec, half) for half in BLOCK_HALVES["t5_encoder"])
    if kind == "t5_enc_attn":  # q, k, v, o and the sub-layer's norm
        return attention
    if kind == "t5_enc_ffn":  # the FFN and its norm
        return ffn + d
    if kind == "t5_decoder":
        return 2 * attention + ffn + d
    if kind == "embedding":
        return v * d + bias_table
    if kind == "decoder_embedding":
        return d + bias_table  # encoder final norm + decoder relative-position bias table
    return d + (0 if spec.tie_embeddings else v * d)  # lm_head: decoder final norm (+ untied head)


def tied_copy_params(spec: TransformerSpec, kinds) -> int:
    """Parameters of the token-table copy a pipeline stage of layer ``kinds`` holds besides its layers' own: a stage
    whose layers use the tied table (T5's decoder embedding; a tied LM head) without holding the input embedding
    keeps a copy of it, with its own gradient and optimizer states (:func:`layer_param_count` counts the table once,
    in ``embedding``)."""
    users = {"lm_head"} if spec.tie_embeddings else set()
    if is_seq2seq(spec.family):
        users.add("decoder_embedding")
    kinds = set(kinds)
    return spec.vocab_size * spec.d_model if kinds & users and "embedding" not in kinds else 0


def layer_kinds(spec: TransformerSpec) -> list[str]:
    """The whole model as an ordered list of layer kinds (what a pipeline partitioner splits)."""
    if not is_seq2seq(spec.family):
        return ["embedding"] + ["gpt"] * spec.num_layers + ["lm_head"]
    return (
        ["embedding"]
        + ["t5_encoder"] * spec.num_layers
        + ["decoder_embedding"]
        + ["t5_decoder"] * spec.num_decoder_layers
        + ["lm_head"]
    )


def num_params(spec: TransformerSpec) -> int:
    """Parameters of the whole model (the sum over :func:`layer_kinds`)."""
    return sum(layer_param_count(spec, kind) for kind in layer_kinds(spec))


def split_halves(kinds) -> list[str]:
    """``kinds`` with every block that has halves (:data:`BLOCK_HALVES`) written as its two halves."""
    return [h for k in kinds for h in BLOCK_HALVES.get(k, (k,))]


def join_halves(kinds) -> tuple[str, ...]:
    """One stage's ``kinds`` with each block's two adjacent halves written as the whole block again (a stage
    keeps a half only at its edge, where a cut falls inside the block)."""
    whole = {pair: block for block, pair in BLOCK_HALVES.items()}
    out: list[str] = []
    for k in kinds:
        if out and (out[-1], k) in whole:
            out[-1] = whole[(out[-1], k)]
        else:
            out.append(k)
    return tuple(out)
