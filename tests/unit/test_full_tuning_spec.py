"""trainer.tuning and server.weightTransfer: what the spec accepts, and what the server is configured with."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from grpo_api.models import GRPORunSpec
from grpo_api.weight_transfer import resolve_weight_transfer


def spec(**sections: Any) -> GRPORunSpec:
    return GRPORunSpec.model_validate({"model": {"name": "m", "path": "/m"}, "dataset": {"path": "/d"},
                                       "rewards": [{"function": "exact_match"}], **sections})


def test_tuning_defaults_to_lora_and_full_ignores_the_lora_rank_limit() -> None:
    assert not spec().trainer.full
    # r 64 exceeds maxLoraRank 16, which matters only when an adapter is served
    with pytest.raises(ValidationError, match=r"exceeds server\.maxLoraRank"):
        spec(trainer={"lora": {"r": 64}}, server={"maxLoraRank": 16})
    assert spec(trainer={"tuning": "full", "lora": {"r": 64}}, server={"maxLoraRank": 16}).trainer.full


@pytest.mark.parametrize(("trainer", "message"), [
    ({"tuning": "full", "lora": {"quantizeBase": True}}, "quantizeBase .* cannot be combined with trainer.tuning full"),
    ({"tuning": "full", "strategy": "fsdp"}, "tuning full with strategy fsdp is not supported"),
    ({"tuning": "partial"}, "tuning"),
    ({"sync": "merged", "lora": {"quantizeBase": True}}, "sync merged merges a LoRA adapter into full-precision"),
    ({"sync": "merged", "strategy": "fsdp"}, "sync merged with strategy fsdp is not supported"),
])
def test_full_tuning_refuses_what_it_cannot_do_naming_the_field(trainer: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(trainer=trainer)


def test_the_server_takes_weights_only_for_full_tuning_in_server_mode_and_auto_follows_where_it_runs() -> None:
    assert resolve_weight_transfer(spec(), "ipc") is None
    assert resolve_weight_transfer(spec(mode="colocate", trainer={"tuning": "full"}), "ipc") is None
    full = spec(trainer={"tuning": "full"})
    assert resolve_weight_transfer(full, None) == "nccl"  # a cluster: server and trainer in separate pods
    assert resolve_weight_transfer(full, "ipc") == "ipc"  # `grpo run`: one GPU
    assert resolve_weight_transfer(spec(trainer={"tuning": "full"}, server={"weightTransfer": "ipc"}), None) == "ipc"
    assert resolve_weight_transfer(spec(trainer={"sync": "merged"}), "ipc") == "ipc"  # merged LoRA pushes too
    with pytest.raises(ValueError, match="GRPO_WEIGHT_TRANSFER='tcp' must be ipc or nccl"):
        resolve_weight_transfer(full, "tcp")
    with pytest.raises(ValidationError, match="weightTransfer"):
        spec(server={"weightTransfer": "tcp"})
