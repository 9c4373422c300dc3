"""Every endpoint of a real server (transformers engine, tiny model) over loopback HTTP."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_api.fingerprint import model_fingerprint
from grpo_api.protocol import (
    ADAPTER_VERSION_HEADER,
    BOOT_ID_HEADER,
    CLIENT_KEEPALIVE_SECONDS,
    SERVER_KEEP_ALIVE_SECONDS,
    HealthResponse,
)
from grpo_server.metrics import METRIC_NAMES
from grpo_trainer.transport.server_client import ServerClient
from tests.fixtures.server import ENV_ENGINE, RunningServer

#: The engine the server tests run on (transformers here; vllm on the GPU machine).
SERVED_ENGINE = os.environ.get(ENV_ENGINE, "transformers")

TRL_PAYLOAD: dict[str, Any] = {
    "prompt": [[9, 10, 11], [300, 301, 302, 303]],
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "n": 4,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "max_tokens": 8,
    "logprobs": 0,
}


def post(server: RunningServer, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def get(server: RunningServer, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(server.url + path, timeout=30, **kwargs)


def assert_tagged(response: httpx.Response, server: RunningServer) -> None:
    body = response.json()
    boot_id = server.health()["boot_id"]
    assert response.headers[BOOT_ID_HEADER] == boot_id == body["boot_id"]
    assert response.headers[ADAPTER_VERSION_HEADER] == "none" and body["adapter_version"] is None


# ------------------------------------------------------------------------------------ health and info


def test_health_reports_identity_fingerprint_and_no_adapter(tiny_server, served_model_dir):
    for path in ("/health/", "/health"):
        response = get(tiny_server, path)
        assert response.status_code == 200
        health = HealthResponse.model_validate(response.json())
        assert health.status == "ok"
        assert health.model == "tiny"
        assert health.engine == SERVED_ENGINE
        assert health.model_fingerprint == model_fingerprint(served_model_dir)
        assert health.adapter is None and health.progress is None
        assert re.fullmatch(r"[0-9a-f]{32}", health.boot_id)
        assert health.uptime_seconds > 0


def test_models_lists_the_served_name_first_then_the_base_alias(tiny_server):
    body = get(tiny_server, "/v1/models").json()
    ids = [card["id"] for card in body["data"]]
    assert body["object"] == "list"
    assert ids[:2] == ["tiny", "tiny:base"]
    assert body["data"][0]["max_model_len"] > 0


def test_server_info_json_reports_processed_logprobs(tiny_server):
    body = get(tiny_server, "/server_info", params={"config_format": "json"}).json()
    assert body["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert body["engine"] == SERVED_ENGINE
    assert isinstance(get(tiny_server, "/server_info").json()["vllm_config"], str)


def test_world_size_with_and_without_trailing_slash(tiny_server):
    for path in ("/get_world_size", "/get_world_size/"):
        response = get(tiny_server, path)
        assert response.status_code == 200 and response.json() == {"world_size": 1}


def test_reset_prefix_cache_answers_json_with_the_token_and_401_without(tiny_server):
    for path in ("/reset_prefix_cache", "/reset_prefix_cache/"):
        denied = post(tiny_server, path)
        assert denied.status_code == 401 and denied.json()["error"] == "unauthorized"
        wrong = post(tiny_server, path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = post(tiny_server, path, headers=tiny_server.auth)
        assert ok.status_code == 200 and ok.json()["success"] is True


def test_adapter_endpoints_require_the_token(tiny_server):
    assert post(tiny_server, "/set_lora_adapter/", {"path": "v1", "version": 1, "sha256": "x"}).status_code == 401
    assert post(tiny_server, "/clear_lora_adapter/").status_code == 401
    assert post(tiny_server, "/clear_lora_adapter/", headers=tiny_server.auth).status_code == 200


def test_metrics_export_every_declared_server_metric(tiny_server):
    post(tiny_server, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 2})
    text = get(tiny_server, "/metrics").text
    families = set(re.findall(r"^# TYPE (grpo_server_\w+) ", text, flags=re.M))
    assert families == set(METRIC_NAMES)
    assert 'grpo_server_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "grpo_server_engine_ready 1.0" in text


CHART = Path(__file__).resolve().parents[2] / "charts" / "grpo-operator"


@pytest.mark.skipif(SERVED_ENGINE != "vllm", reason="vLLM's own metrics exist only on the vllm engine (GPU)")
def test_every_vllm_metric_the_dashboards_and_alerts_use_is_exposed(tiny_server):
    used = set()
    for path in [*CHART.glob("dashboards/*.json"), *CHART.glob("templates/*.yaml")]:
        used |= set(re.findall(r"vllm:[a-z_:]*[a-z]", path.read_text()))
    assert len(used) >= 5, used
    post(tiny_server, "/v1/completions", {"prompt": [[5, 6]], "max_tokens": 2})
    text = get(tiny_server, "/metrics").text
    missing = sorted(name for name in used if not re.search(rf"^{re.escape(name)}[{{ ]", text, flags=re.M))
    assert not missing, f"the chart queries vLLM metrics this server does not expose: {missing}"


def test_docs_describe_every_request_and_response_model(tiny_server):
    spec = get(tiny_server, "/openapi.json").json()
    schemas = set(spec["components"]["schemas"])
    for name in ("CompletionRequest", "CompletionResponse", "ChatRequest", "ChatResponse", "GenerateRequest",
                 "GenerateResponse", "SetAdapterRequest", "SetAdapterResponse", "HealthResponse", "ErrorResponse",
                 "ModelList", "ServerInfo", "WorldSizeResponse", "ResetPrefixCacheResponse"):
        assert name in schemas
    assert "policy-v<N>" in spec["info"]["description"]
    assert get(tiny_server, "/docs").status_code == 200


# --------------------------------------------------------------------------------- TRL 1.16 shapes


def test_completions_follow_trl_shape_rules(tiny_server, served_model_dir):
    response = post(tiny_server, "/v1/completions", {"model": "tiny", **TRL_PAYLOAD})
    assert response.status_code == 200
    assert_tagged(response, tiny_server)
    body = response.json()
    choices = body["choices"]
    assert len(choices) == 2 * 4
    eos = set(json.loads((served_model_dir / "generation_config.json").read_text())["eos_token_id"])
    for k, choice in enumerate(choices):
        assert choice["index"] == k
        assert choice["prompt_token_ids"] == TRL_PAYLOAD["prompt"][k // 4]  # prompt-major
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert len(choice["token_ids"]) == len(logprobs["tokens"])
        assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                  strict=True):
            assert lp <= 0 and top == {token: lp}
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] in eos
        else:
            assert len(choice["token_ids"]) == 8 and not eos & set(choice["token_ids"])


def test_trl_client_generate_parses_the_response(tiny_server):
    """TRL 1.16's own VLLMClient.generate (constructor bypassed: it insists on vLLM being installed)."""
    requests = pytest.importorskip("requests")
    from trl.generation.vllm_client import VLLMClient

    client = object.__new__(VLLMClient)
    client.session = requests.Session()
    client.base_url = tiny_server.url
    client.model = get(tiny_server, "/v1/models").json()["data"][0]["id"]
    out = client.generate(prompts=[[9, 10, 11], [12, 13]], n=3, max_tokens=6, temperature=0.9, top_k=0,
                          generation_kwargs={"seed": 7})
    assert out["prompt_ids"] == [[9, 10, 11], [12, 13]]
    assert len(out["completion_ids"]) == 6
    logprobs: list[Any] = out["logprobs"]
    logprob_ids: list[Any] = out["logprob_token_ids"]
    for ids, lps, lp_ids in zip(out["completion_ids"], logprobs, logprob_ids, strict=True):
        assert len(ids) == len(lps) == len(lp_ids)
        assert [row[0] for row in lp_ids] == ids  # with logprobs=0 the top entry is the sampled token
    assert client.get_world_size() == 1
    assert client.get_server_info()["model_config"]["logprobs_mode"] == "processed_logprobs"


