"""Generation through our server vs the same engine without HTTP, and adapter sync under load.

Two phases, each its own process so every engine gets the GPU to itself:

    python bench/gen_server.py direct --model M --adapter A --out $OUT/gen_direct.json
    python bench/gen_server.py http   --model M --adapter A --out $OUT/gen_http.json [--direct $OUT/gen_direct.json]

`direct` drives `grpo_server.engines.vllm_engine.VllmEngine` in-process (what the
server does, minus HTTP and JSON). `http` starts `grpo serve` (vllm engine), loads
the r=32 adapter through the real trigger, sends the GRPO-shaped workload as
concurrent `/v1/completions` requests with logprobs (TRL's shape), then runs the
adapter-sync benchmark: 20 versions published and triggered while generation traffic
runs, each timed to the first token on the new version; every response's adapter tag
is checked. Publishing is the trainer's own code (`grpo_trainer.transport.adapter_store.AdapterStore`
with `grpo_trainer.transport.adapter_files.write_adapter`): the adapter's float32 tensors, held on
the GPU as a trainer holds them, written in the serving dtype, hashed while written,
manifest, fsync, atomic rename, pruned one sync late. The full-reload baseline is the
time to merge the adapter into the weights and save them, plus to start a fresh server
on them until healthy.

`direct` runs the workload with the sampler's logprobs and with prefill rescoring
(`logprobsSource: auto`) on one engine, and scores the same samples both ways to report the
|difference|; `http` repeats that check through the server with seeded single requests
(`logprobs: 1` takes the sampler's path, `logprobs: 0` the server's `--logprobs-source`).

`--profile DIR` samples the server process and its engine-core child with py-spy
during the measured generation run (raw collapsed stacks; `bench/profile_summary.py`
summarises them). `--plain-run` first generates the same workload without logprobs
(its tokens/s against LLM.generate plain is the server's own cost; against the run with
logprobs, what logprobs cost). Each measured run records the CPU seconds of the server's
process and of the engine core, and the GPU's mean utilization (nvidia-smi, 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import Workload, dump, figure, grpo_shaped, machine

from grpo_api.fingerprint import model_fingerprint
from grpo_api.models import GRPORun, ServerSpec
from grpo_api.runconfig import run_config_for

TOKEN = "bench-token"
#: The bench's connection pools: idle connections are dropped after 1 s, well before uvicorn closes them (5 s), so a
#: request never races a server-side close (httpx's default expiry is the same 5 s).
LIMITS = httpx.Limits(max_connections=256, keepalive_expiry=1.0)
SERVER = {"engine": "vllm", "maxLoras": 4, "maxLoraRank": 32, "gpuMemoryUtilization": 0.6, "maxModelLen": 2048,
          "dtype": "bfloat16"}


def server_spec() -> ServerSpec:
    return ServerSpec.model_validate(SERVER)


# ------------------------------------------------------------------------------------------- direct


async def direct(model: Path, adapter: Path, work: Workload) -> dict[str, Any]:
    """The engine without HTTP, with the sampler's logprobs and with prefill rescoring; and how far they differ."""
    import math

    from transformers import AutoTokenizer

    from grpo_server.engines.base import AdapterHandle, PromptResult, SamplingOptions
    from grpo_server.engines.vllm_engine import VllmEngine

    engine = VllmEngine(model, "bench", server_spec(), AutoTokenizer.from_pretrained(model))
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    handle = AdapterHandle("policy-v1", 1, str(adapter))
    await engine.add_adapter(handle)

    async def one(i: int, ids: list[int], max_tokens: int) -> PromptResult:
        options = SamplingOptions(n=work.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
        [result] = await engine.generate([ids], options, handle)
        assert all(len(c.logprobs) == len(c.token_ids) for c in result.completions)
        assert all(not math.isnan(lp) for c in result.completions for lp in c.logprobs)
        return result

    async def run(w: Workload) -> tuple[dict[str, float], list[PromptResult]]:
        t = time.perf_counter()
        results = await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens,
                                                                                      strict=True))))
        wall = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for r in results for c in r.completions)
        return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}, results

    runs: dict[str, Any] = {"engine_start_s": start_s}
    for source in ("sampler", "auto"):
        engine.logprobs_source = source
        await run(work.subset(8))  # warm-up
        runs[f"lora_logprobs_{source}"], _ = await run(work)
    # the same sampled tokens scored both ways: the sampler's processed logprobs against the prefill's
    engine.logprobs_source = "sampler"
    _, sampled = await run(work.subset(8))
    rescored = await engine.rescore(sampled, handle)
    diffs = sorted(abs(a - b) for r0, r1 in zip(sampled, rescored, strict=True)
                   for c0, c1 in zip(r0.completions, r1.completions, strict=True)
                   for a, b in zip(c0.logprobs, c1.logprobs, strict=True))
    runs["rescore_vs_sampler"] = {
        "tokens": len(diffs), "mean_abs_diff": statistics.fmean(diffs), "p50_abs_diff": diffs[len(diffs) // 2],
        "p99_abs_diff": diffs[int(0.99 * (len(diffs) - 1))], "max_abs_diff": diffs[-1],
    }
    runs["lora_logprobs"] = runs["lora_logprobs_auto"]
    await engine.shutdown()
    return runs


# --------------------------------------------------------------------------------------------- http


def start_server(model: Path, work_dir: Path, port: int, weights: str | None = None,
                 overrides: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path, float]:
    """`grpo serve` on the model; `weights` (ipc, nccl): a server that takes pushed weights (a merged-sync run's:
    LoRA off, vLLM's weight transfer on). `overrides` are merged into spec.server (a CPU smoke's engine); `env`
    is added to the server's environment (GRPO_SERVER_* settings)."""
    trainer: dict[str, Any] = {"lora": {"r": 32, "alpha": 64}}
    server = {**SERVER, **(overrides or {})}
    if weights is not None:
        trainer["sync"] = "merged"
        server["weightTransfer"] = weights
    run = GRPORun.model_validate({
        "metadata": {"name": "bench"},
        "spec": {"model": {"name": "bench", "path": str(model)}, "dataset": {"path": "/dev/null"},
                 "rewards": [{"function": "token_fraction"}], "server": server, "trainer": trainer},
    })
    work_dir.mkdir(parents=True, exist_ok=True)
    token_file = work_dir / "token"
    token_file.write_text(TOKEN)
    cfg = run_config_for(run, volume_root=work_dir / "vol", server_url=f"http://127.0.0.1:{port}",
                         token_file=str(token_file))
    config_path = work_dir / "run-config.yaml"
    config_path.write_text(cfg.to_yaml())
    log = (work_dir / "server.log").open("wb")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_cli.main", "serve", "--config", str(config_path), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {work_dir / 'server.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/", timeout=2).status_code == 200:
                return proc, Path(cfg.paths.adapter_root), time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not healthy in 480 s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


