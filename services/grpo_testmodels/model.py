"""Write a random-weight Qwen2 model directory that transformers (and vLLM) load without a hub."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_testmodels.presets import ENDOFTEXT_ID, IM_END_ID, get_preset, preset_config
from grpo_testmodels.tokenizer import train_tokenizer, wrap_tokenizer

#: Files a build writes: removed before an overwrite (stale shards would change the fingerprint).
_STALE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def make_model(out_dir: Path, preset: str = "tiny", seed: int = 0, overwrite: bool = False) -> Path:
    """Write a Qwen2ForCausalLM with random weights and a locally trained tokenizer to `out_dir`.

    Presets (see `PRESETS`): `tiny` (CPU tests, demo), `qwen2.5-1.5b` (Qwen2.5-1.5B's
    shape with a 32,000-entry vocabulary) and `qwen2.5-1.5b-learn` (the same with larger
    embeddings, for benchmarks whose reward must rise). Same preset and seed give byte-identical files.
    A non-empty `out_dir` is refused unless `overwrite`, which then removes only the files
    a build writes.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    p = get_preset(preset)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out_dir} is not empty: refusing to overwrite it")
        for pattern in _STALE_PATTERNS:
            for stale in out_dir.glob(pattern):
                stale.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = wrap_tokenizer(train_tokenizer(p.vocab_size, p.corpus_chars), p.max_position_embeddings)
    if len(tokenizer) > p.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} entries, more than the model's {p.vocab_size}")

    config = preset_config(preset, seed=seed)
    dtype = getattr(torch, p.dtype)
    torch.manual_seed(seed)
    # Created directly in the target dtype on CPU: no float32 copy of a 1.5B model.
    model = Qwen2ForCausalLM._from_config(config, dtype=dtype)
    if p.embedding_init_range is not None:  # after the rest, so the other weights stay as the base preset's
        with torch.no_grad():
            model.get_input_embeddings().weight.normal_(0.0, p.embedding_init_range)
            if not p.tie_word_embeddings:
                model.get_output_embeddings().weight.normal_(0.0, p.embedding_init_range)
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
    )
    model.save_pretrained(out_dir, max_shard_size="2GB")
    tokenizer.save_pretrained(out_dir)
    _make_readable(out_dir)
    return out_dir


def _make_readable(out_dir: Path) -> None:
    """Give written files the umask's usual mode.

    transformers writes weight files through a private temporary file (mode 0600): a
    server container running as another user could not read a model on a shared volume.
    """
    umask = os.umask(0)
    os.umask(umask)
    for pattern in _STALE_PATTERNS:
        for path in out_dir.glob(pattern):
            path.chmod(0o666 & ~umask)