def test_completion_top_logprobs_include_alternatives_and_the_sampled_token(tiny_server):
    body = post(tiny_server, "/v1/completions", {**TRL_PAYLOAD, "logprobs": 3, "n": 2}).json()
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                  strict=True):
            assert token in top and top[token] == lp
            assert 3 <= len(top) <= 4


def test_text_prompts_and_decoded_logprob_tokens(tiny_server):
    body = post(tiny_server, "/v1/completions", {"prompt": ["def f(x):", "import os"], "max_tokens": 4,
                                                 "logprobs": 0, "temperature": 0, "ignore_eos": True,
                                                 "skip_special_tokens": False}).json()
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert body["usage"]["completion_tokens"] == 8


def test_seeded_completions_are_reproducible(tiny_server):
    payload = {**TRL_PAYLOAD, "seed": 42, "temperature": 1.0}
    first = post(tiny_server, "/v1/completions", payload).json()["choices"]
    second = post(tiny_server, "/v1/completions", payload).json()["choices"]
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in second]
    assert [c["logprobs"]["token_logprobs"] for c in first] == [c["logprobs"]["token_logprobs"] for c in second]


def test_greedy_with_several_samples_returns_the_one_greedy_sequence_n_times(tiny_server):
    """vLLM refuses n > 1 at temperature 0; the server answers as OpenAI does, on every engine."""
    body = {"prompt": [[5, 6, 7], [8, 9]], "n": 3, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    response = post(tiny_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for group in (choices[:3], choices[3:]):
        assert len({tuple(c["token_ids"]) for c in group}) == 1 and len(group[0]["token_ids"]) == 6
        assert len({tuple(c["logprobs"]["token_logprobs"]) for c in group}) == 1
    single = post(tiny_server, "/v1/completions", {**body, "prompt": [[5, 6, 7]], "n": 1}).json()["choices"]
    assert single[0]["token_ids"] == choices[0]["token_ids"]


def test_guided_regex_through_structured_outputs(tiny_server):
    body = post(tiny_server, "/v1/completions", {"prompt": [[5, 6, 7]], "n": 3, "max_tokens": 12, "seed": 1,
                                                 "structured_outputs": {"regex": "(yes|no)"}}).json()
    assert {c["text"] for c in body["choices"]} <= {"yes", "no"}


def test_native_generate_is_prompt_major_with_logprobs_per_token(tiny_server):
    response = post(tiny_server, "/generate/", {"prompts": [[9, 10, 11], [400, 401]], "n": 3, "max_tokens": 5,
                                                "generation_kwargs": {"seed": 3}})
    assert response.status_code == 200
    assert_tagged(response, tiny_server)
    body = response.json()
    assert body["prompt_ids"][0] == [9, 10, 11] and len(body["prompt_ids"]) == 2
    assert len(body["completion_ids"]) == 6 and len(body["finish_reasons"]) == 6
    for ids, lps, lp_ids in zip(body["completion_ids"], body["logprobs"], body["logprob_token_ids"], strict=True):
        assert len(ids) == len(lps) == len(lp_ids)
        assert [row[0] for row in lp_ids] == ids and all(len(row) == 1 for row in lps)
    text = post(tiny_server, "/generate/", {"prompts": ["import sys"], "max_tokens": 2}).json()
    assert text["prompt_ids"][0] and len(text["completion_ids"]) == 1
    again = post(tiny_server, "/generate/", {"prompts": [[9, 10, 11], [400, 401]], "n": 3, "max_tokens": 5,
                                             "generation_kwargs": {"seed": 3}}).json()
    assert again["completion_ids"] == body["completion_ids"]


def test_native_generate_refuses_unknown_generation_kwargs(tiny_server):
    response = post(tiny_server, "/generate/", {"prompts": [[1, 2]], "generation_kwargs": {"best_of": 3}})
    assert response.status_code == 400 and "generation_kwargs.best_of" in response.json()["message"]


def test_chat_completions_apply_the_chat_template(tiny_server, served_model_dir):
    from transformers import AutoTokenizer

    response = post(tiny_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "n": 2, "max_tokens": 6, "logprobs": True,
        "return_token_ids": True, "return_tokens_as_token_ids": True, "seed": 9})
    assert response.status_code == 200
    assert_tagged(response, tiny_server)
    body = response.json()
    tokenizer = AutoTokenizer.from_pretrained(served_model_dir)
    templated = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                              tokenize=False)
    assert body["prompt_token_ids"] == tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)


