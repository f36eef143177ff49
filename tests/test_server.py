"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""

import asyncio
import logging
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from specdecode import ModelDrafter, SpecDecoder
from specdecode.server import Service
from specdecode.server.run import log_to_stderr
from replay import simulate_costs
from serving import MODEL, RunningServer, free_port, held_steps, metric


@pytest.fixture(scope="module")
def server(target, near_draft, tokenizer):
    service = Service(target, tokenizer, ModelDrafter(near_draft), model_name=MODEL, k=4, adaptive=True, max_batch=8)
    # Tiny models: a draft step costs a target pass, so the on/off gate would keep drafting off; these tests are
    # about serving speculation, priced on a machine where it pays (batches still decide by the load-aware rule).
    simulate_costs(service.engine)
    with RunningServer(service) as running:
        yield running


@pytest.fixture(scope="module")
def solo(target, near_draft, tokenizer):
    """The same request run alone, through the single-sequence engine."""
    decoder = SpecDecoder(target, tokenizer, ModelDrafter(near_draft), k=4)

    def run(prompt, max_tokens, chat=False):
        return decoder.generate(prompt, chat=chat, max_new_tokens=max_tokens).text

    return run


def prompt_of(i: int) -> str:
    return " ".join(f"w{2 + (i * 7 + j * 13) % 90}" for j in range(3 + i % 5))


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["speculation"] == "load-aware"


def test_completion_equals_solo_and_fills_usage(server, solo, tokenizer):
    out = server.client().completions.create(model=MODEL, prompt=prompt_of(1), max_tokens=12, temperature=0)
    assert out.choices[0].text == solo(prompt_of(1), 12)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(tokenizer(prompt_of(1))["input_ids"])
    assert 0 < out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_equals_the_whole(server, solo):
    chunks = list(server.client().completions.create(model=MODEL, prompt=prompt_of(2), max_tokens=15, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == solo(prompt_of(2), 15)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert len(chunks) > 2  # pieces arrived as they were accepted, not all at the end


def test_chat_completion_plain_and_streamed(server, solo):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": prompt_of(3)}]
    expected = solo(messages, 10, chat=True)
    out = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    stream = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_sixteen_concurrent_greedy_requests_each_equal_solo(server, solo):
    async def one(client, i):
        if i % 2:
            messages = [{"role": "user", "content": prompt_of(i)}]
            out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8 + i, temperature=0)
            return out.choices[0].message.content
        if i % 4 == 0:
            stream = await client.completions.create(model=MODEL, prompt=prompt_of(i), max_tokens=8 + i, temperature=0, stream=True)
            return "".join([c.choices[0].text async for c in stream])
        out = await client.completions.create(model=MODEL, prompt=prompt_of(i), max_tokens=8 + i, temperature=0)
        return out.choices[0].text

    async def all_of_them(held):
        client = server.async_client()
        calls = [asyncio.create_task(one(client, i)) for i in range(16)]
        await held.arrived(16)  # all sent before the first step: it admits 8 rows, the rest join as rows finish
        held.release()
        return await asyncio.gather(*calls)

    solo_passes_before = metric(server, "specdecode_batch_rows_bucket", 'le="1.0"')
    passes_before = metric(server, "specdecode_batch_rows_count")
    with held_steps(server.service) as held:
        texts = asyncio.run(all_of_them(held))
    for i, text in enumerate(texts):
        prompt = [{"role": "user", "content": prompt_of(i)}] if i % 2 else prompt_of(i)
        assert text == solo(prompt, 8 + i, chat=bool(i % 2)), f"request {i}"
    shared = (metric(server, "specdecode_batch_rows_count") - passes_before) - (
        metric(server, "specdecode_batch_rows_bucket", 'le="1.0"') - solo_passes_before)
    assert shared > 0  # some verify passes carried several requests


BAD = [
    ("completions", dict(prompt=""), "prompt"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "user", "content": ""}]), "empty"),
    ("completions", dict(prompt="w5", max_tokens=0), "max_tokens"),
    ("completions", dict(prompt="w5", max_tokens=100_000), "context window"),
    ("completions", dict(prompt="w5", temperature=-0.5), "temperature"),
    ("completions", dict(prompt="w5", top_p=0), "top_p"),
    ("chat", dict(messages=[{"role": "user", "content": "w5"}], top_p=1.5), "top_p"),
    ("completions", dict(prompt="w5", model="gpt-4o"), "unknown model"),
]


