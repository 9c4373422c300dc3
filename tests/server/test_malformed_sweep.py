"""Every endpoint, every field, malformed values of every JSON type: never a 5xx, always the JSON error body.

A real server (transformers engine, tiny model) over HTTP. Each request starts from a valid body and
replaces one field (or one key of a nested object) with one odd value: wrong types, huge and negative
numbers, non-finite numbers, NUL bytes and lone surrogates, very long strings, deep nesting. The
fields come from the request models themselves, so a field added later is swept too.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from grpo_api.protocol import ErrorResponse, SetAdapterRequest
from grpo_api.weight_transfer import FinishWeightUpdateRequest, InitWeightTransferRequest, UpdateWeightsRequest
from grpo_server.fields import GENERATION_KWARGS
from grpo_server.schemas import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from grpo_server.settings import HTTP_HEAD_BUFFER_BYTES, MAX_HEADER_BYTES
from tests.fixtures.server import RunningServer

#: Raw JSON texts: one odd value of each kind (non-finite numbers are not standard JSON, but
#: Python's parser accepts them, so a server built on it must survive them).
ODD_VALUES: tuple[str, ...] = (
    "null", "true", "-1", "0", "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "0.5",
    str(2**80), str(-(2**80)), "1" + "0" * 4400,  # above Python's int-parsing digit limit
    '""', json.dumps("x" * 20_000), '"\\u0000"', '"\\udc80"', '"../../etc/passwd"', '"policy-v99999999999999999999"',
    "[]", "[null]", "[-1]", f"[{2**80}]", "[[]]", f"[[{2**64}]]", '["x"]', "[1.5]", "{}", '{"a": {"b": [1]}}',
    '{"-1": -100, "x": "y"}', "[" * 200 + "]" * 200,
)

ENDPOINTS: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/generate/": (GenerateRequest, {"prompts": [[5, 6, 7]], "max_tokens": 2}),
    "/v1/completions": (CompletionRequest, {"prompt": [[5, 6, 7]], "max_tokens": 2}),
    "/v1/chat/completions": (ChatRequest, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "/set_lora_adapter/": (SetAdapterRequest, {"path": "test/v1", "version": 1, "sha256": "0" * 64}),
    "/v1/load_lora_adapter": (LoadLoraAdapterRequest, {"lora_name": "sweep-v1", "lora_path": "test/v1"}),
    "/v1/unload_lora_adapter": (UnloadLoraAdapterRequest, {"lora_name": "sweep-v1"}),
    # every variant of this body is invalid (its one field is replaced), so no rendezvous is attempted
    "/init_weight_transfer_engine": (InitWeightTransferRequest, {"init_info": {
        "master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2, "timeout_seconds": 0.1}}),
    "/update_weights": (UpdateWeightsRequest, {"update_info": {
        "names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[8]]}}),
    "/finish_weight_update": (FinishWeightUpdateRequest, {"version": 1}),
}

#: Nested objects whose keys are swept too: (field, keys).
NESTED: dict[str, list[str]] = {
    "generation_kwargs": sorted(GENERATION_KWARGS),
    "structured_outputs": ["regex", "json", "choice", "grammar"],
    "logit_bias": ["5", "-1", "99999999"],
    "response_format": ["type", "json_schema"],
    "chat_template_kwargs": ["x"],
    "update_info": ["names", "dtype_names", "shapes", "packed", "ipc_handles", "ipc_handles_pickled"],
    "init_info": ["master_address", "master_port", "rank_offset", "world_size", "timeout_seconds"],
}


def bodies(model: type[BaseModel], valid: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(label, raw JSON body): the valid body with one field or nested key replaced by each odd value."""
    base = json.dumps(valid)
    for field in sorted(model.model_fields):
        alias = model.model_fields[field].alias or field
        for value in ODD_VALUES:
            rest = {k: v for k, v in valid.items() if k != alias}
            yield f"{alias}={value[:40]}", _with(rest, alias, value)
        for key in NESTED.get(alias, []):
            for value in ODD_VALUES:
                yield f"{alias}.{key}={value[:40]}", _with(valid, alias, "{" + json.dumps(key) + ": " + value + "}")
    if "messages" in valid:
        yield "messages[0].content odd", base.replace('"hi"', '"\\udc80\\u0000"')
        yield "messages[0] not an object", base.replace('{"role": "user", "content": "hi"}', '"hi"')


def _with(body: dict[str, Any], key: str, raw_value: str) -> str:
    text = json.dumps(body)
    return text[:-1] + (", " if body else "") + json.dumps(key) + ": " + raw_value + "}"


RAW_BODIES: tuple[tuple[str, bytes], ...] = (
    ("empty", b""),
    ("null", b"null"),
    ("array", b"[]"),
    ("string", b'"x"'),
    ("truncated", b'{"prompt": [1, 2'),
    ("not utf-8", b'{"prompt": "\xff\xfe"}'),
    ("deep nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("huge integer", b'{"prompt": [' + b"9" * 10_000 + b"]}"),
    ("duplicate keys", b'{"prompt": [[5]], "prompt": "x", "max_tokens": 1}'),
)


