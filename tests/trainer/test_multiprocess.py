"""Several trainer processes (torchrun, DDP over gloo on CPU) against a real server process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from grpo_api.models import TrainerSpec
from grpo_api.runconfig import ServerEndpoints
from grpo_trainer.errors import InvalidSpec
from grpo_trainer.launch import attempt_exit_code, check_gpus, left_codes, torchrun_argv, world_size
from tests.fixtures.server import RunningServer, free_port, start_server
from tests.fixtures.trainer_runs import (
    PUBLISH_LINE,
    STEP_LINE,
    cli_env,
    grpo_train,
    next_attempt,
    token_fraction,
    trainer_config,
)


def test_torchrun_runs_every_process_here_without_a_rendezvous_address_and_one_pod_s_share_with_one():
    trainer = TrainerSpec.model_validate({"numNodes": 3, "numProcPerNode": 2})
    assert world_size(trainer) == 6
    local = torchrun_argv(trainer, "/run/config.yaml", {"GRPO_MASTER_PORT": "29511"})
    assert local[1:3] == ["-m", "grpo_trainer.launch"]  # torch.distributed.run, tied to the launcher first
    assert {"--nnodes=1", "--nproc-per-node=6", "--node-rank=0", "--master-addr=127.0.0.1",
            "--master-port=29511"} <= set(local)
    assert local[-4:] == ["grpo_cli.main", "train", "--config", "/run/config.yaml"]
    pod = torchrun_argv(trainer, None, {"GRPO_MASTER_ADDR": "r-trainer-1-0.r-trainer", "GRPO_MASTER_PORT": "29500",
                                        "JOB_COMPLETION_INDEX": "2"})
    assert {"--nnodes=3", "--nproc-per-node=2", "--node-rank=2", "--master-addr=r-trainer-1-0.r-trainer",
            "--master-port=29500"} <= set(pod)
    assert pod[-2:] == ["grpo_cli.main", "train"]
    for bad in ({"GRPO_MASTER_PORT": "29500; rm -rf /"}, {"GRPO_MASTER_PORT": "70000"}, {"JOB_COMPLETION_INDEX": "3"}):
        with pytest.raises(InvalidSpec, match=next(iter(bad))):
            torchrun_argv(trainer, None, {"GRPO_MASTER_ADDR": "r-trainer-1-0.r-trainer", **bad})


def test_on_a_gpu_machine_every_process_needs_a_gpu_of_its_own_and_the_refusal_names_the_fields():
    """NCCL refuses two ranks on one GPU, and a rank past the last GPU fails with an invalid device ordinal:
    the launcher refuses first (a configuration problem, no retry). Without GPUs, gloo takes any number."""
    trainer = TrainerSpec.model_validate({"numNodes": 2, "numProcPerNode": 4})
    pod = {"GRPO_MASTER_ADDR": "r-trainer-1-0.r-trainer"}
    check_gpus(trainer, pod, 4)
    check_gpus(trainer, pod, 8)
    check_gpus(trainer, pod, 0)
    with pytest.raises(InvalidSpec, match=r"trainer.numProcPerNode: 4 processes .* sees 3: set "
                                          r"trainer.resources.limits \(nvidia.com/gpu: 4\)"):
        check_gpus(trainer, pod, 3)
    check_gpus(trainer, {}, 8)  # `grpo run`: all 2 × 4 on this machine
    check_gpus(trainer, {}, 0)
    with pytest.raises(InvalidSpec, match=r"trainer.numNodes × trainer.numProcPerNode: `grpo run` starts 8 .* has 4"):
        check_gpus(trainer, {}, 4)


def test_the_attempt_ends_with_rank_0_s_code_else_the_lowest_failing_rank_s_else_torchrun_s(tmp_path: Path):
    """A problem every rank finds may end rank 1 first; torchrun then stops rank 0 before it leaves a code."""
    (tmp_path / "rank-1").write_text("2")
    (tmp_path / "rank-3").write_text("4\n")
    (tmp_path / "rank-2").write_text("")  # stopped while writing
    (tmp_path / "rank-x").write_text("9")
    assert left_codes(tmp_path) == {1: 2, 3: 4}
    assert attempt_exit_code(left_codes(tmp_path), 1) == 2
    assert attempt_exit_code({0: 0, 1: 2}, 1) == 0
    assert attempt_exit_code({0: 3, 1: 2}, 1) == 3
    assert attempt_exit_code({2: 0, 3: 0}, 0) == 0
    assert attempt_exit_code({}, 1) == 1


@pytest.mark.slow
def test_two_processes_train_with_rank_0_alone_publishing_checkpoint_and_resume(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
):
    """Two trainer processes on two server replicas: every version is published once (by rank 0) and reaches
    both replicas; checkpoints hold both ranks' state; a second attempt resumes from them."""
    work = tmp_path / "server"
    servers: list[RunningServer] = [start_server(work, tiny_model_dir),
                                    start_server(work, tiny_model_dir, port=free_port())]
    try:
        trainer = {"numProcPerNode": 2, "perDeviceBatchSize": 4, "numGenerations": 4, "maxCompletionLength": 8,
                   "maxSteps": 4, "syncInterval": 1, "checkpointInterval": 2, "seed": 0}
        cfg, path = trainer_config(servers[0], tmp_path / "run", dataset=tiny_dataset,
                                   rewards=[token_fraction(tiny_model_dir)], trainer=trainer)
        cfg = cfg.model_copy(update={"server_endpoints": ServerEndpoints(
            replicas=2, urls=[s.url for s in servers])})
        path.write_text(cfg.to_yaml())

        first = subprocess.run(grpo_train(path), env=cli_env(GRPO_ATTEMPT="1"), capture_output=True, text=True,
                               timeout=600)
        out = first.stdout + first.stderr
        assert first.returncode == 0, out[-4000:]
        assert "grpo train: 2 processes (1 node(s) × 2)" in out
        published = [int(v) for v, _, _, _ in PUBLISH_LINE.findall(out)]
        assert published == [1, 2, 3, 4], out[-3000:]  # once per step: rank 0 alone publishes
        assert [int(s) for s, _, _ in STEP_LINE.findall(out)] == [1, 2, 3, 4]  # rank 0 alone logs
        for server in servers:
            assert server.health()["adapter"]["version"] == 4
        checkpoints = tmp_path / "run" / "checkpoints"
        for step in (2, 4):
            files = {p.name for p in (checkpoints / f"checkpoint-{step}").iterdir()}
            assert {"rng_state_0.pth", "rng_state_1.pth"} <= files, files
        progress = json.loads((tmp_path / "run" / "progress.json").read_text())
        assert (progress["step"], progress["done"]) == (4, True)

        # The next attempt (the same servers, now serving v4) resumes from checkpoint-4 and goes on to 6.
        out2 = next_attempt(cfg, path, max_steps=6, attempt=2)
        assert "resuming from" in out2 and "checkpoint-4" in out2
        assert [int(s) for s, _, _ in STEP_LINE.findall(out2)] == [5, 6]
        assert json.loads((tmp_path / "run" / "progress.json").read_text())["step"] == 6
        for server in servers:
            assert httpx.get(f"{server.url}/health/", timeout=10).json()["adapter"]["version"] >= 6
    finally:
        for server in servers:
            server.stop(timeout=10)