def test_bad_requests_get_400_and_do_not_disturb_a_running_request(server, solo):
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt=prompt_of(5), max_tokens=40, temperature=0, stream=True)
    pieces = [next(iter(stream)).choices[0].text]  # a request is running beside the bad ones
    for endpoint, kwargs, named in BAD:
        kwargs = {"model": MODEL, **kwargs}
        with pytest.raises(openai.BadRequestError) as error:
            if endpoint == "chat":
                client.chat.completions.create(**kwargs)
            else:
                client.completions.create(**kwargs)
        assert named in str(error.value), (kwargs, str(error.value))
    raw = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "w5", "max_tokens": ', headers={"content-type": "application/json"})
    assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == solo(prompt_of(5), 40)
    assert client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=3, temperature=0).usage.completion_tokens > 0


def test_disconnect_mid_stream_frees_the_slot(server, monkeypatch):
    service = server.service
    cancelled = metric(server, "specdecode_finished_requests_total", 'reason="cancelled"')
    # The tiny model can decode all 400 tokens in ~0.3 s, about when the hang-up is first looked for (every
    # DISCONNECT_POLL_S): its steps are slowed so that the request is still running when the server notices.
    step = service.engine.step
    monkeypatch.setattr(service.engine, "step", lambda: (time.sleep(0.02), step())[1])
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": MODEL, "prompt": prompt_of(6), "max_tokens": 400, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # one piece, then hang up
    deadline = time.time() + 20
    while service.engine.rows or service.engine.waiting:
        assert time.time() < deadline, "the abandoned request still holds its row"
        time.sleep(0.1)
    assert metric(server, "specdecode_finished_requests_total", 'reason="cancelled"') == cancelled + 1
    out = server.client().completions.create(model=MODEL, prompt="w3", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens > 0


def test_metrics_counters_move(server):
    names = ["specdecode_generation_tokens_total", "specdecode_draft_tokens_total", "specdecode_accepted_tokens_total",
             "specdecode_prompt_tokens_total", "specdecode_admit_seconds_count"]
    before = {n: metric(server, n) for n in names}
    ok_before = metric(server, "specdecode_requests_total", 'endpoint="/v1/completions",status="200"')
    bad_before = metric(server, "specdecode_requests_total", 'endpoint="/v1/completions",status="400"')
    out = server.client().completions.create(model=MODEL, prompt=prompt_of(7), max_tokens=20, temperature=0)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="w3", max_tokens=-1)
    after = {n: metric(server, n) for n in names}
    assert after["specdecode_generation_tokens_total"] - before["specdecode_generation_tokens_total"] == out.usage.completion_tokens
    assert after["specdecode_prompt_tokens_total"] - before["specdecode_prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["specdecode_draft_tokens_total"] > before["specdecode_draft_tokens_total"]
    assert after["specdecode_accepted_tokens_total"] > before["specdecode_accepted_tokens_total"]  # the near draft is right often
    assert after["specdecode_admit_seconds_count"] - before["specdecode_admit_seconds_count"] == 1  # one prefill, in one step
    assert metric(server, "specdecode_requests_total", 'endpoint="/v1/completions",status="200"') == ok_before + 1
    assert metric(server, "specdecode_requests_total", 'endpoint="/v1/completions",status="400"') == bad_before + 1
    text = httpx.get(server.url + "/metrics").text
    for kind in ("draft", "accepted"):  # every drafted (accepted) token is counted under the source that drafted it
        by_source = [float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith(f"specdecode_{kind}_tokens_by_source_total{{source=")]
        assert by_source and sum(by_source) == metric(server, f"specdecode_{kind}_tokens_total")
    for name in ("specdecode_queue_length", "specdecode_draft_tokens_by_position_total", "specdecode_verify_seconds_bucket",
                 "specdecode_draft_seconds_bucket", "specdecode_speculation_on", "specdecode_step_seconds_bucket",
                 "specdecode_admit_seconds_bucket"):
        assert name in text
    steps_s = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdecode_step_seconds_sum{"))
    assert 0 < metric(server, "specdecode_scheduler_between_steps_seconds_total") < steps_s
    calibrated = server.service.engine.calibration["verify_s"]  # the prices the controller started from, by width
    assert len(calibrated) >= 4
    for width, seconds in calibrated.items():
        assert metric(server, "specdecode_calibrated_pass_seconds", f'width="{width}"') == pytest.approx(seconds, rel=1e-6)


def test_a_finished_request_says_what_it_read_made_and_drafted_in_one_line(server, caplog):
    with caplog.at_level(logging.INFO, logger="specdecode.server"):
        out = server.client().completions.create(model=MODEL, prompt=prompt_of(9), max_tokens=16, temperature=0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request done")]
    assert len(lines) == 1
    found = re.match(r"request done \((length|stop)\): prompt (\d+) tokens \((\d+) cached\), (\d+) new in [\d.]+ s "
                     r"\(first after [\d.]+ s, (\d+) steps\), (drafted (\d+), accepted (\d+)|nothing drafted)", lines[0])
    assert found, lines[0]
    assert found[1] == out.choices[0].finish_reason
    assert (int(found[2]), int(found[4])) == (out.usage.prompt_tokens, out.usage.completion_tokens)
    assert int(found[3]) == out.usage.prompt_tokens_details.cached_tokens
    logger = logging.getLogger("specdecode")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:  # `specdecode serve --log-level` gives the server's own lines a handler of their own, once
        log_to_stderr("info")
        log_to_stderr("warning")
        assert len(logger.handlers) == len(handlers) + 1 and logger.level == logging.WARNING and not logger.propagate
    finally:
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_each_step_says_what_it_read_drafted_and_cost_at_debug_level(server, caplog):
    """`--log-level debug`: one line a step, whose tokens add up to the request's (read, made)."""
    with caplog.at_level(logging.DEBUG, logger="specdecode.server"):
        out = server.client().completions.create(model=MODEL, prompt=prompt_of(12), max_tokens=12, temperature=0)
    steps = [re.match(r"step: (\d+) rows x (\d+) wide, read (\d+) \((\d+) in the pass, (\d+) cached\), joined (\d+), "
                      r"drafted (\d+), accepted (\d+)(?: \[.*\])?, cap \S+; \d+ ms \(draft \d+, pass \d+\); \d+ rows, "
                      r"\d+ waiting$", r.getMessage())
             for r in caplog.records if r.getMessage().startswith("step:")]
    assert steps and all(steps), [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    read, cached, joined = (sum(int(m[i]) for m in steps) for i in (3, 5, 6))
    assert joined == 1 and read + cached == out.usage.prompt_tokens
    # each pass makes one token a row and the accepted drafts; the first token comes from the reading
    made = 1 + sum(int(m[1]) + int(m[8]) for m in steps if int(m[1]))
    assert made == out.usage.completion_tokens
    assert all(int(m[8]) <= int(m[7]) for m in steps)


def test_full_queue_answers_429_not_a_hang(target, tokenizer):
    """With steps held, the first request waits in the queue and fills it: the five after it are refused at once."""
    service = Service(target, tokenizer, None, model_name=MODEL, max_batch=1, max_queue=1)
    with RunningServer(service) as running, held_steps(service) as held:
        async def burst():
            client = running.async_client()
            call = lambda i: client.completions.create(model=MODEL, prompt=prompt_of(i), max_tokens=60, temperature=0)  # noqa: E731
            first = asyncio.create_task(call(0))
            await held.arrived(1)
            rest = await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(1, 6)), return_exceptions=True), 60)
            held.release()
            return [await asyncio.wait_for(first, 120), *rest]

        results = asyncio.run(burst())
    busy = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert not isinstance(results[0], Exception) and len(busy) == 5, results
    assert all("max_queue" in str(r) for r in busy)


def test_load_benchmark_against_two_endpoints(server, tmp_path):
    from specdecode.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4 w5\nw9 w8 w7 w6\nw20 w30\n")
    out = tmp_path / "load"
    code = main(["bench", "--endpoint", f"a={server.url}", "--endpoint", f"b={server.url}", "--concurrency", "1,3",
                 "--requests", "3", "--rounds", "1", "--max-new-tokens", "6", "--prompts", str(prompts), "--out", str(out)])
    assert code == 0
    import json

    rows = json.loads((out / "load.json").read_text())["rows"]
    assert [(r["label"], r["concurrency"]) for r in rows] == [("a", 1), ("b", 1), ("a", 3), ("b", 3)]
    for r in rows:
        assert r["requests"] == 3 and r["errors"] == 0
        assert 0 < r["output_tokens"] <= 18 and r["output_tokens_per_s"] > 0
        assert r["ttft_p50"] <= r["latency_p50"]
        # send times, for a replay in the order sent: one at a time, each after the one before ended; three at once
        sent = sorted(x["sent_s"] for x in r["raw"])
        ends = sorted(x["sent_s"] + x["latency_s"] for x in r["raw"])
        if r["concurrency"] == 1:
            assert all(later >= end for later, end in zip(sent[1:], ends))
        else:
            assert sent[-1] < ends[0]
    assert (out / "load.png").stat().st_size > 0 and "| a | 3 |" in (out / "load.md").read_text()


def test_chat_traffic_resends_the_history_and_the_server_serves_it_from_cache(server, tmp_path):
    """`--traffic chat`: each turn re-sends the conversation so far (with the answers), TTFT is reported by turn, and
    the server reads the history from its prefix cache, not again (/metrics and usage say how many tokens)."""
    from specdecode.backends.prefix import MIN_SHARED
    from specdecode.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20\nw9 w8 w7 w6\nw20 w30\n")
    out = tmp_path / "chat"
    cached_before = metric(server, "specdecode_prompt_tokens_cached_total")
    assert main(["bench", "--endpoint", f"a={server.url}", "--traffic", "chat", "--turns", "3", "--concurrency", "1",
                 "--requests", "2", "--rounds", "1", "--max-new-tokens", "6", "--prompts", str(prompts),
                 "--out", str(out)]) == 0
    import json

    row, = json.loads((out / "load.json").read_text())["rows"]
    assert row["requests"] == 6 and row["errors"] == 0 and row["turns"] == 3
    assert [r["turn"] for r in row["raw"]] == [0, 1, 2, 0, 1, 2]
    raw = row["raw"]
    assert all(r["prompt_tokens"] > 0 for r in raw)
    # a turn holds the last turn's prompt, read from the cache (where that is long enough to be served from it)
    pairs = [(earlier, later) for earlier, later in zip(raw, raw[1:]) if later["turn"]]
    assert all(later["prompt_tokens"] > earlier["prompt_tokens"] for earlier, later in pairs)
    served = [(e, l) for e, l in pairs if e["prompt_tokens"] > MIN_SHARED]
    assert served and all(later["cached_tokens"] >= earlier["prompt_tokens"] - 1 for earlier, later in served)
    assert len(row["ttft_p50_by_turn"]) == 3 and "turn 3" in (out / "load.md").read_text()
    # turns 2 and 3 of two conversations: at least the 18-token first prompt each time
    assert metric(server, "specdecode_prompt_tokens_cached_total") - cached_before >= 4 * 16
    history = [{"role": "user", "content": " ".join(f"w{i}" for i in range(60, 40, -1))}]  # a new conversation
    first = server.client().chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "w5"}]
    second = server.client().chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 16 <= second.usage.prompt_tokens_details.cached_tokens


