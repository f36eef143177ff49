"""Load benchmark of any OpenAI-compatible server: concurrent streaming chat requests at several
concurrency levels; time to first token, inter-token latency, request latency, output tokens/s, errors.

Traffic: fresh prompts (each request a new prompt), chat (each client holds a conversation of `turns` turns, every
turn re-sending the history, its answers and a new user turn: TTFT by turn shows whether a server re-reads the
history), agent (requests sharing one long prefix, a file, each asking for an edit of a part of it), or repeat (each
prompt asked twice, the second time after the first was sent: a client asking again, a retry, an agent re-running a
step; the second ask can be served from the prompt cache and drafted from the first answer).

Bounded: at most `requests` requests (chat: conversations) per level and round, and no new request starts after
`time_limit` seconds.
Several endpoints are measured level by level, one after the other; with rounds = 2 (the default) each level runs
them in order and then in reverse order and pools both, so no endpoint always runs right after a heavy one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    completion_tokens: int = 0
    itl_s: float = 0.0  # mean inter-token latency after the first token
    error: str = ""
    turn: int = 0  # of its conversation (chat traffic), from 0
    prompt_tokens: int = 0  # as the server's usage reports them
    cached_tokens: int | None = None  # of them, served from its prompt cache (None: not reported)
    sent_s: float = 0.0  # when it was sent, seconds after its level began (a replay's arrival order and times)


@dataclass
class LevelResult:
    endpoint: str
    concurrency: int
    wall_s: float
    requests: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.requests if r.ok]
        tokens = sum(r.completion_tokens for r in ok)

        def pct(values, q):
            return float(np.percentile(values, q)) if values else None

        lat, ttft, itl = [r.latency_s for r in ok], [r.ttft_s for r in ok], [r.itl_s for r in ok if r.completion_tokens > 1]
        turns = max((r.turn for r in self.requests), default=0) + 1
        ttft_by_turn = [pct([r.ttft_s for r in ok if r.turn == t], 50) for t in range(turns)]
        return dict(
            turns=turns, ttft_p50_by_turn=ttft_by_turn,
            endpoint=self.endpoint, concurrency=self.concurrency, requests=len(self.requests), errors=len(self.requests) - len(ok),
            output_tokens=tokens, wall_s=self.wall_s, output_tokens_per_s=tokens / self.wall_s if self.wall_s else 0.0,
            latency_p50=pct(lat, 50), latency_p90=pct(lat, 90), latency_p99=pct(lat, 99),
            ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), itl_p50=pct(itl, 50), itl_p99=pct(itl, 99),
        )


def tasks_in_turn(prompts: list) -> list:
    """Prompts (anything with a `.task`) taken one task after another, round-robin in the order the tasks first
    appear: every level and round takes the next `requests` of them, so each gets a mix of tasks (a set listed by
    task gave one level all its long summaries and another all its short answers)."""
    by_task: dict[str, list] = {}
    for prompt in prompts:
        by_task.setdefault(prompt.task, []).append(prompt)
    queues = list(by_task.values())
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def agent_requests(texts: list[str]) -> list[list[dict]]:
    """Requests that share a long prefix: every prompt's code as one file, then one prompt (its instruction and the
    part of the file it is about), as an agent re-sending its context with each edit request does."""
    code = [text.partition("\n\n")[2] or text for text in texts]
    shared = "Here is a file of our project.\n\n" + "\n\n".join(code)
    return [[{"role": "user", "content": f"{shared}\n\n{text}"}] for text in texts]


def repeat_requests(prompts: list[list[dict]], requests: int) -> list[list[dict]]:
    """Blocks of `requests` requests (one level and round each): the block's ceil(requests / 2) prompts, then as many
    of them again, in the same order, so each repeat is sent after its first ask."""
    fresh = -(-requests // 2)
    blocks = [prompts[i : i + fresh] for i in range(0, len(prompts) - fresh + 1, fresh)]
    if not blocks:
        raise ValueError(f"repeat traffic needs at least {fresh} prompts for {requests} requests, got {len(prompts)}")
    return [p for block in blocks for p in block + block[: requests - fresh]]


async def _one(client, model: str, messages: list[dict], max_tokens: int, temperature: float) -> tuple[RequestResult, str]:
    start = time.perf_counter()
    first = last = None
    pieces = tokens = prompt_tokens = 0
    cached = None
    text = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or now
                last = now
                pieces += 1
                text.append(chunk.choices[0].delta.content)
            if getattr(chunk, "usage", None):
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", None)
    except Exception as error:  # counted, not raised: a load test reports errors
        return RequestResult(ok=False, latency_s=time.perf_counter() - start, error=f"{type(error).__name__}: {error}"[:300]), ""
    end = time.perf_counter()
    tokens = tokens or pieces  # servers that do not report usage: count streamed pieces
    itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else 0.0
    result = RequestResult(ok=True, ttft_s=(first or end) - start, latency_s=end - start, completion_tokens=tokens, itl_s=itl,
                           prompt_tokens=prompt_tokens, cached_tokens=cached)
    return result, "".join(text)


async def run_level(url: str, model: str | None, prompts: list[list[dict]], concurrency: int, requests: int,
                    max_tokens: int, temperature: float, time_limit: float, progress=None, first: int = 0,
                    turns: int = 1) -> LevelResult:
    """`requests` requests, `concurrency` at a time, on prompts[first], prompts[first + 1], ... (cycling). turns > 1:
    each is a conversation; turn t re-sends the history with its answers and the user turn of the t-th next prompt."""
    import openai

    import httpx

    # A fresh connection per request: llama-server (cpp-httplib) closes a kept-alive connection after its 5th request,
    # and the 6th, sent on it, failed as a connection error that no server-side fault caused. No retries: a server's
    # error counts.
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                                timeout=max(60.0, time_limit * 2), http_client=http)
    if model is None:
        model = (await client.models.list()).data[0].id
    queue = list(range(requests))
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def worker():
        while queue and time.perf_counter() - start < time_limit:
            i = queue.pop(0)
            messages = list(prompts[(first + i) % len(prompts)])
            for turn in range(turns):
                sent = time.perf_counter() - start
                result, answer = await _one(client, model, messages, max_tokens, temperature)
                result.turn, result.sent_s = turn, sent
                results.append(result)
                if progress:
                    progress(1)
                if not result.ok:
                    break
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": prompts[(first + i + turn + 1) % len(prompts)][-1]["content"]}]

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return LevelResult(url, concurrency, wall, results)


def run_load(endpoints: dict[str, str], prompts: list[list[dict]], concurrency: list[int], requests: int, max_tokens: int,
             temperature: float = 0.0, time_limit: float = 600.0, model: str | None = None, progress=None,
             rounds: int = 2, turns: int = 1) -> list[dict]:
    """For each concurrency level, each endpoint in turn (reversed on every other round); returns one summary dict
    per (endpoint, level) over all its rounds. Every endpoint gets the same prompts at a level and round; each level
    and round moves on to the next prompts, so with enough of them no request repeats an earlier one (a server's
    prompt cache, or a lookup drafter that remembers earlier answers, would otherwise be measured on repeats)."""
    rows = []
    for li, c in enumerate(concurrency):
        per_round: dict[str, list[LevelResult]] = {label: [] for label in endpoints}
        for r in range(rounds):
            order = list(endpoints) if r % 2 == 0 else list(reversed(endpoints))
            first = (li * rounds + r) * requests
            for label in order:
                per_round[label].append(asyncio.run(run_level(endpoints[label], model, prompts, c, requests, max_tokens,
                                                              temperature, time_limit, progress, first, turns)))
        rows += [pooled_row(label, levels) for label, levels in per_round.items()]
    return rows


def pooled_row(label: str, levels: list[LevelResult]) -> dict:
    """One endpoint at one level over several rounds: requests pooled, wall times summed; each round's
    throughput kept too, so a report can show the spread."""
    pooled = LevelResult(levels[0].endpoint, levels[0].concurrency, sum(level.wall_s for level in levels))
    for level in levels:
        pooled.requests += level.requests
    summary = pooled.summary()
    summary["label"] = label
    summary["rounds"] = len(levels)
    per_round = [level.summary() for level in levels]
    summary["round_tokens_per_s"] = [one["output_tokens_per_s"] for one in per_round]
    summary["round_latency_p99"] = [one["latency_p99"] for one in per_round]
    summary["errors_sample"] = [r.error for r in pooled.requests if not r.ok][:3]
    summary["raw"] = [asdict(r) for r in pooled.requests]
    return summary


def pool_runs(runs: list[dict]) -> list[dict]:
    """Pool several load runs (their load.json contents) per endpoint label and level: e.g. servers measured
    one at a time, each run holding one of them, alternating order between rounds."""
    levels: dict[tuple[str, int], list[LevelResult]] = {}
    per_round = {"round_tokens_per_s": "output_tokens_per_s", "round_latency_p99": "latency_p99"}  # -> a run's pooled
    rounds: dict[tuple[str, int], dict[str, list[float]]] = {}
    for run in runs:
        for row in run["rows"]:
            key = (row["label"], row["concurrency"])
            levels.setdefault(key, []).append(
                LevelResult(row["endpoint"], row["concurrency"], row["wall_s"], [RequestResult(**r) for r in row["raw"]]))
            for name, pooled in per_round.items():
                rounds.setdefault(key, {}).setdefault(name, []).extend(row.get(name) or [row[pooled]])
    rows = []
    for key in sorted(levels, key=lambda key: key[1]):  # by level; labels in first-seen order (sort is stable)
        row = pooled_row(key[0], levels[key]) | rounds[key]
        row["rounds"] = len(rounds[key]["round_tokens_per_s"])
        rows.append(row)
    return rows


def add_round_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tok/s and p99 latency against the level's first endpoint (the baseline), round by round:
    `vs_baseline` (the baseline's label), `vs_baseline_by_round` and `p99_vs_baseline_by_round`. Rounds are paired by
    index, so servers measured in the same minutes are compared with each other; the machine's drift between rounds
    cancels."""

    def ratios(row, base, key):
        mine, theirs = row.get(key) or [], base.get(key) or []
        if mine and len(mine) == len(theirs) and all(mine) and all(theirs):
            return [a / b for a, b in zip(mine, theirs)]
        return None

    baselines: dict[int, dict] = {}
    for row in rows:
        base = baselines.setdefault(row["concurrency"], row)
        if base is not row and (by_round := ratios(row, base, "round_tokens_per_s")):
            row["vs_baseline"], row["vs_baseline_by_round"] = base["label"], by_round
            row["p99_vs_baseline_by_round"] = ratios(row, base, "round_latency_p99")
    return rows


