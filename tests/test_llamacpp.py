"""The llama.cpp backend (SmolLM2-135M's GGUF): the engine's output is llama.cpp's own greedy output with every
drafter, rows batched as sequence ids equal each row alone, sampling stays lossless, and a wrong rollback shows."""

import pytest
import torch

from specdecode import ModelDrafter, NgramDrafter, SamplingParams, SpeculativeEngine, SuffixDrafter
from specdecode.backends import BackendError, choose_backend
from specdecode.backends.llamacpp import LlamaCppBackend, LlamaModel
from specdecode.batch import BatchEngine
from specdecode.control import AdaptiveK
from specdecode.check import first_difference, top2_gap
from specdecode.models import load_model, load_tokenizer
from specdecode.drafters.factory import make_llama_drafter
from specdecode.drafters.suffix import ContextChains
from stats_check import fit
from tiny import keep_one_stale_entry, tiny_model

NEW_TOKENS = 24
SMOL_NEAR_TIE = 0.1  # SmolLM2's GGUF: batched rows differed from a row alone at a top-2 gap of 0.007 at most
TEXTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are red, yellow and",
    "Translate to French: The cat sits on the mat. The cat sits on the mat. The dog",
]


@pytest.fixture(scope="module")
def smol_gguf(smol_q4_0):
    return LlamaModel(smol_q4_0)


@pytest.fixture(scope="module")
def backend(smol_gguf):
    return LlamaCppBackend(smol_gguf, threads=2)


@pytest.fixture(scope="module")
def cold(smol_gguf):
    """A row read from scratch every time (no prefix cache): where top-2 gaps are measured."""
    return LlamaCppBackend(smol_gguf, threads=2, prefix_cache=False)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer("smollm2-135m")
    return [tokenizer(text, return_tensors="pt").input_ids for text in TEXTS]


@pytest.fixture(scope="module")
def references(backend, prompts):
    """llama.cpp's own greedy decoding: one token per pass."""
    plain = SpeculativeEngine(backend, None)
    return [plain.generate(p, max_new_tokens=NEW_TOKENS).result().token_ids for p in prompts]


@pytest.fixture(scope="module")
def drafters(smol_gguf):
    torch_smol, _ = load_model("smollm2-135m", dtype="fp32")
    return {
        "weak": ModelDrafter(tiny_model(3, vocab=49152)),  # random: nearly always rejected
        "near": ModelDrafter(torch_smol),  # the Q4_1 weights dequantized, other numerics: mostly accepted
        "self": ModelDrafter(LlamaCppBackend(smol_gguf, threads=2), name="smollm2-135m"),  # a second llama.cpp context
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(),  # llama.cpp scores no trees: its best chain
        "chain": SuffixDrafter(chains=ContextChains(context=2, shortest=2, longest=8)),  # short copies chained
    }


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("which", ["weak", "near", "self", "ngram", "suffix", "chain"])
def test_greedy_output_is_llama_cpps_own(backend, prompts, references, drafters, which, k):
    engine = SpeculativeEngine(backend, drafters[which], k=k)
    results = [engine.generate(p, max_new_tokens=NEW_TOKENS).result() for p in prompts]
    for i, result in enumerate(results):
        assert result.token_ids == references[i], f"prompt {i}, drafter {which}, k={k}"
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted > 0
    if which in ("weak", "near") and k > 1:
        assert sum(r.stats.accepted_tokens for r in results) < drafted  # rejections happened: rollback was exercised
    if which in ("weak", "near", "suffix", "chain") and k > 1:
        assert sum(r.stats.drafted_per_position[1] for r in results) > 0  # drafts of 2+ tokens
    if which == "chain" and k > 1:  # chained copies drafted, and some rejected
        chained = [sum(tally[i] for r in results for source, tally in r.stats.by_source.items()
                       if source.endswith("/chain")) for i in (1, 2)]  # this request's or an earlier one's
        assert chained[0] > chained[1] > 0, chained