def test_repeat_traffic_asks_each_prompt_again_after_its_first_ask(server, tmp_path):
    """`--traffic repeat`: a level's requests are its first half of prompts, then the same again in order (one at a
    time: each repeat after its first ask), and a repeat's prompt is served from the prefix cache."""
    import json

    from specdecode.bench.load import repeat_requests
    from specdecode.cli import main

    asks = [[{"role": "user", "content": f"p{i}"}] for i in range(7)]
    assert [m[0]["content"] for m in repeat_requests(asks, 4)] == ["p0", "p1", "p0", "p1", "p2", "p3", "p2", "p3",
                                                                    "p4", "p5", "p4", "p5"]
    assert [m[0]["content"] for m in repeat_requests(asks, 3)][:6] == ["p0", "p1", "p0", "p2", "p3", "p2"]
    with pytest.raises(ValueError, match="at least 4 prompts"):
        repeat_requests(asks[:3], 8)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(" ".join(f"w{i + j}" for j in range(20)) + "\n" for i in range(0, 40, 10)))
    out = tmp_path / "repeat"
    assert main(["bench", "--endpoint", f"a={server.url}", "--traffic", "repeat", "--concurrency", "1",
                 "--requests", "4", "--rounds", "1", "--max-new-tokens", "6", "--prompts", str(prompts),
                 "--out", str(out)]) == 0
    row, = json.loads((out / "load.json").read_text())["rows"]
    assert row["requests"] == 4 and row["errors"] == 0
    first, second, again_first, again_second = row["raw"]
    for ask, again in ((first, again_first), (second, again_second)):
        assert again["prompt_tokens"] == ask["prompt_tokens"] and again["cached_tokens"] >= ask["prompt_tokens"] - 1
    # /metrics says what the cache holds: at least these two prompts (with their answers), every one put back
    assert metric(server, "specdecode_prefix_cache_entries") >= 2
    assert metric(server, "specdecode_prefix_cache_tokens") >= first["prompt_tokens"] + second["prompt_tokens"]
    assert metric(server, "specdecode_prefix_cache_restore_failures") == 0


