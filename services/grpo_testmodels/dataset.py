"""Toy prompt datasets (jsonl) for the tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer

MIN_WORDS, MAX_WORDS = 3, 6


def vocabulary_words(model_dir: Path) -> list[str]:
    """Alphabetic whole words from the model's vocabulary, sorted.

    Sorted because the vocabulary's dict order is not stable between processes,
    and the dataset must be the same for the same seed.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be a model directory written by make-model")
    tok = Tokenizer.from_file(str(path))
    words = set()
    for token in tok.get_vocab(with_added_tokens=False):
        word = token.removeprefix("Ġ")  # byte-level BPE writes a leading space as "Ġ"
        if len(word) >= 2 and word.isascii() and word.isalpha():
            words.add(word)
    if len(words) < 2:
        raise ValueError(f"{path}: only {len(words)} alphabetic words in the vocabulary, too few for prompts")
    return sorted(words)


def make_dataset(
    out_path: Path,
    model_dir: Path,
    n_prompts: int = 64,
    seed: int = 1234,
    conversational: bool = False,
) -> Path:
    """Write `n_prompts` rows {"prompt", "answer"}: 3-6 vocabulary words; the answer is the last word.

    Conversational rows hold the prompt as [{"role": "user", "content": ...}].
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be at least 1, got {n_prompts}")
    words = vocabulary_words(Path(model_dir))
    rng = random.Random(seed)
    rows = []
    for _ in range(n_prompts):
        chosen = [rng.choice(words) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
        text = " ".join(chosen)
        prompt: object = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "answer": chosen[-1]})
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out_path