def test_model_selection_rejects_unknown_names_and_unloaded_versions(tiny_server):
    unknown = post(tiny_server, "/v1/completions", {"model": "gpt-4", "prompt": [[1, 2]], "max_tokens": 2})
    assert unknown.status_code == 404 and unknown.json()["error"] == "model_not_found"
    unloaded = post(tiny_server, "/v1/completions", {"model": "policy-v99", "prompt": [[1, 2]], "max_tokens": 2})
    assert unloaded.status_code == 404
    base = post(tiny_server, "/v1/completions", {"model": "tiny:base", "prompt": [[1, 2]], "max_tokens": 2})
    assert base.status_code == 200 and base.json()["model"] == "tiny:base"


# ------------------------------------------------------------------------------------ openai client


def test_openai_client_completions_and_chat(tiny_server):
    from openai import OpenAI

    client = OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="tiny", prompt="def main():", max_tokens=5, n=2, logprobs=1,
                                           seed=4, temperature=0.8)
    assert len(completion.choices) == 2
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices)
    first = completion.choices[0].logprobs
    assert first is not None and first.tokens is not None and first.token_logprobs is not None
    assert len(first.tokens) == len(first.token_logprobs)
    assert completion.usage is not None and completion.usage.completion_tokens >= 2
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, logprobs=True, top_logprobs=2, seed=1)
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert all(len(entry.top_logprobs) >= 2 for entry in chat.choices[0].logprobs.content)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    assert raw.headers[BOOT_ID_HEADER] == tiny_server.health()["boot_id"]