def test_load_benchmark_counts_errors(tmp_path):
    from specdecode.bench.load import run_load

    rows = run_load({"nothing": f"http://127.0.0.1:{free_port()}"}, [[{"role": "user", "content": "w3"}]], [1], 2, 4, model="x")
    assert rows[0]["errors"] == 4 and rows[0]["output_tokens"] == 0  # 2 requests x 2 rounds


def test_load_runs_pool_into_one_report(tmp_path, monkeypatch, capsys):
    """Servers measured one at a time (one run each, alternating) pool per label and level, keeping each round's rate."""
    import json

    import specdecode.bench.load as load
    from specdecode.cli import main

    async def fake_level(url, *args):  # endpoint "slow" makes 5 tokens a second, "fast" 10; rounds add wall time
        seconds = {"slow": 1.0, "fast": 0.5}[url] * (1 + len(runs))
        return load.LevelResult(url, args[2], seconds, [load.RequestResult(ok=True, latency_s=seconds, completion_tokens=5)])

    monkeypatch.setattr(load, "run_level", fake_level)
    runs = []
    (tmp_path / "p.txt").write_text("w1\n")
    for label in ("slow", "fast", "fast", "slow"):
        out = tmp_path / f"run{len(runs)}"
        assert main(["bench", "--endpoint", f"{label}={label}", "--concurrency", "1,4", "--requests", "1", "--rounds", "1",
                     "--prompts", str(tmp_path / "p.txt"), "--out", str(out)]) == 0
        runs.append(out)
    assert main(["bench", "--pool", *map(str, runs), "--out", str(tmp_path / "pooled")]) == 0
    rows = json.loads((tmp_path / "pooled" / "load.json").read_text())["rows"]
    assert [(r["label"], r["concurrency"], r["requests"], r["rounds"]) for r in rows] == [
        ("slow", 1, 2, 2), ("fast", 1, 2, 2), ("slow", 4, 2, 2), ("fast", 4, 2, 2)]
    slow = rows[0]
    assert slow["round_tokens_per_s"] == [5.0, 5.0 / 4]  # runs 1 and 4
    assert slow["output_tokens_per_s"] == pytest.approx(10 / (1.0 + 4.0))  # pooled: tokens over summed wall time
    assert "1.25–5.00" in (tmp_path / "pooled" / "load.md").read_text()
    # each round against the baseline's (the level's first label) of the same round: runs 2 / 1 and 3 / 4
    fast = rows[1]
    assert fast["vs_baseline"] == "slow" and fast["vs_baseline_by_round"] == pytest.approx([1.0, (5 / 1.5) / 1.25])
    assert fast["p99_vs_baseline_by_round"] == pytest.approx([1.0, 1.5 / 4.0])  # each round's slowest request
    assert "vs_baseline" not in slow
    assert "1.833x (1.000–2.667)" in (tmp_path / "pooled" / "load.md").read_text()
    assert main(["bench", "--pool", str(tmp_path), "--out", str(tmp_path / "x")]) != 0  # not a run directory
    assert "no load.json" in capsys.readouterr().err