class Publisher:
    """The trainer's publishing path over an adapter's tensors, held where a trainer holds them."""

    def __init__(self, adapter: Path, root: Path, fingerprint: str, dtype: str) -> None:
        import torch
        from safetensors.torch import load_file

        from grpo_trainer.transport.adapter_store import AdapterStore

        device = "cuda" if torch.cuda.is_available() else "cpu"
        saved = load_file(adapter / "adapter_model.safetensors", device=device)
        self.tensors = {k: v.float() for k, v in saved.items()}
        self.config = json.loads((adapter / "adapter_config.json").read_text())
        self.store = AdapterStore(root, fingerprint)
        self.dtype = dtype
        self.last_bytes = 0
        self.last_phases: dict[str, float] = {}

    def publish(self, step: int) -> tuple[Path, int, str, float]:
        """Publish the next version; returns (path, version, manifest digest, seconds)."""
        from grpo_trainer.transport.adapter_files import write_adapter

        t0 = time.perf_counter()
        published = self.store.publish(lambda d: write_adapter(d, self.tensors, self.config, dtype=self.dtype), step)
        seconds = time.perf_counter() - t0
        self.last_bytes = published.size_bytes
        self.last_phases = published.phases
        return published.path, published.version, published.sha256, seconds


def start_profile(pid: int, out: Path, seconds: int, stem: str = "server") -> subprocess.Popen[bytes] | None:
    """py-spy over the server and its children (the engine core), if py-spy is installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--subprocesses", "--duration", str(seconds), "--rate", "50",
         "--format", "raw", "--nonblocking", "--output", str(out / f"{stem}-stacks.txt")],
        stdout=(out / f"py-spy-{stem}.log").open("wb"), stderr=subprocess.STDOUT,
    )


class GpuBusy:
    """The GPU's utilization (the share of time a kernel ran), sampled by nvidia-smi every 100 ms while a run
    generates: well under 100% with the engine core's CPU busy means the engine core's Python is the limit."""

    def __init__(self) -> None:
        smi = shutil.which("nvidia-smi")
        self.proc = None if smi is None else subprocess.Popen(
            [smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> dict[str, float]:
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        values = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        return {"gpu_util_mean_pct": statistics.fmean(values), "gpu_util_samples": len(values)} if values else {}


def cpu_seconds(pid: int, leave_out: str | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's process (HTTP, and vLLM's front end: its output
    processor) and of its child processes together (vLLM's engine core), children whose name begins with
    `leave_out` (a profiler this process started) not counted."""
    import psutil  # a dependency of vLLM

    def used(process: psutil.Process) -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    server = psutil.Process(pid)
    children = 0.0
    for child in server.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # ended since the listing
            if leave_out is None or not child.name().startswith(leave_out):
                children += used(child)
    return {"server_cpu_s": used(server), "engine_cpu_s": children}