@pytest.mark.slow
def test_a_configuration_problem_on_rank_0_keeps_its_exit_code_through_torchrun(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path,
):
    server = start_server(tmp_path / "server", tiny_model_dir)
    try:
        _, path = trainer_config(server, tmp_path / "run", dataset=tiny_dataset,
                                 rewards=[{"function": "no_such_module:reward"}],
                                 trainer={"numProcPerNode": 2, "maxSteps": 2})
        done = subprocess.run(grpo_train(path), env=cli_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (done.returncode, (done.stdout + done.stderr)[-3000:])
        assert "no_such_module" in done.stderr
    finally:
        server.stop(timeout=10)


def test_as_a_container_s_pid_1_the_single_process_trainer_ends_on_sigterm_with_143_elsewhere_nothing_changes():
    """`grpo train` is the trainer image's entrypoint, so PID 1, where a SIGTERM without a handler is dropped:
    an evicted trainer trained on until the grace period's SIGKILL (and a short run finished). The handler is set
    only there; this plays PID 1 by naming the pid."""
    import signal
    import sys

    program = ("import sys, time\nfrom grpo_trainer.launch import end_on_sigterm\n"
               "print(end_on_sigterm(pid=int(sys.argv[1])), flush=True)\ntime.sleep(60)\n")
    for pid, handled, code in ((1, "True", 143), (12345, "False", -signal.SIGTERM)):
        proc = subprocess.Popen([sys.executable, "-c", program, str(pid)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == handled
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == code
        finally:
            proc.kill()
            proc.wait()
