"""Model presets: the shapes `make_model` can write.

`tiny` is the CPU test and demo model; `qwen2.5-1.5b` is Qwen2.5-1.5B's shape
with a smaller (32,000-entry) vocabulary, used for GPU benchmarks; `qwen2.5-1.5b-learn` is
the same shape with larger embeddings, so GRPO with LoRA can raise the demo reward on it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Config

#: Special tokens, in id order: the tokenizer trainer puts them first, so their ids are 0, 1, 2.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2


@dataclass(frozen=True)
class Preset:
    """A model shape plus the tokenizer-corpus budget that goes with it."""

    name: str
    description: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    initializer_range: float
    dtype: str  # "float32" or "bfloat16": the dtype weights are created and saved in
    corpus_chars: int  # characters of stdlib source the tokenizer is trained on
    #: Standard deviation of the (tied) embedding; None: `initializer_range`, like every other weight.
    embedding_init_range: float | None = None


#: Qwen2.5-1.5B's shape with a smaller vocabulary (the GPU benchmarks' model, and the learning preset's base).
QWEN25_15B = Preset(
    name="qwen2.5-1.5b",
    description=(
        "Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 kv heads, tied embeddings, bf16) "
        "but a 32,000-entry vocabulary instead of 151,936 (~1.36B parameters): for GPU benchmarks."
    ),
    vocab_size=32_000,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
    dtype="bfloat16",
    corpus_chars=8_000_000,
)

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        description=(
            "~140k-parameter float32 model for CPU tests and the demo: vocab 512 (3 specials, 256 bytes, "
            "253 merges), hidden 64, 2 layers; initializer_range 0.2 so LoRA-GRPO can move its output "
            "distribution (with 0.02 a token-share reward cannot rise past ~1.24x)."
        ),
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
        dtype="float32",
        corpus_chars=1_000_000,
    ),
    "qwen2.5-1.5b": QWEN25_15B,
    "qwen2.5-1.5b-learn": replace(
        QWEN25_15B,
        name="qwen2.5-1.5b-learn",
        description=(
            "qwen2.5-1.5b with embeddings of std 0.1 instead of 0.02, for GPU benchmarks whose reward must move. "
            "The final RMSNorm bounds the hidden state at sqrt(1536) ~ 39, so the most a LoRA can add to the "
            "logits of a 1/8 token range is ~24x the embedding std: 0.48 nats at 0.02 (the demo reward cannot "
            "rise past ~1.5x), 2.4 nats at 0.1 (up to ~0.6 from 0.125). At lr 1e-3 it did not rise in 20 steps "
            "either (BENCHMARKS.md): the bound is lifted, not the rate."
        ),
        embedding_init_range=0.1,
    ),
}


def get_preset(preset: str) -> Preset:
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}") from None


def preset_config(preset: str, seed: int | None = None) -> Qwen2Config:
    """The Qwen2Config of a preset; with `seed`, the config records preset and seed.

    Recording them keeps a model's config honest about where its weights came from (the
    base-model fingerprint also hashes the weight bytes, so two seeds differ either way).
    """
    from transformers import Qwen2Config

    p = get_preset(preset)
    config = Qwen2Config(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": p.rope_theta},
        tie_word_embeddings=p.tie_word_embeddings,
        initializer_range=p.initializer_range,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
        dtype=p.dtype,
        architectures=["Qwen2ForCausalLM"],
    )
    if seed is not None:  # an extra config attribute is saved to config.json and ignored by loaders
        setattr(config, "grpo_testmodel", {"preset": p.name, "seed": seed})  # noqa: B010
    return config