async def http_bench(
    model: Path, adapter: Path, work: Workload, work_dir: Path, port: int, syncs: int, publish_dtype: str,
    profile: Path | None, weights: str | None = None, plain_run: bool = False,
) -> dict[str, Any]:
    """With `weights`, the server takes pushed weights instead of adapters: generation runs on plain weights
    (no adapter loaded, no LoRA in the engine) and the adapter-sync benchmark is not run. With `plain_run`, the
    same workload is first generated without logprobs (`no_logprobs`): the server's own cost against
    LLM.generate, apart from what logprobs add."""
    proc, root, start_s = start_server(model, work_dir, port, weights)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {TOKEN}"}
    expected_version = None if weights else 1
    try:
        # inside the try: an adapter that does not load stops the server too, never leaves it holding the port
        publisher = Publisher(adapter, root, model_fingerprint(model), publish_dtype)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=LIMITS) as client:
            if weights is None:
                path, version, digest, _ = publisher.publish(step=1)
                r = await client.post("/set_lora_adapter/", json={"path": str(path), "version": version,
                                                                  "sha256": digest}, headers=headers)
                r.raise_for_status()

            async def one(http: httpx.AsyncClient, i: int, ids: list[int], max_tokens: int, logprobs: bool
                          ) -> tuple[int, int | None]:
                body = {"model": "bench", "prompt": [ids], "n": work.n, "max_tokens": max_tokens,
                        "temperature": 1.0, "return_token_ids": True,
                        "return_tokens_as_token_ids": True, "ignore_eos": True, "seed": i}
                if logprobs:
                    body["logprobs"] = 0
                resp = await http.post("/v1/completions", json=body)
                resp.raise_for_status()
                data = resp.json()
                for choice in data["choices"]:
                    assert not logprobs or len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
                return sum(len(c["token_ids"]) for c in data["choices"]), data.get("adapter_version")

            async def run(w: Workload, logprobs: bool = True) -> dict[str, float]:
                # A client of its own: a connection left idle by the last run is never reused (the H100 lease 9's
                # run with logprobs failed with httpx.ReadError on connections uvicorn closed, 5 s idle, as it sent).
                async with httpx.AsyncClient(base_url=base, timeout=600, limits=LIMITS) as http:
                    t = time.perf_counter()
                    results = await asyncio.gather(*(one(http, i, p, m, logprobs) for i, (p, m) in enumerate(
                        zip(w.prompts, w.max_tokens, strict=True))))
                    wall = time.perf_counter() - t
                assert all(v == expected_version for _, v in results), f"every response: adapter {expected_version}"
                tokens = sum(t for t, _ in results)
                return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}

            async def measured(logprobs: bool, stem: str, profile_s: int) -> dict[str, float]:
                """One run of the workload with the server's CPU seconds (front end, engine core), the GPU's
                utilization and, with `profile`, py-spy's stacks of both processes."""
                spy = start_profile(proc.pid, profile, profile_s, stem) if profile is not None else None
                gpu = GpuBusy()
                before, steps_before = cpu_seconds(proc.pid), await engine_steps(client)
                gen = await run(work, logprobs)
                after, steps_after = cpu_seconds(proc.pid), await engine_steps(client)
                gen.update(gpu.stop())
                gen.update({key: after[key] - before[key] for key in after})  # is the front end or engine core busy?
                gen.update(step_figures(steps_before, steps_after, gen["seconds"]))
                if spy is not None:
                    await asyncio.to_thread(spy.wait, 60)  # one py-spy at a time: it stops the process it samples
                return gen

            await run(work.subset(8))
            no_logprobs = await measured(False, "no-logprobs", 5) if plain_run else None
            gen = await measured(True, "server", 10)
            consistency = await logprob_consistency(client, work)
            sync = await sync_bench(client, publisher, headers, syncs) if weights is None else None
    finally:
        stop_server(proc)
    return {"server_start_s": start_s, "weights": weights, ("plain_logprobs" if weights else "lora_logprobs"): gen,
            "no_logprobs": no_logprobs, "sync": sync, "publish_dtype": publish_dtype, "rescore_vs_sampler": consistency}


