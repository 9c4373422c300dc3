"""Test models and toy datasets that need no model hub.

`make_model` writes a random-weight Qwen2 model with a byte-level BPE tokenizer trained
on this machine's Python standard library; `make_dataset` writes a jsonl prompt set.
"""

from grpo_testmodels.dataset import make_dataset
from grpo_testmodels.model import make_model
from grpo_testmodels.presets import PRESETS, SPECIAL_TOKENS, Preset, preset_config
from grpo_testmodels.targets import target_token_ids

__all__ = [
    "PRESETS",
    "SPECIAL_TOKENS",
    "Preset",
    "make_dataset",
    "make_model",
    "preset_config",
    "target_token_ids",
]
