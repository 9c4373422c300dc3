"""The importance-sampling ratio formed in the training forward trains exactly as TRL's separate scoring forward.

Where each batch is trained once in one optimizer step, the old policy's logprobs that TRL computes in a no-grad
forward at scoring time are the training forward's own; the trainer then forms the ratio in that forward and skips
the extra pass (sampler_ratio, trl_overrides.ServerGRPOTrainer). Against a real server (transformers engine, tiny
model), a run each way from the same seed samples the same completions and must log the same ratios and drift and
end with the same adapter, with one policy forward a step instead of two. A stale batch that the drift guard need
not judge (maxDrift 100) makes the ratio differ from 1, so a wrong ratio shows.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.config import ENV_OLD_LOGPS, Savings
from grpo_trainer.errors import InvalidSpec
from grpo_trainer.runner import run_training
from grpo_trainer.sampler_ratio import old_logps_from_training_forward, sampler_ratio
from grpo_trainer.trl_overrides import ServerGRPOTrainer
from tests.fixtures.server import RunningServer
from tests.fixtures.trainer_runs import clear_adapter, token_fraction, trainer_config

STEPS = 3
STEP = re.compile(r"^step (\d+)/\d+ reward (\S+) std \S+ loss (\S+) .* is-ratio (\S+)/(\S+)/(\S+) drift (\S+) ", re.M)


def train(server: RunningServer, model_dir: Path, dataset: Path, work: Path, capsys: pytest.CaptureFixture[str],
          monkeypatch: pytest.MonkeyPatch, *, old_logps: str, importance_sampling: dict[str, object],
          ) -> tuple[list[tuple[float, ...]], dict[str, torch.Tensor], int]:
    """One run of STEPS steps: each step's (reward, loss, ratio min/mean/max, drift), the final adapter's
    tensors, and how many policy forwards it ran."""
    monkeypatch.setenv(ENV_OLD_LOGPS, old_logps)
    monkeypatch.setenv("GRPO_TRAINER_METRICS_PORT", "0")
    forwards = 0
    inner = ServerGRPOTrainer._get_per_token_logps_and_entropies

    def counted(self: ServerGRPOTrainer, *args: object, **kwargs: object) -> object:
        nonlocal forwards
        forwards += 1
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(ServerGRPOTrainer, "_get_per_token_logps_and_entropies", counted)
    clear_adapter(server)
    cfg, _ = trainer_config(
        server, work, dataset=dataset, rewards=[token_fraction(model_dir)],
        # syncInterval 2: step 2 trains on a batch of the base model (staleness 1), so the sampler's logprobs
        # differ from the policy's and the ratio is measured; maxDrift 100 trains on it (no guard to judge it)
        trainer={"maxSteps": STEPS, "checkpointInterval": STEPS, "learningRate": 0.1, "syncInterval": 2,
                 "importanceSampling": {"maxDrift": 100, **importance_sampling}},
    )
    progress = run_training(cfg, attempt=1)
    out = capsys.readouterr().out
    assert progress.done, out
    steps = [tuple(float(v) for v in row[1:]) for row in STEP.findall(out)]
    assert len(steps) == STEPS, out
    (adapter,) = Path(cfg.paths.checkpoint_dir).glob(f"checkpoint-{STEPS}/adapter_model.safetensors")
    return steps, load_file(adapter), forwards


@pytest.mark.slow
@pytest.mark.parametrize("importance_sampling", [{}, {"level": "sequence", "mode": "truncate", "clipMax": 1.5}],
                         ids=["spec-default", "sequence-truncate"])
def test_the_ratio_from_the_training_forward_trains_as_trls_scoring_forward(
    tiny_server: RunningServer, tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, importance_sampling: dict[str, object],
):
    run = {"server": tiny_server, "model_dir": tiny_model_dir, "dataset": tiny_dataset, "capsys": capsys,
           "monkeypatch": monkeypatch, "importance_sampling": importance_sampling}
    trl_steps, trl_adapter, trl_forwards = train(work=tmp_path / "forward", old_logps="forward", **run)
    ours_steps, ours_adapter, ours_forwards = train(work=tmp_path / "loss", old_logps="loss", **run)
    print(f"\nTRL's scoring forward: {trl_steps}, {trl_forwards} forwards\nfrom the training forward: "
          f"{ours_steps}, {ours_forwards} forwards")
    assert (trl_forwards, ours_forwards) == (2 * STEPS, STEPS)
    assert any(row[2] != 1.0 or row[4] != 1.0 for row in trl_steps), "the ratio must be measured, not all 1"
    for theirs, ours in zip(trl_steps, ours_steps, strict=True):
        assert all(math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-4) for a, b in zip(theirs, ours, strict=True)), \
            (theirs, ours)
    assert trl_adapter.keys() == ours_adapter.keys()
    for name, tensor in trl_adapter.items():
        torch.testing.assert_close(ours_adapter[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_the_saving_applies_only_where_the_scoring_policy_is_the_training_policy():
    same = {"correction": True, "num_iterations": 1, "gradient_accumulation_steps": 4, "steps_per_generation": 4,
            "stale_batches_judged": False, "wanted": True}
    assert old_logps_from_training_forward(**same)
    assert not old_logps_from_training_forward(**{**same, "wanted": False})  # TRL's own pass, asked for
    assert not old_logps_from_training_forward(**{**same, "correction": False})  # no ratio to form
    assert not old_logps_from_training_forward(**{**same, "num_iterations": 2})  # a batch trained twice
    assert not old_logps_from_training_forward(**{**same, "gradient_accumulation_steps": 2})  # scored mid-step
    assert not old_logps_from_training_forward(**{**same, "stale_batches_judged": True})  # the drift guard reads them


def test_the_environment_asks_for_trls_scoring_forward_or_is_refused_naming_the_variable():
    assert Savings.from_environment({}).ratio_in_loss
    assert Savings.from_environment({ENV_OLD_LOGPS: "loss"}).ratio_in_loss
    assert Savings.from_environment({ENV_OLD_LOGPS: ""}).ratio_in_loss
    assert not Savings.from_environment({ENV_OLD_LOGPS: "forward"}).ratio_in_loss
    assert not Savings.from_environment({ENV_OLD_LOGPS: " Forward\n"}).ratio_in_loss
    for bad in ("skip", "x" * 100_000):
        with pytest.raises(InvalidSpec, match=ENV_OLD_LOGPS) as refused:
            Savings.from_environment({ENV_OLD_LOGPS: bad})
        assert len(str(refused.value)) < 200  # a huge value is not copied into the run's termination message


def test_the_ratio_clips_or_masks_and_counts_an_unscored_token_as_one():
    policy = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampled = torch.tensor([[-2.0, -1.0, float("nan")], [0.0, -1.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    e2 = math.exp(2.0)
    truncated = sampler_ratio(policy, sampled, mask, mode="token_truncate", clip_min=None, clip_max=3.0)
    torch.testing.assert_close(truncated, torch.tensor([[3.0, 1.0, 1.0], [math.exp(-1.0), 1.0, 1.0]]))
    masked = sampler_ratio(policy, sampled, mask, mode="token_mask", clip_min=0.5, clip_max=3.0)
    torch.testing.assert_close(masked, torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    per_sequence = sampler_ratio(policy, sampled, mask, mode="sequence_truncate", clip_min=None, clip_max=10.0)
    torch.testing.assert_close(per_sequence, torch.tensor([[e2], [math.exp(-1.0)]]))
    with pytest.raises(ValueError, match="token_truncate"):
        sampler_ratio(policy, sampled, mask, mode="token", clip_min=None, clip_max=3.0)
