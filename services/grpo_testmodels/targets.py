"""The target token range of the learnable demo reward."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def target_token_ids(model_dir: Path) -> tuple[int, int]:
    """A contiguous id range [lo, hi) covering 1/8 of the vocabulary and no special token.

    It is the target set of the demo's `token_fraction` reward ("share of completion
    tokens whose id falls in [lo, hi)"): a near-uniform random policy scores about 1/8,
    and GRPO can push it towards 1. The range starts right after the special tokens
    and the 256 byte tokens, i.e. at the first learned merges.
    """
    config_path = model_dir / "config.json"
    tokenizer_path = model_dir / "tokenizer.json"
    for path in (config_path, tokenizer_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: {model_dir} is not a model written by make_model")
    vocab_size = int(json.loads(config_path.read_text())["vocab_size"])
    tok = Tokenizer.from_file(str(tokenizer_path))
    specials = {int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
    size = vocab_size // 8
    start = len(specials) + 256
    if start + size > vocab_size:  # a vocabulary too small to skip the bytes: start after the specials
        start = len(specials)
    for lo in range(start, vocab_size - size + 1):
        if not specials.intersection(range(lo, lo + size)):
            return lo, lo + size
    raise ValueError(f"{model_dir}: no contiguous run of {size} non-special ids in a vocabulary of {vocab_size}")