#: vLLM's own samples on the server's /metrics that say how a run's time divides into engine steps: the count and
#: sum of its tokens-per-step histogram, its preemptions.
STEP_SAMPLES = {"vllm:iteration_tokens_total_count": "steps", "vllm:iteration_tokens_total_sum": "step_tokens",
                "vllm:num_preemptions_total": "preemptions"}


async def engine_steps(client: httpx.AsyncClient) -> dict[str, float]:
    """vLLM's step counters so far, summed over their labels; none with the transformers engine."""
    return step_counters((await client.get("/metrics")).text)


def process_steps() -> dict[str, float]:
    """vLLM's step counters in this process's own metrics (an engine with stats on running in it: LLM, AsyncLLM)."""
    from prometheus_client import REGISTRY, generate_latest

    return step_counters(generate_latest(REGISTRY).decode())


def step_counters(exposition: str) -> dict[str, float]:
    """vLLM's step counters in a Prometheus text exposition, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            key = STEP_SAMPLES.get(sample.name)
            if key is not None:
                found[key] = found.get(key, 0.0) + sample.value
    return found


def step_figures(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """A run's engine steps from the counters around it: how many, the tokens (prefill and decode) a step
    scheduled, the wall time a step took. A run with logprobs that takes more steps for the same tokens has
    smaller batches; one that takes as many has slower steps."""
    if "steps" not in after:
        return {}
    steps = after["steps"] - before.get("steps", 0.0)
    tokens = after.get("step_tokens", 0.0) - before.get("step_tokens", 0.0)
    figures = {"engine_steps": steps, "preemptions": after.get("preemptions", 0.0) - before.get("preemptions", 0.0)}
    if steps:
        figures |= {"tokens_per_step": tokens / steps, "ms_per_step": 1000 * seconds / steps}
    return figures


async def logprob_consistency(client: httpx.AsyncClient, work: Workload, requests: int = 16) -> dict[str, Any]:
    """The same seeded sample twice, one request at a time: `logprobs: 1` takes the sampler's logprobs,
    `logprobs: 0` the prefill rescoring; |difference| of the sampled tokens' logprobs where the tokens agree."""
    diffs: list[float] = []
    identical = 0
    requests = min(requests, len(work.prompts))
    for i in range(requests):
        body = {"model": "bench", "prompt": [work.prompts[i][:64]], "n": 1, "max_tokens": 64, "temperature": 1.0,
                "return_token_ids": True, "ignore_eos": True, "seed": 1000 + i}
        sampler = (await client.post("/v1/completions", json={**body, "logprobs": 1})).json()["choices"][0]
        rescored = (await client.post("/v1/completions", json={**body, "logprobs": 0})).json()["choices"][0]
        identical += sampler["token_ids"] == rescored["token_ids"]
        for a, b, la, lb in zip(sampler["token_ids"], rescored["token_ids"], sampler["logprobs"]["token_logprobs"],
                                rescored["logprobs"]["token_logprobs"], strict=True):
            if a != b:
                break
            diffs.append(abs(la - lb))
    diffs.sort()
    return {"requests": requests, "identical_samples": identical, "tokens_compared": len(diffs),
            "mean_abs_diff": statistics.fmean(diffs) if diffs else None,
            "p99_abs_diff": diffs[int(0.99 * (len(diffs) - 1))] if diffs else None,
            "max_abs_diff": diffs[-1] if diffs else None}