# ------------------------------------------------------------------------------------------ bad input


BAD_COMPLETIONS: list[tuple[str, Callable[[int], Any], str]] = [
    ("n below 1", lambda _: {"prompt": [[1, 2]], "n": 0}, "n:"),
    ("negative temperature", lambda _: {"prompt": [[1, 2]], "temperature": -0.5}, "temperature:"),
    ("empty prompt list", lambda _: {"prompt": []}, "prompt list is empty"),
    ("empty prompt", lambda _: {"prompt": [[]]}, "prompt[0] is empty"),
    ("unknown token id", lambda _: {"prompt": [[1, 2, 10**7]]}, "outside the vocabulary"),
    ("negative token id", lambda _: {"prompt": [[-1]]}, "outside the vocabulary"),
    ("max_tokens over budget", lambda n: {"prompt": [[1, 2, 3]], "max_tokens": n}, "max_tokens ("),
    ("prompt longer than maxModelLen", lambda n: {"prompt": [[5] * (n + 10)], "max_tokens": 1}, "maxModelLen is"),
    ("max_tokens zero", lambda _: {"prompt": [[1]], "max_tokens": 0}, "max_tokens:"),
    ("top_p zero", lambda _: {"prompt": [[1]], "top_p": 0}, "top_p:"),
    ("logprobs too many", lambda _: {"prompt": [[1]], "logprobs": 50}, "logprobs:"),
    ("prompt of wrong type", lambda _: {"prompt": {"a": 1}}, "prompt"),
    ("missing prompt", lambda _: {"max_tokens": 3}, "prompt: Field required"),
    ("stream", lambda _: {"prompt": [[1]], "stream": True}, "stream"),
    ("bad regex", lambda _: {"prompt": [[1]], "structured_outputs": {"regex": "(unclosed"}}, "regex"),
]


@pytest.fixture(scope="module")
def max_model_len(tiny_server) -> int:
    return int(get(tiny_server, "/v1/models").json()["data"][0]["max_model_len"])


