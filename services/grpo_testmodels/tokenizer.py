"""A byte-level BPE tokenizer trained locally on the Python standard library's sources.

No hub: the corpus is whatever stdlib is on this machine, read from a sorted file
list up to a character budget, so the same machine always trains the same tokenizer.
(A machine with a different Python version may train a different one.)
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from grpo_testmodels.presets import SPECIAL_TOKENS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

#: ChatML, as Qwen2.5 uses it (without the default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Directories under the stdlib path whose content depends on what else is installed, or is bulky test data.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def corpus_files(stdlib: Path | None = None) -> list[Path]:
    """The stdlib's .py files in a sorted (hence stable) order."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    if not files:
        raise FileNotFoundError(f"no .py files under the Python standard library at {root}: cannot train a tokenizer")
    return files


def corpus_texts(max_chars: int, stdlib: Path | None = None) -> Iterator[str]:
    """Stdlib source text, file by file, stopping after `max_chars` characters."""
    left = max_chars
    for path in corpus_files(stdlib):
        if left <= 0:
            return
        text = path.read_text(encoding="utf-8", errors="replace")[:left]
        left -= len(text)
        yield text


def train_tokenizer(vocab_size: int, max_chars: int) -> Tokenizer:
    """Train a byte-level BPE of `vocab_size` entries: 3 specials (ids 0-2), 256 bytes, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(max_chars), trainer=trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"tokenizer trainer placed {token} at {tok.token_to_id(token)}, not {expected_id}")
    return tok


def wrap_tokenizer(tok: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    """Wrap for transformers: ChatML template, eos <|im_end|>, pad <|endoftext|> (as Qwen2.5-Instruct)."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