async def sync_bench(client: httpx.AsyncClient, publisher: Publisher, headers: dict[str, str],
                     syncs: int = 20) -> dict[str, Any]:
    """20 publishes + triggers + first token on the new version, while background traffic runs."""
    stop = asyncio.Event()
    errors: list[str] = []
    stale: list[str] = []
    served = 0
    loaded_before: dict[float, int] = {}  # request start time -> newest version whose trigger had returned

    async def traffic(worker: int) -> None:
        nonlocal served
        i = 0
        while not stop.is_set():
            started = time.perf_counter()
            floor = max((v for t, v in loaded_before.items() if t <= started), default=1)
            body = {"model": "bench", "prompt": [[11 + worker, 12, 13, 14] * 16], "n": 4, "max_tokens": 64,
                    "temperature": 1.0, "logprobs": 0, "return_token_ids": True, "seed": i}
            try:
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code} {resp.text[:200]}")
                else:
                    version = resp.json().get("adapter_version")
                    if version is None or version < floor:
                        stale.append(f"started after v{floor} loaded, served by v{version}")
                    served += 1
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
            i += 1

    workers = [asyncio.create_task(traffic(w)) for w in range(16)]
    await asyncio.sleep(2)
    timings: list[dict[str, float]] = []
    for step in range(2, 2 + syncs):
        t0 = time.perf_counter()
        path, version, digest, publish_s = publisher.publish(step)
        t1 = time.perf_counter()
        r = await client.post("/set_lora_adapter/", json={"path": str(path), "version": version, "sha256": digest},
                              headers=headers)
        t2 = time.perf_counter()
        if r.status_code != 200:
            errors.append(f"trigger v{version}: {r.status_code} {r.text[:200]}")
            continue
        loaded_before[t2] = version
        load_s = r.json()["load_seconds"]
        first = await client.post("/v1/completions", json={
            "model": "bench", "prompt": [[5, 6, 7, 8]], "max_tokens": 1, "logprobs": 0, "return_token_ids": True})
        t3 = time.perf_counter()
        if first.json().get("adapter_version") != version:
            stale.append(f"first token after trigger v{version} served by {first.json().get('adapter_version')}")
        timings.append({"publish_s": publish_s, **{f"publish_{k}_s": v for k, v in publisher.last_phases.items()},
                        "trigger_s": t2 - t1, "server_load_s": load_s,
                        "first_token_s": t3 - t2, "total_s": t3 - t0})
        publisher.store.prune(version - 1)  # one sync late, as the trainer does
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*workers)
    totals = sorted(t["total_s"] for t in timings)

    def pct(q: float) -> float:
        return totals[min(len(totals) - 1, round(q * (len(totals) - 1)))]

    return {
        "syncs": len(timings), "p50_s": pct(0.5), "p95_s": pct(0.95), "max_s": totals[-1],
        "publish_p50_s": statistics.median(t["publish_s"] for t in timings),
        "trigger_p50_s": statistics.median(t["trigger_s"] for t in timings),
        "server_load_p50_s": statistics.median(t["server_load_s"] for t in timings),
        **{f"{k[:-2]}_p50_s": statistics.median(t[k] for t in timings)
           for k in timings[0] if k.startswith("publish_") and k != "publish_s"},
        "first_token_p50_s": statistics.median(t["first_token_s"] for t in timings),
        "background_requests": served, "errors": errors[:20], "error_count": len(errors),
        "wrong_version": stale[:20], "wrong_version_count": len(stale), "timings": timings,
        "adapter_bytes": publisher.last_bytes,
    }


