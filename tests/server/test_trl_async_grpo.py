"""TRL's `AsyncGRPOTrainer` (its own client, unchanged) trains a LoRA adapter against `grpo serve`.

It syncs through vLLM's routes (`/pause?mode=keep`, `/v1/load_lora_adapter` with `trl-policy-v<N>`,
`/resume`, `/v1/unload_lora_adapter` for versions past `max_staleness`), reads `/server_info` and
`/v1/models`, and generates with `/v1/completions` by the adapter's name. Its client sends no
Authorization header of its own: `requests` sends the netrc entry, the token as the Basic password.

What TRL needs of the machine is met for CPU here, none of it on the path to the server:
- its training forward is tree attention through FlashAttention-3 (`kernels-community/flash-attn3`,
  fetched from the Hub on first use, CUDA only): `grpo_testmodels.varlen_attention` stands in for the
  kernel's `flash_attn_varlen_func` (same layout, causal bottom-right, grouped-query heads);
- it asks CUDA for the device's peak FLOPS (a logging figure);
- it requires vLLM installed in the trainer's environment though its rollout worker only speaks HTTP;
- its rollout worker wants a chat template it knows (to parse tool calls): the test tokenizer gets
  Qwen3's, never rendered for these plain-text prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from grpo_testmodels import varlen_attention
from tests.fixtures.server import start_server

pytestmark = pytest.mark.slow

MAX_STEPS = 3
MAX_STALENESS = 1


def length_reward(completions: list[str], **_: object) -> list[float]:
    """Module level, so TRL's spawned reward process can import it."""
    return [min(len(c), 64) / 64 for c in completions]


def test_trl_async_grpo_trainer_syncs_its_adapter_and_generates_through_grpo_serve(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
):
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.async_rollout_worker as worker_module
    import trl.experimental.async_grpo.packing as packing_module
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    monkeypatch.setattr(trainer_module, "get_peak_flops_per_device", lambda *args, **kwargs: 1e12)
    monkeypatch.setattr(worker_module, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(packing_module, "_flash_attn", lambda: varlen_attention.KERNEL)

    server = start_server(tmp_path / "server", tiny_model_dir, server_overrides={"maxLoraRank": 8, "maxLoras": 4})
    try:
        netrc = tmp_path / "netrc"
        netrc.write_text(f"machine 127.0.0.1 login grpo password {server.token}\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        args = AsyncGRPOConfig(
            output_dir=str(server.adapter_root / "trl"),  # the adapters it publishes must be inside the root
            vllm_server_base_url=server.url, max_steps=MAX_STEPS, max_staleness=MAX_STALENESS,
            num_generations=4, per_device_train_batch_size=8, max_completion_length=16, learning_rate=1e-3,
            logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
        )
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        tokenizer.chat_template = qwen3_chat_template
        trainer = AsyncGRPOTrainer(
            model=str(tiny_model_dir), reward_funcs=length_reward, args=args, processing_class=tokenizer,
            train_dataset=load_dataset("json", data_files=str(tiny_dataset), split="train"),
            peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]),
        )
        trainer.train()
        assert trainer.state.global_step == MAX_STEPS

        health = httpx.get(server.url + "/health/", timeout=30).json()
        last = MAX_STEPS + 1  # one sync before the first step, one after each
        assert health["adapter"]["version"] == last and health["adapter"]["path"].endswith(f"trl-policy-v{last}")
        served = {card["id"] for card in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}
        assert f"trl-policy-v{last}" in served
        assert "trl-policy-v1" not in served  # unloaded once past max_staleness
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert f"grpo_server_adapter_loads_total {float(last)}" in metrics
        log = server.log_path.read_text()
        assert log.count("POST /pause?mode=keep HTTP/1.1\" 200") == last
        assert log.count("POST /v1/unload_lora_adapter HTTP/1.1\" 200") >= 1
        assert "POST /v1/completions HTTP/1.1\" 200" in log
        assert " 401 " not in log and " 404 " not in log and " 500 " not in log
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(history) == MAX_STEPS, json.dumps(trainer.state.log_history)[-2000:]
    finally:
        server.stop(timeout=10)
