"""Metric names, the spec -> TRL mapping, and the settings the trainer refuses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from trl import GRPOConfig

from grpo_api.models import GRPORunSpec
from grpo_trainer.config import (
    MLFLOW_CLIENT_LIMITS,
    Platform,
    check_supported,
    grpo_config_kwargs,
    lora_config_kwargs,
    tracker_environment,
)
from grpo_trainer.errors import UnsupportedSetting
from grpo_trainer.metrics import METRIC_NAMES, TrainerMetrics, metrics_port

CPU = Platform(cuda=False, bf16=False, vllm=False, bitsandbytes=False)
GPU = Platform(cuda=True, bf16=True, vllm=False, bitsandbytes=False)


def spec(**trainer) -> GRPORunSpec:
    return GRPORunSpec.model_validate({
        "model": {"name": "m", "path": "/m"},
        "dataset": {"path": "d.jsonl"},
        "rewards": [{"function": "exact_match"}],
        "trainer": trainer,
    })


def test_every_exported_metric_family_is_listed_in_metric_names():
    metrics = TrainerMetrics()
    metrics.observe_trl_logs({"reward": 0.5, "rewards/exact_match/mean": 0.5, "clip_ratio/low_mean": 0.0,
                              "sampling/importance_sampling_ratio/max": 1.2, "kl": float("nan")})
    metrics.sync_failures.labels("unreachable").inc()
    metrics.discarded_batches.labels("stale_adapter").inc()
    text = generate_latest(metrics.registry).decode()
    exposed = {f"{m.name}_total" if m.type == "counter" else m.name for m in metrics.registry.collect()}
    assert exposed == set(METRIC_NAMES)
    assert len(METRIC_NAMES) == len(set(METRIC_NAMES))
    assert 'grpo_trainer_reward_function_mean{function="exact_match"} 0.5' in text
    assert 'grpo_trainer_importance_sampling_ratio{stat="max"} 1.2' in text


def test_metrics_port_env_overrides_the_spec(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRPO_TRAINER_METRICS_PORT", "0")
    assert metrics_port(9400) == 0
    monkeypatch.delenv("GRPO_TRAINER_METRICS_PORT")
    assert metrics_port(9400) == 9400


def test_spec_maps_onto_a_grpo_config_trl_accepts():
    s = spec(importanceSampling={"level": "sequence", "mode": "truncate", "clipMax": 2.0},
             offPolicyMaskThreshold=0.5, lossType="grpo", ratioLevel="sequence", beta=0.04, topK=-1,
             checkpointInterval=5)
    kwargs = grpo_config_kwargs(s, output_dir="/tmp/ck", server_url="http://s:8000", reward_weights=[1.0],
                                platform=CPU)
    config = GRPOConfig(**kwargs)
    assert config.vllm_importance_sampling_mode == "sequence_truncate"
    assert config.vllm_importance_sampling_clip_max == 2.0
    assert config.off_policy_mask_threshold == 0.5
    assert (config.loss_type, config.importance_sampling_level, config.beta) == ("grpo", "sequence", 0.04)
    assert (config.use_vllm, config.vllm_mode, config.top_k) == (True, "server", 0)
    assert (config.bf16, config.use_cpu, config.save_steps, config.logging_steps) == (False, True, 5, 1)
    assert lora_config_kwargs(s.trainer.lora)["target_modules"] == "all-linear"


def test_structured_outputs_reach_trl_as_generation_kwargs():
    plain = grpo_config_kwargs(spec(), output_dir="/tmp/ck", server_url="http://s:8000", reward_weights=[1.0],
                               platform=CPU)
    assert "generation_kwargs" not in plain
    s = spec(structuredOutputs={"choice": ["yes", "no"]})
    config = GRPOConfig(**grpo_config_kwargs(s, output_dir="/tmp/ck", server_url="http://s:8000",
                                             reward_weights=[1.0], platform=CPU))
    assert config.generation_kwargs == {"structured_outputs": {"choice": ["yes", "no"]}}


def test_fsdp_is_fsdp2_through_accelerate_with_activation_checkpointing_for_gradient_checkpointing():
    ddp = grpo_config_kwargs(spec(gradientCheckpointing=True), output_dir="/tmp/ck", server_url="http://s:8000",
                             reward_weights=[1.0], platform=GPU)
    assert "fsdp" not in ddp and ddp["gradient_checkpointing"] is True
    kwargs = grpo_config_kwargs(spec(strategy="fsdp", gradientCheckpointing=True), output_dir="/tmp/ck",
                                server_url="http://s:8000", reward_weights=[1.0], platform=GPU)
    assert kwargs["fsdp"] is True and kwargs["gradient_checkpointing"] is False
    assert kwargs["fsdp_config"] == {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                     "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT",
                                     "activation_checkpointing": True}
    # transformers turns it into Accelerate's FSDP plugin arguments (the plugin is built with the trainer)
    config = GRPOConfig(**{**kwargs, "use_cpu": True, "bf16": False})
    assert config.fsdp_plugin_args is not None
    assert config.fsdp_plugin_args["fsdp_version"] == 2 and config.fsdp_plugin_args["activation_checkpointing"]
    with pytest.raises(UnsupportedSetting, match=r"spec.trainer.strategy fsdp .* use strategy ddp"):
        check_supported(spec(strategy="fsdp"), CPU)
    check_supported(spec(strategy="fsdp"), GPU)


def test_colocate_without_gpu_and_qlora_without_bitsandbytes_are_refused_clearly():
    colocate = GRPORunSpec.model_validate({**spec().model_dump(by_alias=True, exclude={"server"}),
                                           "mode": "colocate", "server": None})
    with pytest.raises(UnsupportedSetting, match=r"spec.trainer.image: spec.mode colocate .* has no vLLM"):
        check_supported(colocate, CPU)
    with pytest.raises(UnsupportedSetting, match=r"spec.mode colocate .* needs a CUDA GPU"):
        check_supported(colocate, Platform(cuda=False, bf16=False, vllm=True, bitsandbytes=False))
    with pytest.raises(UnsupportedSetting, match="quantizeBase"):
        check_supported(spec(lora={"quantizeBase": True}), CPU)
    check_supported(spec(), CPU)


def test_report_to_reaches_trl_and_a_tracker_the_image_lacks_is_refused_naming_the_field():
    kwargs = grpo_config_kwargs(spec(reportTo=["tensorboard", "mlflow"]), output_dir="/tmp/ck",
                                server_url="http://s:8000", reward_weights=[1.0], platform=CPU)
    assert GRPOConfig(**kwargs).report_to == ["tensorboard", "mlflow"]
    plain = grpo_config_kwargs(spec(), output_dir="/tmp/ck", server_url="http://s:8000", reward_weights=[1.0],
                               platform=CPU)
    assert GRPOConfig(**plain).report_to == []
    with pytest.raises(UnsupportedSetting, match=r"spec.trainer.reportTo names trackio, .*trackio needs trackio"):
        check_supported(spec(reportTo=["mlflow", "trackio"]), Platform(cuda=False, bf16=False, vllm=False,
                                                                       bitsandbytes=False,
                                                                       trackers=frozenset({"mlflow"})))


def test_with_the_trainers_mlflow_limits_a_tracking_server_that_is_gone_fails_a_request_in_seconds():
    """MLflow's own limits retry one request for ~4 minutes (the run looked hung after its last step when the
    tracking server had gone); the trainer's defaults, set unless the spec's env sets them, fail it in seconds."""
    assert tracker_environment(spec()) == {"DISABLE_MLFLOW_INTEGRATION": "TRUE"}  # TRL then skips importing mlflow
    limits = tracker_environment(spec(reportTo=["tensorboard", "mlflow"]))
    assert limits == MLFLOW_CLIENT_LIMITS
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (f"import time, mlflow\nmlflow.set_tracking_uri('http://127.0.0.1:{port}')\nt = time.monotonic()\n"
            "try:\n    mlflow.MlflowClient().get_experiment_by_name('grpo')\n"
            "except Exception as exc:\n    print('failed', type(exc).__name__, time.monotonic() - t)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, **limits}, capture_output=True, text=True,
                          timeout=120)
    words = proc.stdout.split()
    assert words[:1] == ["failed"], proc.stdout + proc.stderr[-2000:]
    assert 1 < float(words[2]) < 30, proc.stdout  # it did retry, and gave up within seconds

def test_this_image_has_the_packages_of_every_tracker_but_trackio():
    """The trainer extra installs tensorboardX, the MLflow client and W&B; trackio only in an image that adds it."""
    from grpo_trainer.image_capabilities import available_trackers, check_trainer_image

    assert {"tensorboard", "mlflow", "wandb"} <= available_trackers()
    check_trainer_image(spec(reportTo=["tensorboard", "mlflow", "wandb"]), "ipc")
    if "trackio" not in available_trackers():
        with pytest.raises(UnsupportedSetting, match=r"spec\.trainer\.reportTo names trackio"):
            check_trainer_image(spec(reportTo=["trackio"]), "ipc")


def full_spec(server: dict | None = None, **trainer) -> GRPORunSpec:
    return GRPORunSpec.model_validate({**spec(**trainer).model_dump(by_alias=True, exclude={"server"}),
                                       "server": server or {}})


@pytest.mark.parametrize(("run", "auto", "needs"), [
    (full_spec(tuning="full"), None, True),  # a cluster: auto is nccl, and the default server asks for a GPU
    (full_spec(tuning="full"), "ipc", False),  # `grpo run`: one GPU, CUDA IPC needs no vLLM in the trainer
    (full_spec(sync="merged"), None, True),
    (full_spec({"weightTransfer": "ipc"}, tuning="full"), None, False),
    (full_spec({"engine": "transformers"}, tuning="full"), None, False),  # the transformers engine takes gloo
    (full_spec({"resources": {"limits": {"cpu": "2"}}}, tuning="full"), None, False),  # auto without a GPU
    (full_spec({"engine": "vllm", "resources": {"limits": {"cpu": "2"}}}, tuning="full"), None, True),
    (full_spec({"weightTransfer": "nccl"}, tuning="full"), "ipc", True),
    (full_spec(), None, False),  # LoRA adapters travel as files
])
def test_which_runs_need_vllm_in_the_trainer_image(run: GRPORunSpec, auto: str | None, needs: bool):
    from grpo_api.weight_transfer import resolve_weight_transfer
    from grpo_trainer.config import vllm_needed_for

    reason = vllm_needed_for(run, resolve_weight_transfer(run, auto))
    assert (reason is not None) == needs, reason
    if needs:
        with pytest.raises(UnsupportedSetting, match=r"^spec.trainer.image: spec.trainer.(tuning full|sync merged) "
                                                     r"sends the weights .* over nccl .* has no vLLM"):
            check_supported(run, GPU, resolve_weight_transfer(run, auto))
    else:
        check_supported(run, GPU, resolve_weight_transfer(run, auto))


def test_the_image_check_imports_vllm_as_the_trainer_would(monkeypatch: pytest.MonkeyPatch):
    """This environment has no vLLM (the dev extra leaves it out): the initializer's check refuses a run that
    needs it, names the field and the import that failed, and lets every other run through."""
    import importlib.util

    from grpo_trainer.image_capabilities import check_trainer_image

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the refusal cannot be seen")
    monkeypatch.delenv("GRPO_WEIGHT_TRANSFER", raising=False)
    with pytest.raises(UnsupportedSetting) as refused:
        check_trainer_image(full_spec(tuning="full"))
    message = str(refused.value)
    assert message.startswith("spec.trainer.image: spec.trainer.tuning full sends the weights"), message
    assert "import vllm.distributed.weight_transfer.nccl_engine: ModuleNotFoundError" in message, message
    assert "ENGINE=vllm" in message and "spec.server.weightTransfer ipc" in message, message
    check_trainer_image(full_spec(tuning="full"), "ipc")
    monkeypatch.setenv("GRPO_WEIGHT_TRANSFER", "ipc")
    check_trainer_image(full_spec(tuning="full"))
    check_trainer_image(full_spec())


def test_the_trackers_env_defaults_leave_a_set_value_alone_and_are_gone_after_training(monkeypatch):
    """A process that trains twice (the trainer tests run it in-process, and the local runner's processes inherit
    their environment) must not keep one run's defaults: DISABLE_MLFLOW_INTEGRATION left behind failed a later
    run that reports to MLflow (CI, 2026-12-06)."""
    from grpo_trainer.runner import _environment_defaults

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")  # as spec.trainer.env would set it
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)
    with _environment_defaults(tracker_environment(spec(reportTo=["mlflow"]))):
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5" and os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"
    with _environment_defaults(tracker_environment(spec())):
        assert os.environ["DISABLE_MLFLOW_INTEGRATION"] == "TRUE"
    assert "DISABLE_MLFLOW_INTEGRATION" not in os.environ