def merged_reload(model: Path, adapter: Path, work_dir: Path, port: int) -> dict[str, float]:
    """Baseline: merge the adapter into the weights, save them, and start a fresh server on them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    out = work_dir / "merged"
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    save_s = time.perf_counter() - t0
    proc, _, start_s = start_server(out, work_dir / "merged-run", port)
    stop_server(proc)
    return {"merge_and_save_s": save_s, "server_start_s": start_s, "total_s": save_s + start_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["direct", "http"])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--adapter", type=Path, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--direct", type=Path, default=None, help="the direct phase's JSON, for the ratio")
    parser.add_argument("--offline", type=Path, default=None, help="gen_offline.py's JSON, for the ratio")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--skip-reload", action="store_true")
    parser.add_argument("--engine", default="vllm", help="transformers: a CPU smoke run of the same code")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-completion", type=int, default=1024)
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--publish-dtype", default=None,
                        help="dtype adapters are published in (default: what the trainer picks for the server)")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the server into this folder")
    parser.add_argument("--plain-run", action="store_true",
                        help="http: also generate the workload without logprobs first (the server's own cost)")
    parser.add_argument("--logprobs-source", choices=["sampler", "auto"], default="sampler",
                        help="spec.server.logprobsSource of the HTTP server, default the spec's (sampler; until "
                        "December 7 this bench's default was auto: its figures before then are rescored ones). "
                        "The direct phase measures both")
    parser.add_argument("--weights", choices=["ipc", "nccl"], default=None,
                        help="http: a server that takes pushed weights (trainer.sync merged): generation on plain "
                        "weights with logprobs against LLM.generate plain; no adapter sync, no reload")
    args = parser.parse_args()
    SERVER["engine"] = args.engine
    SERVER["logprobsSource"] = args.logprobs_source
    if args.engine != "vllm":
        SERVER.pop("gpuMemoryUtilization")
        SERVER["dtype"] = "auto"
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    work = grpo_shaped(vocab, prompts=args.prompts,
                       completion_len=(min(64, args.max_completion), args.max_completion),
                       prompt_len=(min(64, args.max_completion), min(512, 4 * args.max_completion)))
    today = dt.date.today().isoformat()
    if args.phase == "direct":
        result = asyncio.run(direct(args.model, args.adapter, work))
        dump(args.out, {"benchmark": "generation, engine called directly (no HTTP)", "machine": machine(),
                        "date": today, "command": f"python bench/gen_server.py direct --model {args.model} "
                        f"--adapter {args.adapter} --out $OUT/gen_direct.json", "runs": result,
                        "figures": [
                            figure("VllmEngine direct, LoRA + logprobs rescored in a prefill pass (auto)",
                                   result["lora_logprobs_auto"]["tokens_per_s"], "tokens/s",
                                   baseline="same engine, the sampler's logprobs",
                                   baseline_value=result["lora_logprobs_sampler"]["tokens_per_s"]),
                            figure("rescored vs sampler logprob, mean |diff|",
                                   result["rescore_vs_sampler"]["mean_abs_diff"], "nats"),
                        ]})
        return
    work_dir = Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    from grpo_trainer.transport.adapter_files import publish_dtype

    dtype = args.publish_dtype or publish_dtype(str(SERVER["dtype"]), args.model)
    result = asyncio.run(http_bench(args.model, args.adapter, work, work_dir, args.port, args.syncs, dtype,
                                    args.profile, args.weights, args.plain_run))
    if not args.skip_reload and args.weights is None:
        result["merged_reload"] = merged_reload(args.model, args.adapter, work_dir, args.port + 1)
    http_tps = result["plain_logprobs" if args.weights else "lora_logprobs"]["tokens_per_s"]
    figures = []
    if args.offline and args.offline.is_file():
        offline = json.loads(args.offline.read_text())["runs"]
        plain = offline["plain"]["tokens_per_s"]
        if args.weights:
            figures.append(figure(f"server HTTP, pushed weights ({args.weights}, no LoRA) + logprobs vs "
                                  "LLM.generate plain", http_tps, "tokens/s",
                                  baseline="LLM.generate plain (gen_offline)", baseline_value=plain, target="≥ 0.9"))
        else:
            figures.append(figure("server HTTP, LoRA + logprobs vs LLM.generate plain", http_tps, "tokens/s",
                                  baseline="LLM.generate plain (gen_offline)", baseline_value=plain, target="≥ 0.90"))
        if "hf generate" in offline:
            figures.append(figure("server HTTP vs HF generate", http_tps, "tokens/s",
                                  baseline="HF generate (gen_offline)", baseline_value=offline["hf generate"][
                                      "tokens_per_s"], target="≥ 10×"))
    run_result = result["plain_logprobs" if args.weights else "lora_logprobs"]
    plain_result = result["no_logprobs"]
    if plain_result is not None:
        figures.append(figure("server HTTP + logprobs vs the same server without logprobs", http_tps, "tokens/s",
                              baseline="same server, same workload, no logprobs",
                              baseline_value=plain_result["tokens_per_s"]))
        if args.offline and args.offline.is_file():
            figures.append(figure("server HTTP without logprobs vs LLM.generate plain", plain_result["tokens_per_s"],
                                  "tokens/s", baseline="LLM.generate plain (gen_offline)",
                                  baseline_value=json.loads(args.offline.read_text())["runs"]["plain"]["tokens_per_s"]))
    for label, measured_run in (("", run_result), (" (no logprobs)", plain_result)):
        if measured_run is None:
            continue
        figures += [figure(f"{side} CPU share while generating{label}", measured_run[key] / measured_run["seconds"],
                           "CPU s / wall s")
                    for side, key in (("server process (HTTP, vLLM's front end)", "server_cpu_s"),
                                      ("vLLM's engine core", "engine_cpu_s")) if key in measured_run]
        if "gpu_util_mean_pct" in measured_run:
            figures.append(figure(f"GPU utilization while generating{label}", measured_run["gpu_util_mean_pct"], "%"))
    if args.weights:
        dump(args.out, {"benchmark": "generation through a weight-transfer server (HTTP)", "machine": machine(),
                        "date": today, "command": f"python bench/gen_server.py http --model {args.model} --adapter "
                        f"{args.adapter} --weights {args.weights} --logprobs-source {args.logprobs_source} --out "
                        "$OUT/gen_http_weights.json --offline $OUT/gen_offline.json",
                        "logprobs_source": args.logprobs_source, "runs": result, "figures": figures})
        return
    if args.direct and args.direct.is_file():
        direct_tps = json.loads(args.direct.read_text())["runs"]["lora_logprobs"]["tokens_per_s"]
        figures.append(figure("server HTTP vs engine direct", http_tps, "tokens/s",
                              baseline="VllmEngine direct (gen_direct)", baseline_value=direct_tps,
                              target="≥ 0.95 (HTTP overhead ≤ 5%)"))
    sync = result["sync"]
    reload_s = result.get("merged_reload", {}).get("total_s")
    figures += [
        figure("adapter sync p50 (publish+trigger+first token)", sync["p50_s"] * 1000, "ms", target="≤ 100 ms",
               baseline="merged-weight reload" if reload_s else None,
               baseline_value=reload_s * 1000 if reload_s else None, higher_is_better=False),
        figure("adapter sync p95", sync["p95_s"] * 1000, "ms", target="≤ 250 ms"),
        figure("failed requests during syncs", sync["error_count"], "count", target="0"),
        figure("wrong-version responses", sync["wrong_version_count"], "count", target="0"),
    ]
    if result["rescore_vs_sampler"]["mean_abs_diff"] is not None:
        figures.append(figure("rescored vs sampler logprob, mean |diff| (same seeded samples)",
                              result["rescore_vs_sampler"]["mean_abs_diff"], "nats"))
    dump(args.out, {"benchmark": "generation through the server (HTTP) and adapter sync", "machine": machine(),
                    "date": today, "command": f"python bench/gen_server.py http --model {args.model} --adapter "
                    f"{args.adapter} --out $OUT/gen_http.json --direct $OUT/gen_direct.json --offline "
                    "$OUT/gen_offline.json", "runs": result, "figures": figures})


if __name__ == "__main__":
    main()
