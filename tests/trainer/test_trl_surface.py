"""The TRL surface the project overrides: fails loudly when a TRL upgrade moves it."""

from __future__ import annotations

import inspect

import pytest
import trl.trainer.grpo_trainer as grpo_trainer_module
from trl.generation.vllm_generation import VLLMGeneration

from grpo_trainer import trl_overrides
from grpo_trainer.trl_overrides import ServerGeneration, server_generation_installed, surface_problems


def test_installed_trl_matches_the_override_surface():
    assert surface_problems() == []


def test_override_methods_keep_trl_signatures():
    for name in ("_init_vllm", "sync_weights", "generate"):
        ours = list(inspect.signature(getattr(ServerGeneration, name)).parameters)
        theirs = list(inspect.signature(getattr(VLLMGeneration, name)).parameters)
        assert ours == theirs, name


def test_a_moved_surface_is_reported(monkeypatch: pytest.MonkeyPatch):
    def generate(self, prompt_ids, num_generations):  # a hypothetical TRL with another signature
        raise NotImplementedError

    monkeypatch.setattr(VLLMGeneration, "generate", generate)
    monkeypatch.setattr(trl_overrides.trl, "__version__", "9.9.9")
    problems = "\n".join(surface_problems())
    assert "VLLMGeneration.generate parameters" in problems
    assert "trl is 9.9.9" in problems


def test_install_swaps_the_module_global_only_while_building():
    original = grpo_trainer_module.VLLMGeneration
    with server_generation_installed(backend=None):  # type: ignore[arg-type]
        assert issubclass(grpo_trainer_module.VLLMGeneration, ServerGeneration)
    assert grpo_trainer_module.VLLMGeneration is original