def test_load_levels_take_their_prompts_one_task_after_another():
    from specdecode.bench.load import tasks_in_turn
    from specdecode.prompts import Prompt, load_prompts

    prompts = [Prompt(str(i), task, f"{task}{i}") for i, task in enumerate("aaabcc")]
    assert [p.text for p in tasks_in_turn(prompts)] == ["a0", "b3", "c4", "a1", "c5", "a2"]
    shipped = load_prompts("specbench", per_task=4)
    mixed = tasks_in_turn(shipped)
    assert sorted(mixed, key=lambda p: p.id) == sorted(shipped, key=lambda p: p.id)  # every prompt, once
    tasks = {p.task for p in shipped}
    assert all({p.task for p in mixed[i : i + len(tasks)]} == tasks for i in range(0, len(mixed), len(tasks)))


def test_load_rounds_reverse_the_endpoint_order(monkeypatch):
    import specdecode.bench.load as load

    seen, firsts = [], []

    async def fake_level(url, *args):
        seen.append(url)
        firsts.append(args[-2])  # run_level(url, model, prompts, concurrency, ..., first, turns)
        return load.LevelResult(url, args[2], 1.0, [load.RequestResult(ok=True, latency_s=1.0, completion_tokens=5)])

    monkeypatch.setattr(load, "run_level", fake_level)
    rows = load.run_load({"a": "A", "b": "B", "c": "C"}, [], [1, 4], 1, 8, rounds=2)
    assert seen == ["A", "B", "C", "C", "B", "A"] * 2
    assert firsts == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3  # the same prompts for every endpoint, fresh ones each time
    assert [(r["label"], r["concurrency"], r["requests"], r["output_tokens"]) for r in rows] == [
        (x, c, 2, 10) for c in (1, 4) for x in ("a", "b", "c")]