def test_padded_passes_keep_the_output(backend, smol_gguf, prompts, references, drafters, monkeypatch):
    """Passes run wider than their inputs (extra positions, no logits, dropped at `keep`; where the wider pass measures
    cheaper) give llama.cpp's own greedy output; a pad cell left in the cache fails the next pass (checked below)."""
    from specdecode.control.step import FixedK

    widths = []
    forward = LlamaCppBackend.forward

    def counted(self, tokens, widths_, offsets=None, visibility=None, pad_to=0):
        widths.append((sum(widths_), pad_to))
        return forward(self, tokens, widths_, offsets, visibility, pad_to)

    monkeypatch.setattr(LlamaCppBackend, "forward", counted)
    monkeypatch.setattr(FixedK, "pass_width", lambda self, positions: positions + 3)
    engine = SpeculativeEngine(backend, drafters["chain"], k=4)
    for prompt, reference in zip(prompts, references):
        assert engine.generate(prompt, max_new_tokens=NEW_TOKENS).result().token_ids == reference
    assert all(pad_to == n + 3 for n, pad_to in widths) and any(n > 1 for n, _ in widths)
    keep = LlamaCppBackend.keep

    def leaves_the_pads(self, kept):  # mutation: a pass whose inputs are all kept leaves its pad cells
        self._padded = False
        keep(self, kept)

    monkeypatch.setattr(LlamaCppBackend, "keep", leaves_the_pads)
    mutated = SpeculativeEngine(LlamaCppBackend(smol_gguf, threads=2), drafters["chain"], k=4)
    with pytest.raises(BackendError, match="llama_decode failed"):  # llama.cpp refuses a position a pad cell holds
        for prompt in prompts:
            mutated.generate(prompt, max_new_tokens=NEW_TOKENS).result()


def test_a_stale_cache_entry_is_caught(backend, prompts, references, drafters, monkeypatch):
    """Keeping one rejected token's cell (an off-by-one in llama_memory_seq_rm) must change the output."""
    keep_one_stale_entry(monkeypatch)
    engine = SpeculativeEngine(backend, drafters["near"], k=4)
    outputs = [engine.generate(p, max_new_tokens=NEW_TOKENS).result().token_ids for p in prompts]
    assert any(out != ref for out, ref in zip(outputs, references))


