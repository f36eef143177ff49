"""schemathesis against the server's own OpenAPI schema (what FastAPI publishes), on loopback: valid and
invalid bodies alike must never produce a 500 or a hang, and every refusal has the OpenAI error shape."""

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from serving import MODEL, RunningServer
from specdecode import NgramDrafter
from specdecode.server import Service

EXAMPLES = int(os.environ.get("SPECDECODE_FUZZ_EXAMPLES", "40"))  # per operation and mode; `make fuzz` runs more


@pytest.fixture(scope="module")
def server(target, tokenizer):
    service = Service(target, tokenizer, NgramDrafter(), model_name=MODEL, k=4, max_batch=4, max_queue=256)
    with RunningServer(service) as running:
        yield running


def steered(pair):
    """Half of the valid-by-schema bodies are nudged past the checks the schema cannot state (this model's
    name, a short max_tokens, some text, no unsupported feature), so the fuzz reaches generation with arbitrary
    sampling, stop strings, logprobs and streaming."""
    case, steer = pair
    body = case.body
    if not steer or not isinstance(body, dict):
        return case
    body["model"] = MODEL
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int):
            body[field] = 1 + body[field] % 24
    for field in ("n", "best_of", "echo", "suffix", "frequency_penalty", "presence_penalty", "logit_bias", "tools",
                  "functions", "tool_choice", "function_call", "response_format"):
        body.pop(field, None)
    if body.get("top_logprobs"):
        body["logprobs"] = True
    if "prompt" in body:
        body["prompt"] = (body["prompt"] if isinstance(body["prompt"], str) else "") + " w5 w6"
    for message in body.get("messages", []):
        for field in ("tool_calls", "tool_call_id", "function_call", "name"):  # the tiny template writes no name
            message.pop(field, None)
        message["role"] = "user" if message["role"] == "tool" else message["role"]
        parts = message.get("content") if isinstance(message.get("content"), list) else []
        text = "".join(p["text"] for p in parts if p.get("type") == "text") if parts else message.get("content") or ""
        message["content"] = text + " w7"
    if "messages" in body and not body["messages"]:
        body["messages"] = [{"role": "user", "content": "w8"}]
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_get_no_500_and_no_hang(server, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures, statuses, refusals = [], {}, {}
    positive = mode == GenerationMode.POSITIVE
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a GET without parameters has no invalid form

        @given(case=st.tuples(operation.as_strategy(generation_mode=mode), st.booleans() if positive else st.just(False)).map(steered))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(base_url=server.url, timeout=30)  # a hang fails here
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {json.dumps(case.body)} -> {response.status_code} {response.text[:300]}")
            elif response.status_code >= 400:
                error = response.json().get("error", {})
                assert set(error) == {"message", "type", "param", "code"}, response.text
                refusals[error["message"][:60]] = refusals.get(error["message"][:60], 0) + 1

        check()
    print(mode.value, "statuses:", dict(sorted(statuses.items())), "most common refusals:",
          sorted(refusals.items(), key=lambda kv: -kv[1])[:8])
    assert not failures, failures
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > EXAMPLES // 2, statuses  # the fuzz reached the engine, not only the validators
    else:
        assert set(statuses) <= {400, 413}, statuses  # invalid bodies are refused, none is served
    assert server.service.alive
