"""GRPO step time of TRL 1.16's AsyncGRPOTrainer (LoRA sync) against a generation server on the same GPU.

The baseline for bench/grpo_step.py's server mode: TRL's own asynchronous trainer, unchanged, with its
LoRA-adapter sync (`/pause?mode=keep`, `/v1/load_lora_adapter` of `trl-policy-v<N>`, `/resume`,
`/v1/unload_lora_adapter` past `max_staleness`) and its rollout worker (a spawned process posting
`/v1/completions` by the adapter's name), against either server:

- `--server vllm`: `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs) with
  `--enable-lora --max-lora-rank 32 --max-loras max(4, max_staleness + 2) --gpu-memory-utilization 0.45
  --max-model-len 2048 --dtype bfloat16`, `--logprobs-mode processed_logprobs` (what `trl vllm-serve` sets),
  and the engine settings our vllm engine uses (prefix caching on, `--max-cpu-loras` twice `--max-loras`,
  `--max-logprobs 20`); environment `VLLM_SERVER_DEV_MODE=1` (`/pause`, `/resume`, `/server_info`) and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`/v1/load_lora_adapter`). No `--weight-transfer-config`: with a
  PEFT model and a LoRA-enabled server TRL syncs the adapter as files, no NCCL.
- `--server grpo`: our `grpo serve` with a run-config (vllm engine, the same 0.45 of the GPU, 2048, rank 32,
  `logprobsSource: sampler`, as grpo_step.py's run); the token reaches it through a netrc file, as in
  tests/server/test_trl_async_grpo.py (TRL's `requests` client sends it as Basic auth).

The workload is grpo_step.py's: the model and dataset given, reward `token_fraction` over the completion ids
(share of tokens in `target_token_ids(model)` over the maximum completion length, our built-in itself),
8 generations, 64 completions per optimizer step in one micro-batch (`token_budget=0`: TRL's fixed-count
batcher, 64 samples per step), 64-token completions, LoRA r32 alpha 64 all-linear (no dropout),
learning rate 2e-2 constant (grpo_step.py's learning workload, on which the reward rises), bf16, no gradient
checkpointing, temperature 1, seed 0. Plain-text prompts
reach the server as the same token ids our trainer sends: TRL's rollout worker always renders prompts with
the chat template, so they are wrapped as one user message and rendered by a template that writes the
content alone (a response template that parses the reply as plain content comes with it).

TRL's training forward is tree attention through FlashAttention-3, which TRL fetches from the Hub
(`kernels-community/flash-attn3`; no network there). `--attn auto` (the default) uses vLLM's own FA3
(`vllm.vllm_flash_attn.flash_attn_varlen_func`, `fa_version=3`) for the forward; vLLM builds that kernel
forward-only (its `_vllm_fa3_C` registers `fwd` and no `bwd`), so the backward is PyTorch's built-in
FlashAttention-2 backward (`aten._flash_attention_backward`) from the forward's output and log-sum-exp.
Before training, the pair is checked against plain attention on a small tree-shaped batch; if it raises or
disagrees, `torch.nn.attention.varlen.varlen_attn` (FA2 both ways) is tried, then the per-segment SDPA of
the CPU test. The one used is in the JSON (`attention`). `get_peak_flops_per_device` is stubbed only off
CUDA (a logging figure); `is_vllm_available` is patched only where vLLM is absent (the CPU smoke).

TRL's `max_staleness` is checked when a sample leaves the rollout queue, and accelerate's dispatcher fetches
batch k+1 at the start of step k (its look-ahead): a batch trains up to max_staleness + 1 adapter versions
behind the trainer, where our prefetchDepth d trains at most d behind (so `--max-staleness 1` is the bound of
our prefetchDepth 2; 2, the default, is the same number). Generation is not held to it: max(max_staleness, 1)
x batch requests stay in flight and samples past the bound are dropped (`dropped_stale` in the JSON).

Per optimizer step it records the wall-clock time at the end of the step (a TrainerCallback added after
TRL's own, so after that step's adapter sync) and the logged metrics (reward mean, TRL's perf/* figures),
and writes grpo_step.py's per-run keys under `runs.trl_async` of `--out`: `step_s` are the gaps between
consecutive step ends, `step_s_median`/`step_s_mean` are over the gaps after the first, and
`step_s_steady_mean` over the gaps from index max(max_staleness, 1) on. Beside the JSON: the server's log
tail (`<out stem>_server.log`), the trainer's log (`<out stem>_trainer.log`) and the per-step events
(`<out stem>_steps.jsonl`). The server runs in its own process group and is always killed at exit;
`--timeout` bounds the whole run.

On the GPU machine (after `prep`; see bench/gpu/session.sh):
    SERVER=vllm bash bench/gpu/session.sh trl-async      # STEPS=20 STALENESS=2 by default
    SERVER=grpo bash bench/gpu/session.sh trl-async
i.e. python bench/trl_async.py --server vllm --model /tmp/m15 --dataset /tmp/m15-prompts.jsonl \\
        --steps 20 --max-staleness 2 --out $OUT/trl_async_vllm.json

CPU smoke of the plumbing (tiny model, transformers engine, per-segment SDPA attention):
    python bench/trl_async.py --server grpo --device cpu --model TINY --dataset PROMPTS --steps 2 \\
        --completion-length 16 --out /tmp/trl-async-smoke/trl_async_grpo.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import BATCH, COMPLETION_LENGTH, LEARNING_RATE, STEPS, reward_summary
from workload import dump, machine

from grpo_testmodels.varlen_attention import segment_attention

#: Renders a conversation as its messages' content alone: a plain-text prompt wrapped as one user message
#: becomes exactly the prompt's own token ids (what our trainer and TRL's GRPOTrainer send for plain text).
CONTENT_ONLY_CHAT_TEMPLATE = "{%- for message in messages %}{{- message['content'] }}{%- endfor %}"
#: transformers' response template for that chat template: the reply is plain content up to <|im_end|> (no
#: tool calls, so TRL's rollout stays single-turn); without one TRL refuses an unknown chat template.
CONTENT_ONLY_RESPONSE_TEMPLATE = {
    "start_anchor_pattern": r"\Z",
    "defaults": {"role": "assistant"},
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}
#: vLLM's smallest `max_loras` TRL accepts is max_staleness + 2 (it loads version N+1 before unloading the
#: version that fell out of the window); our spec's default is 4.
MIN_MAX_LORAS = 4
MAX_LOGPROBS = 20  # grpo_server.sampling.MAX_LOGPROBS, the engine setting our vllm engine uses
LORA = {"r": 32, "alpha": 64}
SERVER_LOG_LINES = 300
TRAINER_LOG_LINES = 3000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def max_loras_for(staleness: int) -> int:
    return max(MIN_MAX_LORAS, staleness + 2)


# ---------------------------------------------------------------------------------------------------------
# Orchestrator: server up, trainer child, server down, summary.
# ---------------------------------------------------------------------------------------------------------


class Server:
    """A server subprocess in its own process group (killed as a group), logging to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, health_url: str) -> None:
        self.argv, self.log_path, self.health_url = argv, log_path, health_url
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET health answered 200; raises with the log tail if the process exits or time runs out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} before it was healthy "
                                   f"({' '.join(self.argv)}); log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the server was not healthy at {self.health_url} after {timeout:.0f}s; "
                           f"log tail:\n{self.log_tail()}")

    def stop(self, grace: float = 20) -> None:
        stop_group(self.proc, grace)
        self._log.close()


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` seconds (the group also when the leader is gone)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    # vLLM's engine core and TRL's rollout worker are children in the same group: kill what is left
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def vllm_server(args: argparse.Namespace, work: Path, port: int) -> Server:
    max_loras = max_loras_for(args.max_staleness)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-lora", "--max-lora-rank", str(LORA["r"]), "--max-loras", str(max_loras),
        "--max-cpu-loras", str(2 * max_loras),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len),
        "--dtype", "bfloat16", "--enable-prefix-caching",
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(MAX_LOGPROBS),
        *args.vllm_arg,
    ]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return Server(argv, env, work / "server.log", f"http://127.0.0.1:{port}/health")


def grpo_server(args: argparse.Namespace, work: Path, port: int) -> tuple[Server, Path, str]:
    """`grpo serve` with a run-config; returns the server, its adapter root (TRL's output dir goes inside,
    the server loads adapters only from there) and the token."""
    from grpo_api.models import GRPORun
    from grpo_api.runconfig import RUN_CONFIG_FILE, run_config_for
    from grpo_testmodels import target_token_ids

    lo, hi = target_token_ids(args.model)
    token = os.urandom(24).hex()
    token_file = work / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    server: dict[str, Any] = {"port": port, "maxLoras": max_loras_for(args.max_staleness),
                              "maxLoraRank": LORA["r"], "logprobsSource": "sampler"}
    if args.device == "cuda":
        server.update({"engine": "vllm", "gpuMemoryUtilization": args.gpu_memory_utilization,
                       "maxModelLen": args.max_model_len, "dtype": "bfloat16"})
    else:
        server.update({"engine": "transformers"})
    run = GRPORun.model_validate({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPORun", "metadata": {"name": "trl-async"},
        "spec": {
            "model": {"name": "bench-trl-async", "path": str(args.model),
                      "dtype": "bfloat16" if args.device == "cuda" else "float32"},
            "dataset": {"path": str(args.dataset)},
            "rewards": [{"function": "token_fraction", "args": {"low": lo, "high": hi}}],
            "server": server,
            "trainer": {"lora": {"r": LORA["r"], "alpha": LORA["alpha"], "targetModules": ["all-linear"]},
                        "numGenerations": args.num_generations, "perDeviceBatchSize": args.batch,
                        "maxCompletionLength": args.completion_length, "learningRate": args.learning_rate,
                        "maxSteps": args.steps, "seed": 0},
        },
    })
    config = run_config_for(run, volume_root=work / "volume", server_url=f"http://127.0.0.1:{port}",
                            token_file=str(token_file), base_dir=work)
    adapter_root = Path(config.paths.adapter_root)
    adapter_root.mkdir(parents=True, exist_ok=True)
    config_path = work / RUN_CONFIG_FILE
    config_path.write_text(config.to_yaml())
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("GRPO_TOKEN", None)
    env.pop("GRPO_TOKEN_FILE", None)
    argv = [sys.executable, "-m", "grpo_cli.main", "serve", "--config", str(config_path),
            "--host", "127.0.0.1", "--port", str(port)]
    return Server(argv, env, work / "server.log", f"http://127.0.0.1:{port}/health/"), adapter_root, token


def missing_modules(args: argparse.Namespace) -> list[str]:
    needed = ["torch", "transformers", "peft", "datasets", "trl", "aiohttp", "requests", "accelerate"]
    if args.server == "vllm" or args.device == "cuda":
        needed.append("vllm")
    if args.server == "grpo":
        needed += ["grpo_cli", "grpo_server"]
    return [name for name in needed if importlib.util.find_spec(name) is None]


def tail_lines(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return ""


def read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


def finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def summarize(events: list[dict[str, Any]], staleness: int) -> dict[str, Any]:
    """grpo_step.py's per-run figures from the trainer's step events."""
    ends: dict[int, float] = {}
    logs: dict[int, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    for event in events:
        if event["event"] == "step_end":
            ends[event["step"]] = event["t"]
        elif event["event"] == "log" and ("loss" in event["logs"] or "reward" in event["logs"]):
            logs[event["step"]] = event["logs"]
        elif event["event"] in ("train_begin", "attention", "trainer_ready"):
            extra[event["event"]] = event
    steps = sorted(ends)
    times = [ends[s] for s in steps]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    timed = gaps[1:] or gaps  # the first gap pays for warm-up, when there are others (as grpo_step.py)
    steady = gaps[max(staleness, 1):]

    def series(key: str) -> list[float | None]:
        return [finite(logs.get(s, {}).get(key)) for s in steps]

    rewards = series("reward")
    begin = extra.get("train_begin", {}).get("t")
    return {
        "steps_logged": len(steps),
        "step_s_median": statistics.median(timed) if timed else None,
        "step_s_mean": statistics.fmean(timed) if timed else None,
        # steps past the staleness window: from there a batch may come from a trained adapter (TRL only
        # bounds the lag by max_staleness; it does not hold it there)
        "step_s_steady_mean": statistics.fmean(steady) if steady else None,
        "step_s": gaps,
        "reward": rewards,
        "reward_summary": reward_summary(rewards),
        "sync_s": series("perf/weight_sync_s"),
        "first_step_s": (times[0] - begin) if times and begin else None,
        "trl_step_s": series("perf/step_s"),
        "rollout_wait_s": series("perf/rollout_wait_s"),
        "fwd_bwd_s": series("perf/fwd_bwd_s"),
        "optimizer_s": series("perf/optimizer_s"),
        "entropy": series("entropy"),
        "clip_ratio_region": series("clip_ratio/region_mean"),
        "staleness_mean": series("sample/staleness_mean"),
        "staleness_max": series("sample/staleness_max"),
        "dropped_stale": series("sample/dropped_stale_total"),
        "samples_per_step": series("batch/samples_per_step"),
        "completion_length_mean": series("completions/mean_length"),
        "generated_tok_s": series("rollout/generated_tok_s"),
        "attention": extra.get("attention", {}).get("impl"),
        "attention_checks": extra.get("attention", {}).get("checks"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", choices=["vllm", "grpo"], default="vllm",
                        help="vllm: `vllm serve` (vllm.entrypoints.openai.api_server); grpo: our `grpo serve`")
    parser.add_argument("--model", type=Path, default=Path("/tmp/m15"))
    parser.add_argument("--dataset", type=Path, default=Path("/tmp/m15-prompts.jsonl"))
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (max_steps)")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="AsyncGRPOConfig.max_staleness (2 matches our prefetchDepth 2 run); the servers get "
                        "max-loras max(4, max_staleness + 2)")
    parser.add_argument("--completion-length", type=int, default=COMPLETION_LENGTH, help="max_completion_length")
    parser.add_argument("--batch", type=int, default=BATCH, help="completions per optimizer step (one micro-batch)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--attn", choices=["auto", "vllm-fa3", "torch-fa2", "sdpa"], default="auto",
                        help="tree attention kernel (see above); auto: vllm-fa3, else torch-fa2, else sdpa "
                        "(sdpa on CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the plumbing smoke (transformers engine under grpo serve, float32, SDPA)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `vllm serve` (repeatable, e.g. --vllm-arg=--enforce-eager)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds for the whole run (server start included)")
    parser.add_argument("--server-timeout", type=float, default=400, help="seconds to wait for the server's health")
    parser.add_argument("--work", type=Path, default=None, help="work dir (default /tmp/trl-async-<server>); emptied")
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/trl_async_<server>.json)")
    parser.add_argument("--train-config", type=Path, default=None, help=argparse.SUPPRESS)  # the trainer child
    args = parser.parse_args()
    if args.train_config is not None:
        train(json.loads(args.train_config.read_text()))
        return

    t_start = time.monotonic()
    deadline = t_start + args.timeout
    args.model, args.dataset = args.model.resolve(), args.dataset.resolve()
    out = Path(args.out or os.path.join(os.environ.get("OUT", "/tmp/out"), f"trl_async_{args.server}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    work = (args.work or Path(f"/tmp/trl-async-{args.server}")).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    steps_path = work / "steps.jsonl"
    trainer_log = work / "trainer.log"

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # run the finally below (server and trainer groups killed)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    run: dict[str, Any] = {"exit_code": None, "wall_s": None, "server": args.server, "error": None}
    server: Server | None = None
    trainer: subprocess.Popen[bytes] | None = None
    try:
        if missing := missing_modules(args):
            raise RuntimeError(f"not importable here: {', '.join(missing)} (PYTHONPATH={os.environ.get('PYTHONPATH')})")
        if not args.model.is_dir() or not args.dataset.is_file():
            raise RuntimeError(f"model {args.model} or dataset {args.dataset} missing (run the prep phase)")
        port = free_port()
        trainer_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        output_dir = work / "trl"
        if args.server == "vllm":
            server = vllm_server(args, work, port)
        else:
            server, adapter_root, token = grpo_server(args, work, port)
            output_dir = adapter_root / "trl"  # the adapters TRL publishes must be inside the server's root
            netrc = work / "netrc"
            netrc.write_text(f"machine 127.0.0.1 login grpo password {token}\n")
            netrc.chmod(0o600)
            trainer_env["NETRC"] = str(netrc)
        print(f"[trl-async] {args.server} server starting on port {port}: {' '.join(server.argv)}", flush=True)
        run["server_ready_s"] = server.wait_healthy(min(args.server_timeout, deadline - time.monotonic()))
        print(f"[trl-async] server healthy after {run['server_ready_s']:.0f}s", flush=True)

        config = {
            "server_url": f"http://127.0.0.1:{port}", "model": str(args.model), "dataset": str(args.dataset),
            "output_dir": str(output_dir), "steps_path": str(steps_path), "steps": args.steps,
            "max_staleness": args.max_staleness, "completion_length": args.completion_length,
            "batch": args.batch, "num_generations": args.num_generations, "learning_rate": args.learning_rate,
            "device": args.device, "attn": args.attn, "server_timeout": args.server_timeout,
        }
        config_path = work / "train.json"
        config_path.write_text(json.dumps(config, indent=2))
        t_train = time.monotonic()
        with trainer_log.open("wb") as log:
            trainer = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--train-config",
                                        str(config_path)], stdout=log, stderr=subprocess.STDOUT,
                                       env=trainer_env, start_new_session=True)
            # wait for the trainer; stop early when time is up or the server died (TRL would retry for minutes)
            while (code := trainer.poll()) is None:
                if time.monotonic() > deadline - 15:
                    run["exit_code"] = 124
                    run["error"] = f"trainer timed out (--timeout {args.timeout:.0f}s for the whole run)"
                    break
                if server.proc.poll() is not None:
                    run["exit_code"] = 125
                    run["error"] = f"the server exited with {server.proc.returncode} during training"
                    break
                time.sleep(1.0)
            else:
                run["exit_code"] = code
        run["train_s"] = time.monotonic() - t_train
        if run["exit_code"] != 0 and run["error"] is None:
            run["error"] = f"trainer exited with {run['exit_code']}; see {stem.name}_trainer.log"
        if server.proc.poll() is not None and run["exit_code"] != 125:
            run["error"] = f"{run['error'] or 'trainer done'}; the server exited with {server.proc.returncode}"
    except (Exception, SystemExit) as exc:  # recorded in the JSON, which is written whatever happened
        run["error"] = f"{type(exc).__name__}: {exc}"
        if run["exit_code"] is None:
            run["exit_code"] = exc.code if isinstance(exc, SystemExit) else 1
        print(f"[trl-async] error: {run['error']}", file=sys.stderr, flush=True)
        if not isinstance(exc, (RuntimeError, TimeoutError, SystemExit)):
            traceback.print_exc()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if trainer is not None and trainer.poll() is None:
            stop_group(trainer, grace=10)
        elif trainer is not None:  # its rollout worker, should it have outlived it
            stop_group(trainer, grace=0)
        if server is not None:
            server.stop()
        run["wall_s"] = time.monotonic() - t_start
        (Path(f"{stem}_server.log")).write_text(tail_lines(work / "server.log", SERVER_LOG_LINES))
        (Path(f"{stem}_trainer.log")).write_text(tail_lines(trainer_log, TRAINER_LOG_LINES))
        if steps_path.is_file():
            shutil.copyfile(steps_path, f"{stem}_steps.jsonl")
        run.update(summarize(read_events(steps_path), args.max_staleness))
        dump(str(out), {
            "benchmark": f"GRPO step time, TRL 1.16 AsyncGRPOTrainer (LoRA sync) against {args.server} serve",
            "command": f"python bench/trl_async.py --server {args.server} --model {args.model} "
                       f"--dataset {args.dataset} --steps {args.steps} --max-staleness {args.max_staleness} "
                       f"--completion-length {args.completion_length} --batch {args.batch} "
                       f"--learning-rate {args.learning_rate} --attn {args.attn} --device {args.device} "
                       + "".join(f"--vllm-arg={a} " for a in args.vllm_arg) + f"--out {out}",
            "workload": {"completion_length": args.completion_length, "completions_per_step": args.batch,
                         "micro_batch": args.batch, "num_generations": args.num_generations, "steps": args.steps,
                         "max_staleness": args.max_staleness,
                         "max_inflight_tasks": max(args.max_staleness, 1) * args.batch,
                         "max_loras": max_loras_for(args.max_staleness), "learning_rate": args.learning_rate,
                         "gpu_memory_utilization": args.gpu_memory_utilization, "server": args.server,
                         "device": args.device},
            "machine": machine(), "date": dt.date.today().isoformat(), "runs": {"trl_async": run}, "figures": [],
            "notes": ["TRL's max_staleness is checked when a sample leaves its queue (trainer version minus the "
                      "version its group was dispatched under; older samples are dropped), and accelerate's "
                      "dispatcher fetches batch k+1 at the start of step k: a batch trains up to max_staleness + 1 "
                      "versions behind, and staleness_mean at step k describes batch k+1",
                      "generation never waits for the trainer: max(max_staleness, 1) x batch requests stay in "
                      "flight and finished samples queue (up to 1024) until taken or dropped",
                      "reward per step: " + json.dumps(run.get("reward"))],
        })
        print("trl_async", json.dumps({k: run.get(k) for k in (
            "exit_code", "wall_s", "steps_logged", "step_s_median", "step_s_mean", "step_s_steady_mean",
            "reward_summary", "attention", "error")}), flush=True)
    sys.exit(0 if run["exit_code"] == 0 else 1)


# ---------------------------------------------------------------------------------------------------------
# Trainer child: TRL's AsyncGRPOTrainer, with the shims this machine needs.
# ---------------------------------------------------------------------------------------------------------


@functools.cache
def _vllm_fa3_function() -> Any:
    """An autograd Function: vLLM's FlashAttention-3 forward, PyTorch's FlashAttention-2 backward."""
    import torch
    from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported

    if not is_fa_version_supported(3):
        from vllm.vllm_flash_attn import fa_version_unsupported_reason

        raise RuntimeError(f"vLLM FA3 unsupported here: {fa_version_unsupported_reason(3)}")

    class Fa3ForwardFa2Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, max_q: int, max_k: int,
                    scale: float | None, causal: bool, window: tuple[int, int]) -> Any:
            q, k, v = (t.contiguous() for t in (q, k, v))
            # vLLM's signature: (q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, ...), FA2 by
            # default (whose kernel the GPU machine's bundle drops): by keyword, fa_version 3
            out, lse = flash_attn_varlen_func(
                q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k, cu_seqlens_k=cu_k,
                softmax_scale=scale, causal=causal, window_size=list(window), return_softmax_lse=True,
                fa_version=3)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
            ctx.args = (max_q, max_k, scale, causal, window)
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
            max_q, max_k, scale, causal, window = ctx.args
            # as torch.nn.attention.varlen's backward: no dropout, so the RNG state is zeros
            rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
            unused = torch.empty(0, device=q.device)
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                grad_out.to(q.dtype).contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                rng_state, unused, scale=scale, window_size_left=window[0], window_size_right=window[1])
            return dq, dk, dv, None, None, None, None, None, None, None

    return Fa3ForwardFa2Backward


def vllm_fa3_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                       max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = True,
                       window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, **_: Any) -> Any:
    """TRL's call (`kernels-community/flash-attn3`'s argument order) onto vLLM's FA3 forward + aten's FA2 backward."""
    if softcap:
        raise ValueError("vllm_fa3_attention: no softcap")
    return _vllm_fa3_function().apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      softmax_scale, causal, tuple(window_size))


def torch_fa2_attention(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                        max_seqlen_k: int, softmax_scale: float | None = None, causal: bool = True,
                        window_size: tuple[int, int] = (-1, -1), **_: Any) -> Any:
    """TRL's call onto PyTorch's varlen FlashAttention-2 (forward and backward)."""
    from torch.nn.attention.varlen import varlen_attn

    if tuple(window_size) != (-1, -1):
        raise ValueError("torch_fa2_attention: no sliding window")
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q, cu_seqlens_k,
                       int(max_seqlen_q), int(max_seqlen_k), scale=softmax_scale,
                       window_size=(-1, 0) if causal else (-1, -1))


ATTENTION = {"vllm-fa3": vllm_fa3_attention, "torch-fa2": torch_fa2_attention, "sdpa": segment_attention}


def check_attention(fn: Any, device: str) -> str | None:
    """None when `fn` matches per-segment SDPA (float32) on a small tree-shaped GQA batch, forward and gradients;
    else why not. Qwen2.5-1.5B's heads: 12 query, 2 key/value, 128 wide; bf16 as trained."""
    import torch

    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q_lens, k_lens = [7, 33, 19, 1], [7, 40, 52, 53]  # segments ending their paths, as TreeRow packs them
        heads, kv_heads, dim = 12, 2, 128
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32, device=device)
        base = [torch.randn(n, h, dim, generator=gen) for n, h in ((sum(q_lens), heads), (sum(k_lens), kv_heads),
                                                                   (sum(k_lens), kv_heads))]
        grad = torch.randn(sum(q_lens), heads, dim, generator=gen).to(device)
        results = []
        for impl, dtype in ((fn, torch.bfloat16), (segment_attention, torch.float32)):
            q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in base)
            out = impl(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), softmax_scale=dim ** -0.5, causal=True,
                       window_size=(-1, -1))
            (out.float() * grad).sum().backward()
            results.append([t.detach().float() for t in (out, q.grad, k.grad, v.grad)])
        for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
            err = (got - want).abs().max().item()
            scale = want.abs().max().item()
            if not err <= 0.03 * scale + 1e-3:
                return f"{name} differs from SDPA: max abs error {err:.4g} (max |value| {scale:.4g})"
        return None
    except Exception as exc:  # any failure means: use another kernel
        return f"{type(exc).__name__}: {exc}"[:400]


def choose_attention(requested: str, device: str) -> tuple[str, dict[str, str | None]]:
    if device != "cuda":
        return "sdpa", {}
    candidates = ["vllm-fa3", "torch-fa2", "sdpa"] if requested == "auto" else [requested]
    checks: dict[str, str | None] = {}
    for name in candidates:
        checks[name] = check_attention(ATTENTION[name], device) if name != "sdpa" else None
        if checks[name] is None:
            return name, checks
        print(f"[trl-async] attention {name} rejected: {checks[name]}", flush=True)
    raise RuntimeError(f"no usable attention kernel: {checks}")


def train(config: dict[str, Any]) -> None:
    """The trainer child: AsyncGRPOTrainer on the workload, step events to config['steps_path']."""
    import logging
    import types

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trl").setLevel(logging.INFO)

    import torch
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_module
    import trl.experimental.async_grpo.async_rollout_worker as worker_module
    import trl.experimental.async_grpo.packing as packing_module
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from grpo_testmodels import target_token_ids
    from grpo_trainer.rewards import token_fraction

    device = config["device"]
    steps_file = open(config["steps_path"], "a")  # noqa: SIM115 (open for the whole run)

    def event(kind: str, **fields: Any) -> None:
        steps_file.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")
        steps_file.flush()

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch sees no GPU")
    impl, checks = choose_attention(config["attn"], device)
    event("attention", impl=impl, checks=checks)
    print(f"[trl-async] tree attention: {impl} {checks}", flush=True)
    kernel = types.SimpleNamespace(flash_attn_varlen_func=ATTENTION[impl])
    packing_module._flash_attn = lambda: kernel  # instead of the Hub's kernels-community/flash-attn3
    if device != "cuda":  # it asks CUDA for the device name (a logging figure)
        trainer_module.get_peak_flops_per_device = lambda *a, **k: None
    if importlib.util.find_spec("vllm") is None:  # the worker only speaks HTTP, but TRL checks for vLLM
        worker_module.is_vllm_available = lambda *a, **k: True

    model = config["model"]
    lo, hi = target_token_ids(Path(model))
    reward = functools.partial(token_fraction, low=lo, high=hi, max_length=config["completion_length"])
    rows = [json.loads(line) for line in Path(config["dataset"]).read_text().splitlines() if line.strip()]
    for row in rows:  # TRL renders every prompt with the chat template: a plain prompt becomes one user message
        if isinstance(row["prompt"], str):
            row["prompt"] = [{"role": "user", "content": row["prompt"]}]
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CONTENT_ONLY_CHAT_TEMPLATE
    tokenizer.response_template = CONTENT_ONLY_RESPONSE_TEMPLATE

    cuda = device == "cuda"
    args = AsyncGRPOConfig(
        output_dir=config["output_dir"], vllm_server_base_url=config["server_url"],
        vllm_server_timeout=config["server_timeout"],
        max_steps=config["steps"], max_staleness=config["max_staleness"],
        num_generations=config["num_generations"], per_device_train_batch_size=config["batch"],
        gradient_accumulation_steps=1, token_budget=0,  # fixed count: `batch` samples per optimizer step
        max_completion_length=config["completion_length"], learning_rate=config["learning_rate"],
        lr_scheduler_type="constant", warmup_steps=0, temperature=1.0, top_p=1.0, top_k=0,
        seed=0, dtype="bfloat16" if cuda else "float32", bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True,
    )
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules="all-linear",
                      bias="none", task_type="CAUSAL_LM")
    trainer = AsyncGRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                               train_dataset=dataset, peft_config=lora)
    if not trainer._lora_sync:
        raise RuntimeError("TRL chose merged-weight sync, not LoRA sync: check the server's --enable-lora")

    class StepEvents(TrainerCallback):
        """Added after TRL's callbacks: a step ends once its adapter sync and metric flush are done."""

        def on_train_begin(self, _args: Any, state: Any, _control: Any, **_kw: Any) -> None:
            event("train_begin", step=state.global_step)

        def on_step_end(self, _args: Any, state: Any, _control: Any, **_kw: Any) -> None:
            event("step_end", step=state.global_step)

        def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, Any] | None = None,
                   **_kw: Any) -> None:
            clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in (logs or {}).items()
                     if isinstance(v, (int, float, str)) or v is None}
            event("log", step=state.global_step, logs=clean)

    trainer.add_callback(StepEvents())
    event("trainer_ready", lora_sync=trainer._lora_sync)
    trainer.train()
    event("train_end", step=trainer.state.global_step)
    steps_file.close()
    if trainer.state.global_step != config["steps"]:
        raise RuntimeError(f"trained {trainer.state.global_step} of {config['steps']} steps")


if __name__ == "__main__":
    main()