def test_rows_as_sequence_ids_equal_each_row_alone(smol_gguf, cold, prompts, references):
    batched = LlamaCppBackend(smol_gguf, threads=2, max_rows=4)
    engine = BatchEngine(batched, NgramDrafter(), k=4, max_batch=4)
    budgets = [NEW_TOKENS, NEW_TOKENS // 2, NEW_TOKENS, NEW_TOKENS // 3]  # rows leave at different steps
    requests = [dict(input_ids=prompts[i % len(prompts)], max_new_tokens=b) for i, b in enumerate(budgets)]
    seqs = engine.generate_all(requests)
    identical = sum(own_or_near_tie(cold, requests[i]["input_ids"], seq.result.token_ids,
                                    references[i % len(prompts)][:budget])
                    for i, (seq, budget) in enumerate(zip(seqs, budgets)))
    assert identical >= 2
    assert batched.rows == 0


def test_rows_verifying_drafts_of_different_lengths_equal_each_row_alone(smol_gguf, cold, prompts, references,
                                                                        monkeypatch):
    """A llama.cpp batch runs each row's own positions (no padding): rows whose drafts are cut to different lengths in
    one pass must each keep only what the target accepted, as a row alone would (an off-by-one in a row's share of the
    flat batch's logits would show here)."""
    cuts = []

    def uneven(self, rows, plan, drafts):  # every other row one token at most; the decision itself is tested apart
        for i, draft in enumerate(drafts):
            draft.truncate(draft.length if i % 2 == 0 else min(draft.length, 1))
        cuts.append([draft.length for draft in drafts])

    monkeypatch.setattr(AdaptiveK, "fit", uneven)
    # every row reads its prompt cold: a repeated prompt sharing the first one's cells changes when rows join, and
    # with it which near-ties flip (sharing is tested in test_prefix_cache.py)
    engine = BatchEngine(LlamaCppBackend(smol_gguf, threads=2, max_rows=4, prefix_cache=False), NgramDrafter(), k=4,
                         adaptive=True, max_batch=4)
    requests = [dict(input_ids=prompts[i % len(prompts)], max_new_tokens=NEW_TOKENS) for i in range(4)]
    seqs = engine.generate_all(requests)
    assert any(max(c) >= 2 and len(set(c)) > 1 for c in cuts)  # long drafts beside shorter ones in one pass
    assert sum(seq.stats.accepted_tokens for seq in seqs) > 0
    identical = sum(own_or_near_tie(cold, requests[i]["input_ids"], seq.result.token_ids, references[i % len(prompts)])
                    for i, seq in enumerate(seqs))
    assert identical >= 2


def own_or_near_tie(cold, prompt: torch.Tensor, got: list[int], reference: list[int]) -> bool:
    """True where equal; where not, asserts the first difference is at a near-tie. A pass over several sequences runs
    other kernels than a one-token pass: at a near-tie the rounding may pick the other token (measured: a top-2 gap of
    0.007), as bf16 does on torch. Anything else is a bug."""
    diff = first_difference(got, reference)
    if diff is None:
        return True
    gap = top2_gap(cold, torch.cat([prompt, torch.tensor([reference[:diff]])], 1))
    assert gap < SMOL_NEAR_TIE, f"differs at token {diff}, top-2 gap {gap:.3g}: not a near-tie"
    return False


def counting_decodes(backend, monkeypatch, fail=lambda tokens, seqs, flags: False) -> list:
    """Record each llama_decode's (tokens, sequence ids, logit flags); `fail` says which to fail as llama.cpp would."""
    calls, real = [], backend.context.decode

    def decode(tokens, positions, seqs, logits):
        calls.append((list(tokens), list(seqs), list(logits)))
        if fail(tokens, seqs, logits):
            raise BackendError("llama_decode failed (-3: injected)")
        return real(tokens, positions, seqs, logits)

    monkeypatch.setattr(backend.context, "decode", decode)
    return calls


def test_prompts_read_in_the_rows_pass_answer_as_each_row_alone(smol_gguf, cold, prompts, references, monkeypatch):
    """Prompts waiting beside running rows are read in the rows' own llama_decode: several prompts in one, a chunk
    wider than the room the rows leave in the context's batch cut to fit (the rest read the next step, not in a decode
    of its own first). Every answer is still the row's own. (No drafts: one
    input a row, so which prompts share a decode is known; the rows test above reads beside drafting rows.)"""
    batched = LlamaCppBackend(smol_gguf, threads=2, max_rows=4, max_pass=32)  # a decode holds 32 tokens
    engine = BatchEngine(batched, None, max_batch=4, prefill_chunk=30)
    calls = counting_decodes(batched, monkeypatch)
    long_prompt = prompts[2].repeat(1, 3)  # 63 tokens: more than a decode holds beside the rows
    order = [prompts[0], prompts[1], prompts[1], long_prompt]  # 18, 9, 9, 63 tokens: read shortest first
    seqs = [engine.submit(p, max_new_tokens=NEW_TOKENS) for p in order]
    reports = []
    while engine.has_work:
        before = len(calls)
        reports.append((engine.step(), len(calls) - before))
    # step 2: one row's token, 9 + 18 prompt tokens joining and 3 of the long one, in one decode
    assert reports[1][0].read_in_pass == 30 and reports[1][0].admitted == 2 and reports[1][1] == 1
    # step 3: three rows' tokens and the 29 of the long prompt there is room for, in one decode
    assert reports[2][0].read_in_pass == 29 and reports[2][1] == 1
    assert sum(report.prefill_tokens for report, _ in reports) == sum(p.shape[1] for p in order)
    long_reference = SpeculativeEngine(cold, None).generate(long_prompt, max_new_tokens=NEW_TOKENS).result().token_ids
    expected = [references[0], references[1], references[1], long_reference]
    assert sum(own_or_near_tie(cold, p, seq.result.token_ids, ref) for p, seq, ref in zip(order, seqs, expected)) >= 3
    assert batched.rows == 0 and not batched._readers


MARKER = 31999  # a token only the doomed prompt holds


@pytest.mark.parametrize("fault", ["fused-decode-once", "the-prompt-itself"])
def test_a_read_that_fails_in_the_rows_pass_fails_only_its_request(smol_gguf, cold, prompts, references, monkeypatch,
                                                                  fault):
    """A fused decode that fails is undone and run again apart: once (say, the cache full for both), every request
    answers; every time the doomed prompt's chunk is in a decode, only that request fails."""
    batched = LlamaCppBackend(smol_gguf, threads=2, max_rows=3)
    engine = BatchEngine(batched, None, max_batch=3, prefill_chunk=8)
    failed = []

    def fail(tokens, seqs, flags):
        if fault == "fused-decode-once":
            doom = not failed and len(set(seqs)) > 1 and not all(flags)
        else:
            doom = MARKER in tokens
        failed.extend([True] if doom else [])
        return doom

    calls = counting_decodes(batched, monkeypatch, fail)
    running = engine.submit(prompts[0], max_new_tokens=NEW_TOKENS)
    engine.step()
    doomed_prompt = torch.cat([prompts[1], torch.tensor([[MARKER]]), prompts[1]], 1)
    doomed = engine.submit(doomed_prompt if fault == "the-prompt-itself" else prompts[1], max_new_tokens=NEW_TOKENS)
    after = engine.submit(prompts[2], max_new_tokens=NEW_TOKENS)
    while engine.has_work:
        engine.step()
    assert failed and any(len(set(seqs)) > 1 and not all(flags) for _, seqs, flags in calls)  # fused decodes ran
    own_or_near_tie(cold, prompts[0], running.result.token_ids, references[0])
    own_or_near_tie(cold, prompts[2], after.result.token_ids, references[2])
    if fault == "the-prompt-itself":
        assert doomed.result.finish_reason == "error" and not doomed.result.token_ids
        assert len(failed) == 2  # in the rows' pass, then alone
    else:
        own_or_near_tie(cold, prompts[1], doomed.result.token_ids, references[1])
    assert batched.rows == 0 and not batched._readers


# --- sampling ------------------------------------------------------------------------------------

TOP_K = 3  # small support: the exact marginals of tokens 2 and 3 enumerate 3 x 3 paths through llama.cpp
SAMPLES = 800
ROWS = 8


def exact_marginals(backend, prompt, params):
    """Distributions of generated tokens 2 and 3 under the backend's own plain sampling, by enumeration."""
    from specdecode.sampling import logits_to_probs

    def next_probs(ids):
        logits = backend.add_row(ids)
        backend.remove_rows([backend.rows - 1])
        return logits_to_probs(logits, params)[0]

    first = next_probs(prompt)
    second, third = torch.zeros_like(first), torch.zeros_like(first)
    for a in first.nonzero().flatten().tolist():
        after_a = next_probs(torch.cat([prompt, torch.tensor([[a]])], 1))
        second += first[a] * after_a
        for b in after_a.nonzero().flatten().tolist():
            third += first[a] * after_a[b] * next_probs(torch.cat([prompt, torch.tensor([[a, b]])], 1))
    return second, third


class SharperDraft(ModelDrafter):
    """The target's own GGUF drafting at a lower temperature: q differs from p on the same few tokens (a draft with
    q = p is never rejected, so a wrong rejection rule would not show). Its q is what it sampled from: lossless."""

    def propose(self, input_ids, k, sampling, draws, keep_going=None):
        sharper = SamplingParams(sampling.temperature * 0.4, sampling.top_k, sampling.top_p)
        return super().propose(input_ids, k, sharper, draws, keep_going)


@pytest.mark.parametrize("lossless", [True, False], ids=["speculative-rule", "wrong-rule"])
@pytest.mark.parametrize("which", ["model", "suffix"])
def test_sampling_follows_llama_cpps_distribution(backend, smol_gguf, prompts, monkeypatch, lossless, which):
    import specdecode.sampling as sampling_module
    from test_sampling import wrong_rule_resample_from_p

    if not lossless:
        monkeypatch.setattr(sampling_module, "speculative_accept", wrong_rule_resample_from_p)
    params = SamplingParams(temperature=1.5, top_k=TOP_K)
    if which == "model":
        prompt = prompts[1][:, :5]  # short: each sample pays two prefills
        drafter = SharperDraft(LlamaCppBackend(smol_gguf, threads=2))
    else:  # a phrase said twice, begun a third time: the suffix trees propose the rest of it
        prompt = prompts[1][:, :4].repeat(1, 3)[:, :-2]
        drafter = SuffixDrafter()
    # Rows side by side (the target's passes shared, each row's draws from its own torch seed): half the time of
    # one request after another. The exact marginals below come from one-row passes.
    engine = BatchEngine(LlamaCppBackend(smol_gguf, threads=2, max_rows=ROWS), drafter, k=2, max_batch=ROWS)
    seqs = []
    for seed in range(SAMPLES):
        torch.manual_seed(seed)  # unseeded: the min(1, p/q) rule
        seqs.append(engine.submit(prompt, max_new_tokens=4, sampling=params))  # drafts of 2 after token 1
    while engine.has_work:
        engine.step()
    generated = [seq.result.token_ids for seq in seqs]
    drafted_second = sum(len(seq.stats.drafted_per_position) > 1 for seq in seqs)
    assert drafted_second > SAMPLES // 2  # the first step drafted 2 tokens
    exact = exact_marginals(backend, prompt, params)
    results = [fit([tokens[i] for tokens in generated], p) for i, p in zip((1, 2), exact)]
    if lossless:
        assert all(pv > 1e-3 for pv, _ in results), results
    else:
        assert any(pv < 1e-3 for pv, _ in results), results


# --- choosing the backend -------------------------------------------------------------------------


def test_auto_picks_llama_cpp_for_a_gguf_on_a_cpu_and_torch_otherwise(tmp_path):
    assert choose_backend("auto", "smollm2-135m") == ("torch" if torch.cuda.is_available() else "llama.cpp")
    assert choose_backend("auto", str(tmp_path)) == "torch"  # a Hugging Face directory
    assert choose_backend("torch", "smollm2-135m") == "torch"
    with pytest.raises(ValueError, match="runs GGUF files"):
        choose_backend("llama.cpp", str(tmp_path))
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("vulkan", "smollm2-135m")


def test_llama_drafters_refuse_what_they_cannot_do(backend):
    with pytest.raises(ValueError, match="torch backend only"):
        make_llama_drafter("self", backend)
    with pytest.raises(ValueError, match="torch backend's"):
        make_llama_drafter("smollm2-135m+int4", backend)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llama_drafter("qwen2.5-coder-0.5b", backend)
    with pytest.raises(BackendError, match="chains only"):
        backend.add_row(torch.tensor([[1, 2, 3]]))
        try:
            backend.forward(torch.tensor([[4, 5]]), [2], visibility=torch.ones(1, 2, 2, dtype=torch.bool))
        finally:
            backend.clear()


def test_tune_runs_on_llama_cpp_and_writes_its_backend(tmp_path):
    """`tune --backend llama.cpp` measures GGUF drafters (no torch-only variants offered), drops the draft of another
    vocabulary with its reason, and writes a config whose backend the other commands then default to."""
    import json

    from specdecode.cli import build_parser, main
    from specdecode.tune import read_config

    out = tmp_path / "tuned.json"
    assert main(["tune", "--target", "smollm2-135m", "--backend", "llama.cpp", "--threads", "2", "--limit", "2",
                 "--max-new-tokens", "8", "--budget", "120", "--out", str(out)]) == 0
    config = json.loads(out.read_text())
    assert config["backend"] == "llama.cpp" and config["dtype"] is None
    methods = [row["method"] for row in config["tuned"]["table"]]
    assert methods and not any("+int4" in m or "self" in m for m in methods)
    assert "vocabulary" in config["tuned"]["dropped"]["spec:qwen2.5-coder-0.5b:a8"]
    assert build_parser(read_config(str(out))).parse_args(["generate", "hi"]).backend == "llama.cpp"


def test_the_llama_cpp_baseline_answers_as_our_plain_decoding_end_token_included(smol_q4_0, cold):
    """The bench's `llama-cpp` method (llama-cpp-python's `Llama.generate`) and our plain decoding run the same GGUF
    and kernels: the same greedy tokens, the end token they stopped on included (left out, every answer that ended
    counted as differing and its rate one token short). Both read each prompt whole (a prompt read after a cached
    prefix runs other kernels: at SmolLM2's near-ties another first token)."""
    from specdecode.bench.methods import LlamaCppMethod
    from specdecode.encoding import encode_prompt
    from specdecode.stopping import StopCondition

    tokenizer = load_tokenizer("smollm2-135m")
    baseline = LlamaCppMethod("llama-cpp", str(smol_q4_0), cold.eos_token_ids, threads=2, window=512)
    stop, ended = StopCondition(cold.eos_token_ids), 0
    for text in ("Say hello.", "What is 2 + 2?"):
        ids = encode_prompt(tokenizer, text, chat=True)
        ours = SpeculativeEngine(cold, None).generate(ids, max_new_tokens=64, stop=stop).result().token_ids
        theirs = baseline.run(ids, 64, SamplingParams()).token_ids
        assert theirs == ours
        ended += ours[-1] in cold.eos_token_ids
    assert ended  # at least one answer stopped on its end token