def load_markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Load benchmark", "", f"`{command}`", "",
        "| endpoint | concurrency | requests | errors | output tok/s | per round (min–max) | tok/s vs first, round by round: "
        "median (min–max) | latency p50 s | p90 s | p99 s | p99 vs first, round by round | TTFT p50 s | TTFT p99 s | "
        "ITL p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, scale=1.0, digits=2):
        return "-" if x is None else f"{x * scale:.{digits}f}"

    def spread(rates):
        return "-" if not rates or len(rates) < 2 else f"{min(rates):.2f}–{max(rates):.2f}"

    def versus(ratios):
        if not ratios:
            return "-"
        middle = f"{float(np.median(ratios)):.3f}x"
        return middle if len(ratios) < 2 else f"{middle} ({min(ratios):.3f}–{max(ratios):.3f})"

    for r in rows:
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {f(r['output_tokens_per_s'])} | "
            f"{spread(r.get('round_tokens_per_s'))} | {versus(r.get('vs_baseline_by_round'))} | {f(r['latency_p50'])} | "
            f"{f(r['latency_p90'])} | {f(r['latency_p99'])} | {versus(r.get('p99_vs_baseline_by_round'))} | "
            f"{f(r['ttft_p50'])} | {f(r['ttft_p99'])} | {f(r['itl_p50'], 1000, 0)} |"
        )
    chats = [r for r in rows if r.get("turns", 1) > 1]
    if chats:
        turns = max(r["turns"] for r in chats)
        lines += ["", "Conversations: time to first token by turn (p50, s); every turn re-sends the whole history.", "",
                  "| endpoint | concurrency | " + " | ".join(f"turn {t + 1}" for t in range(turns)) + " |",
                  "|---|---:|" + "---:|" * turns]
        for r in chats:
            by_turn = [f(x) for x in r["ttft_p50_by_turn"]] + ["-"] * (turns - r["turns"])
            lines.append(f"| {r['label']} | {r['concurrency']} | " + " | ".join(by_turn) + " |")
    return "\n".join(lines) + "\n"


def load_plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        levels = [r["concurrency"] for r in mine]
        ax1.plot(levels, [r["output_tokens_per_s"] for r in mine], marker="o", label=label)
        ax2.plot(levels, [r["latency_p50"] or 0 for r in mine], marker="o", label=f"{label} p50")
        ax2.plot(levels, [r["latency_p99"] or 0 for r in mine], marker="x", linestyle="--", label=f"{label} p99")
    ax1.set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="request latency (s)", title="latency")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