def check(response: httpx.Response | Exception, label: str, problems: list[str]) -> None:
    if isinstance(response, Exception):
        problems.append(f"{label}: {type(response).__name__}: {response}")
        return
    if response.status_code >= 500:
        problems.append(f"{label}: {response.status_code} {response.text[:200]}")
        return
    if response.status_code >= 400:
        try:
            ErrorResponse.model_validate(response.json())
        except ValueError:
            problems.append(f"{label}: {response.status_code} without the JSON error body: {response.text[:200]}")


def send(client: httpx.Client, path: str, body: bytes) -> httpx.Response | Exception:
    try:
        return client.post(path, content=body)
    except httpx.HTTPError as exc:  # a dropped connection is a failure too
        return exc


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_no_malformed_field_value_gets_a_5xx(tiny_server: RunningServer, path: str) -> None:
    model, valid = ENDPOINTS[path]
    problems: list[str] = []
    count = 0
    with httpx.Client(base_url=tiny_server.url, headers={**tiny_server.auth, "Content-Type": "application/json"},
                      timeout=120) as client:
        for label, body in bodies(model, valid):
            check(send(client, path, body.encode("utf-8", "surrogatepass")), label, problems)
            count += 1
        for label, raw in RAW_BODIES:
            check(send(client, path, raw), f"raw {label}", problems)
    assert count >= len(model.model_fields) * len(ODD_VALUES), count
    assert not problems, f"{len(problems)} of {count} requests:\n" + "\n".join(problems[:40])
    assert tiny_server.health()["_status_code"] == 200


ODD_PATHS = ("/generate", "/v1/completions/", "/v1/completions/%00", "/v1/%ff%fe", "/" + "a" * 10_000,
             "/health/..%2f..%2fetc", "/set_lora_adapter/%00")


def test_odd_paths_methods_and_queries_get_4xx_json(tiny_server: RunningServer) -> None:
    problems: list[str] = []
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.auth, timeout=60) as client:
        for path in ODD_PATHS:
            check(client.post(path, json={}), f"POST {path[:40]}", problems)
            check(client.get(path), f"GET {path[:40]}", problems)
        for path in ("/v1/completions", "/set_lora_adapter/", "/reset_prefix_cache"):
            check(client.get(path), f"GET {path}", problems)
            check(client.delete(path), f"DELETE {path}", problems)
        for value in ("xml", "", "\x00", "j" * 5000):
            check(client.get("/server_info", params={"config_format": value}), f"server_info {value[:10]}", problems)
        for value in ("later", "", "\x00", "k" * 5000):
            check(client.post("/pause", params={"mode": value}), f"pause {value[:10]}", problems)
        for header in ("Bearer", "Bearer " + "x" * 100_000, "Basic Zm9vOmJhcg==", "bearer test-token\x7f",
                       "Basic " + "A" * 100_000, "Basic Og==", "Basic dGVzdC10b2tlbg=="):
            check(client.post("/clear_lora_adapter/", headers={"Authorization": header}), f"auth {header[:20]}",
                  problems)
    assert not problems, "\n".join(problems)


def send_head_in_pieces(port: int, head: bytes, piece: int = 4096) -> tuple[int, bytes]:
    """Write a request head a few KiB at a time, as a slow or busy network delivers it; (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        for start in range(0, len(head), piece):
            conn.sendall(head[start : start + piece])
            time.sleep(0.002)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def test_a_large_header_block_gets_431_json_however_it_arrives(tiny_server: RunningServer) -> None:
    """Heads up to the HTTP parser's buffer reach the app whole; over MAX_HEADER_BYTES they get 431 and the
    JSON body. (h11's 16 KiB default answered a plain 400 only when the head came in pieces: a CI flake.)"""
    value = b"Bearer " + b"x" * 100_000
    head = (b"POST /clear_lora_adapter/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n"
            b"Authorization: " + value + b"\r\n\r\n")
    status, body = send_head_in_pieces(tiny_server.port, head)
    assert status == 431, body[:200]
    error = ErrorResponse.model_validate_json(body)
    assert error.error == "headers_too_large" and str(MAX_HEADER_BYTES) in error.message
    # a head beyond the parser's buffer is refused: by h11 (plain 400) when it comes in pieces smaller than
    # the whole, else by the app (431); either way the server goes on serving
    huge = b"GET /health/ HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (HTTP_HEAD_BUFFER_BYTES + 1024) + b"\r\n\r\n"
    status, _ = send_head_in_pieces(tiny_server.port, huge, piece=65536)
    assert status in (400, 431)
    assert tiny_server.health()["_status_code"] == 200
