"""Several server replicas used as one: real server processes (transformers engine, tiny model) on CPU."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from grpo_api.runconfig import ServerEndpoints, load_run_config
from grpo_trainer.runner import run_training
from grpo_trainer.transport.dispatch import group_seed, split_groups
from grpo_trainer.transport.replica_set import dns_discovery, static_discovery
from grpo_trainer.transport.server_client import BACKOFF_CAP_SECONDS
from tests.fixtures.server import RunningServer, free_port, start_server
from tests.fixtures.server_requests import completion_requests
from tests.fixtures.trainer_runs import STEP_LINE, read_progress, token_fraction, trainer_config
from tests.fixtures.waiting import wait_for


def test_prompt_groups_are_contiguous_balanced_and_never_empty():
    assert split_groups(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_groups(2, 4) == [range(0, 1), range(1, 2)]  # more replicas than prompts: no empty group
    assert split_groups(5, 1) == [range(0, 5)]
    groups = split_groups(10, 4)
    assert [i for g in groups for i in g] == list(range(10)) and {len(g) for g in groups} == {2, 3}


def test_the_first_group_keeps_the_seed_and_the_others_get_their_own():
    assert group_seed({"seed": 5, "temperature": 1.0}, 0) == {"seed": 5, "temperature": 1.0}
    seeds = {group_seed({"seed": 5}, g)["seed"] for g in range(4)}
    assert len(seeds) == 4 and all(0 <= s < 2**31 for s in seeds)
    assert group_seed({"temperature": 1.0}, 2) == {"temperature": 1.0}


def test_replicas_are_found_by_dns_or_given_as_addresses():
    assert "http://127.0.0.1:8123" in dns_discovery("localhost", 8123)()
    assert dns_discovery("no-such-service.invalid", 80)() == []
    assert static_discovery(["http://a:1/", "http://b:2"])() == ["http://a:1", "http://b:2"]


HOLD_REWARD = """
import time
from pathlib import Path

HOLD = Path(__file__).with_name("hold")
HELD = Path(__file__).with_name("held")


def hold(prompts, completions, **kwargs):
    \"\"\"Reward 0; while the file `hold` exists, training waits here (and says so in `held`).\"\"\"
    while HOLD.exists():
        HELD.touch()
        time.sleep(0.1)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_two_replicas_share_the_work_a_lost_one_is_replaced_by_the_other_and_a_restarted_one_catches_up(
    tiny_model_dir: Path, tiny_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
):
    """The learning check's workload on two replicas: one is killed at step 6 (its work goes to the other,
    or a sync finds it gone first), started again on the same address while training waits at step 10 (a
    new boot: it gets the current adapter before any work), and the run learns as on one server."""
    work = tmp_path / "server"
    a = start_server(work, tiny_model_dir)
    b = start_server(work, tiny_model_dir, port=free_port())  # same volume: both read the adapters published
    volume = Path(load_run_config(a.run_config_path).paths.volume_root)
    (volume / "hold_reward.py").write_text(HOLD_REWARD)  # the volume is on the rewards' import path
    hold, held = volume / "hold", volume / "held"
    restarted: list[RunningServer] = []
    errors: list[BaseException] = []
    try:
        cfg, _ = trainer_config(
            a, tmp_path / "run", dataset=tiny_dataset,
            rewards=[token_fraction(tiny_model_dir), {"function": "hold_reward:hold", "weight": 0.0}],
            trainer={"numGenerations": 8, "perDeviceBatchSize": 32, "maxCompletionLength": 12,
                     "learningRate": 0.03, "lrScheduler": "constant", "maxSteps": 20, "syncInterval": 1,
                     "checkpointInterval": 20, "seed": 0, "generationTimeoutSeconds": 120},
        )
        cfg = cfg.model_copy(update={"server_endpoints": ServerEndpoints(replicas=2, urls=[a.url, b.url])})
        served_by_b: list[float] = []

        def chaos() -> None:
            try:
                wait_for(lambda: Path(cfg.paths.progress_file).is_file() and read_progress(cfg).step >= 6, 400,
                         interval=0.1, what="step 6")
                served_by_b.append(completion_requests(b))
                b.kill()
                wait_for(lambda: read_progress(cfg).step >= 10, 400, interval=0.1, what="step 10")
                hold.touch()
                wait_for(held.exists, 120, interval=0.1, what="training to wait in the reward")
                restarted.append(start_server(work, tiny_model_dir, port=b.port))
                # Catch-ups are tried when a batch asks for ready replicas, no sooner than the backoff the last
                # failed try set (at most BACKOFF_CAP_SECONDS): past it, the first batch after the hold starts
                # one, so the run does not end before the restarted replica was tried again.
                time.sleep(BACKOFF_CAP_SECONDS)
            except BaseException as exc:
                errors.append(exc)
            finally:
                hold.unlink(missing_ok=True)

        thread = threading.Thread(target=chaos, daemon=True)
        thread.start()
        progress = run_training(cfg, attempt=1)
        thread.join(60)
        assert not errors, errors
        out = capsys.readouterr().out
        print("\n" + "\n".join(line for line in out.splitlines()
                               if re.match(r"(server|re-issued|generation group|discarded|adapter v)", line)))

        assert (progress.step, progress.done) == (20, True)
        assert [int(s) for s, _, _ in STEP_LINE.findall(out)] == list(range(1, 21))
        assert served_by_b and served_by_b[0] >= 5, "replica b generated part of every batch before it was killed"
        # The killed replica's group went to the other, or a sync found it gone first and it got no more work.
        assert "re-issued generation group" in out or "missed adapter v" in out, out[-3000:]
        # The restart was seen (by the next load trigger or health check there): same address, new boot id.
        assert re.search(rf"^server restarted: boot id \w+ -> \w+ \({re.escape(b.url)}\)", out, re.M), out[-3000:]
        # Both replicas serve the final policy: the restarted one caught up, and the last sync reached it.
        for server in (a, restarted[0]):
            assert server.health()["adapter"]["version"] == progress.adapter_version
        assert completion_requests(restarted[0]) >= 1  # it got work again after catching up
        rewards = [float(r) for _, _, r in STEP_LINE.findall(out)]
        first5, last5 = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(f"two replicas: first5 {first5:.4f} last5 {last5:.4f}; rewards {[round(r, 3) for r in rewards]}")
        assert last5 / first5 >= 1.5 and last5 - first5 >= 0.1
    finally:
        for server in (a, b, *restarted):
            server.stop(timeout=10)