@pytest.mark.parametrize(("case", "body", "fragment"), BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400_naming_the_problem(tiny_server, max_model_len, case, body, fragment):
    response = post(tiny_server, "/v1/completions", body(max_model_len))
    assert response.status_code == 400, response.text
    error = response.json()
    assert set(error) == {"error", "message"}
    assert fragment in error["message"]


def test_malformed_json_gets_400_invalid_json(tiny_server):
    for path in ("/v1/completions", "/generate/", "/v1/chat/completions"):
        response = httpx.post(tiny_server.url + path, content=b'{"prompt": [[1, 2]', timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"] == "invalid_json"


def test_bad_native_and_chat_requests_get_400(tiny_server, max_model_len):
    assert post(tiny_server, "/generate/", {"prompts": []}).json()["error"] == "invalid_request"
    assert post(tiny_server, "/generate/", {"prompts": [[1]], "n": 0}).status_code == 400
    assert post(tiny_server, "/generate/", {"prompts": [[1]], "max_tokens": max_model_len}).status_code == 400
    assert post(tiny_server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": max_model_len}).status_code == 400


def test_oversized_bodies_get_413_and_the_server_keeps_serving(tiny_server):
    huge = b'{"prompt": [[' + b"1," * (17 * 1024 * 1024) + b'1]]}'
    response = httpx.post(tiny_server.url + "/v1/completions", content=huge, timeout=120,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"] == "body_too_large"

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": [['
        for _ in range(40):
            yield b"1," * (1024 * 1024)
        yield b"1]]}"

    streamed = httpx.post(tiny_server.url + "/v1/completions", content=chunks(), timeout=120,
                          headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert get(tiny_server, "/health/").status_code == 200
    assert post(tiny_server, "/v1/completions", {"prompt": [[1, 2]], "max_tokens": 2}).status_code == 200


def test_unknown_paths_get_json_404(tiny_server):
    response = get(tiny_server, "/nope")
    assert response.status_code == 404 and response.json()["error"] == "not_found"


def test_fixture_paths_exist(tiny_server):
    assert Path(tiny_server.adapter_root).is_dir() and tiny_server.run_config_path.is_file()


# ------------------------------------------------------------------------------------------ keep-alive


def _local_port(response: httpx.Response) -> int:
    """The client side's port of the connection that carried `response` (while it is open)."""
    port: int = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


def _health_over(sock: socket.socket) -> bytes:
    """One GET /health/ on a raw keep-alive connection: the response's status line."""
    sock.sendall(b"GET /health/ HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n", 1)[0]


def test_the_trainer_drops_an_idle_connection_before_the_server_closes_it(tiny_server):
    """A request sent on a pooled connection at the moment the server closes it for idleness fails with a transport
    error (a benchmark's client met httpx.ReadError so). The server closes an idle connection after
    SERVER_KEEP_ALIVE_SECONDS; the trainer's client stops reusing one after CLIENT_KEEPALIVE_SECONDS, sooner."""
    assert CLIENT_KEEPALIVE_SECONDS < SERVER_KEEP_ALIVE_SECONDS - 1
    client = ServerClient(tiny_server.url, token=tiny_server.token, generation_timeout=30)
    try:
        first = _local_port(client._http.get("/health/"))
        assert _local_port(client._http.get("/health/")) == first, "a connection in use is kept"
        time.sleep(CLIENT_KEEPALIVE_SECONDS + 0.5)
        assert _local_port(client._http.get("/health/")) != first, "an idle connection is dropped by the client"
    finally:
        client.close()

    # The server's side: a connection stays open past the client's expiry and is closed after the server's own.
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=SERVER_KEEP_ALIVE_SECONDS + 5) as sock:
        assert _health_over(sock).startswith(b"HTTP/1.1 200")
        time.sleep(CLIENT_KEEPALIVE_SECONDS + 0.5)
        assert _health_over(sock).startswith(b"HTTP/1.1 200"), "open past the client's expiry"
        started = time.monotonic()
        assert sock.recv(65536) == b"", "the server closes an idle connection"
        assert time.monotonic() - started >= SERVER_KEEP_ALIVE_SECONDS - 1
