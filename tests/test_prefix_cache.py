"""The prompt-prefix cache: a row started from a cached prefix (a finished row's K/V, copied out and put back on
llama.cpp, kept as tensors on torch; or the cells of a running row or one still being read, shared on llama.cpp)
decodes exactly what a cold row decodes — the next turn of a chat, a prefix that ends inside the chat template, a cache
under memory pressure, an entry with no free cells to go back into, a prefix evicted while the prompt after it is still
being read, a prompt waiting for the reading of the prefix it shares."""

import pytest
import torch

from specdecode import ModelDrafter, NgramDrafter, SpeculativeEngine
from specdecode.backends import prefix
from specdecode.backends.prefix import PrefixCache
from specdecode.backends.torchmodel import TorchBackend
from specdecode.batch import BatchEngine
from specdecode.check import first_difference, top2_gap
from tiny import random_prompt


def test_the_longest_shared_prefix_serves_and_the_least_recent_goes(monkeypatch):
    cache = PrefixCache(max_entries=2, max_tokens=10)
    monkeypatch.setattr(prefix, "MIN_SHARED", 2)
    assert cache.add("a", [1, 2, 3, 4]) == []
    assert cache.add("b", [1, 2, 9]) == []
    assert cache.find([1, 2, 3, 4, 5]) == ("a", 4)
    assert cache.find([1, 2, 3, 4]) == ("a", 3)  # the prompt's last token is always read (its logits are wanted)
    assert cache.find([1, 7, 8]) == (None, 0)  # too short a prefix to serve
    assert cache.add("c", [5, 6]) == ["b"]  # "a" was used last
    assert cache.add("d", [1, 2, 3, 4, 5, 6]) == ["a"]  # it extends "a": "a" is redundant, not evicted
    assert cache.add("e", [1, 2, 3]) == ["e"]  # "d" holds it already
    assert cache.add("f", list(range(11))) == ["f"]  # longer than the whole cache
    assert cache.add("g", [8, 8, 8]) == ["c"]  # a third entry: the least recent goes
    assert cache.add("h", [7, 7, 7, 7, 7, 7, 7, 7]) == ["d", "g"]  # then tokens: 6 + 3 + 8 > 10
    assert list(cache.entries) == ["h"] and cache.tokens == 8
    assert cache.stats.hits == 2 and cache.stats.cached_tokens == 7 and cache.stats.lookups == 3
    assert cache.stats.evictions == 4  # b, c, d, g (a was redundant, e and f never held)


@pytest.mark.parametrize("drafter", ["none", "near", "ngram"])
def test_torch_chat_turns_from_cached_prefixes_equal_cold_rows(target, near_draft, drafter):
    """Two chats in turns (each re-sends its history, the answer and a new user turn), then a prompt seen before."""
    make = {"none": lambda: None, "near": lambda: ModelDrafter(near_draft), "ngram": NgramDrafter}[drafter]
    cold = BatchEngine(TorchBackend(target, prefix_cache=False), make(), k=4, max_batch=3)
    warm = BatchEngine(TorchBackend(target), make(), k=4, max_batch=3)
    histories = [random_prompt(1, 20), random_prompt(2, 25)]
    results, cached = [], []
    for turn in range(3):
        for chat_id, history in enumerate(histories):
            seq, = warm.generate_all([dict(input_ids=history, max_new_tokens=16)])
            reference, = cold.generate_all([dict(input_ids=history, max_new_tokens=16)])
            assert seq.result.token_ids == reference.result.token_ids, f"turn {turn}, chat {chat_id}"
            results.append(seq)
            cached.append(seq.stats.cached_prompt_tokens)
            # the cache held everything but the last answer token: that one and the new user turn are read
            assert seq.stats.cached_prompt_tokens == (0 if turn == 0 else history.shape[1] - 7)
            histories[chat_id] = torch.cat([history, torch.tensor([seq.result.token_ids]), random_prompt(turn, 6)], 1)
    again, = warm.generate_all([dict(input_ids=random_prompt(1, 20), max_new_tokens=16)])
    assert again.stats.cached_prompt_tokens == 19 and again.result.token_ids == results[0].result.token_ids
    if drafter != "none":
        assert sum(s.stats.drafted_tokens for s in results) > 0


@pytest.mark.parametrize("given", ["model", "backend"])
def test_the_cache_can_be_turned_off(target, given):
    engine = BatchEngine(target if given == "model" else TorchBackend(target), None, prefix_cache=False)
    seqs = [engine.generate_all([dict(input_ids=random_prompt(1, 30), max_new_tokens=4)])[0] for _ in range(2)]
    assert engine.backend.prefix_cache is None and [s.stats.cached_prompt_tokens for s in seqs] == [0, 0]
    assert seqs[0].result.token_ids == seqs[1].result.token_ids


def test_torch_prefix_cache_is_bounded_in_tokens(target):
    backend = TorchBackend(target, prefix_tokens=100)
    engine = SpeculativeEngine(backend, None)
    for seed in range(6):
        engine.generate(random_prompt(seed, 40), max_new_tokens=8).result()
    assert backend.prefix_cache.tokens <= 100 and backend.prefix_cache.stats.evictions >= 4
    assert set(backend._prefixes) == set(backend.prefix_cache.entries)  # evicted K/V are freed


@pytest.mark.models
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_the_cache_size_reaches_the_backend(backend):
    """`serve --prefix-cache-tokens N` as load_target gets it: N bounds the cache, 0 turns it off."""
    from specdecode.backends import load_target

    off, _ = load_target("smollm2-135m", backend, threads=2, prefix_cache_tokens=0)
    sized, _ = load_target("smollm2-135m", backend, threads=2, max_rows=2, prefix_cache_tokens=300)
    assert off.prefix_cache is None and sized.prefix_cache is not None
    assert sized.prefix_cache.max_tokens == 300


def test_a_failed_put_back_counts_no_hit():
    cache = PrefixCache(max_entries=2)
    cache.add("a", list(range(40)))
    assert cache.find(list(range(50))) == ("a", 40)
    cache.unserved(40)
    assert (cache.stats.hits, cache.stats.cached_tokens, cache.stats.restore_failures) == (0, 0, 1)


# --- llama.cpp: cells copied out and put back -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    from specdecode.backends.llamacpp import LlamaModel
    from specdecode.models import BUILTINS, builtin_gguf, load_tokenizer

    return LlamaModel(builtin_gguf(BUILTINS["smollm2-135m"])), load_tokenizer("smollm2-135m")


def assert_llama_cpps_own(backend, prompt: torch.Tensor, got: list[int], expected: list[int]) -> None:
    """Equal, or apart from a near-tie on: cached K/V come from the passes that made them (a one-token pass runs other
    kernels than a prompt's reading), so at a top-2 gap below the backend's near_tie_gap either token may win."""
    diff = first_difference(got, expected)
    if diff is not None:
        gap = top2_gap(backend, torch.cat([prompt, torch.tensor([expected[:diff]], dtype=torch.long)], 1))
        assert gap < backend.near_tie_gap, f"differs at token {diff}, top-2 gap {gap:.3g}: not a near-tie"


def chat(tokenizer, messages) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)


def test_llama_cpp_chat_turns_read_only_what_is_new(smol):
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, tokenizer = smol
    cold = SpeculativeEngine(LlamaCppBackend(model, threads=2, prefix_cache=False), NgramDrafter(), k=4)
    backend = LlamaCppBackend(model, threads=2)
    warm = SpeculativeEngine(backend, NgramDrafter(), k=4)
    first = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    answer = warm.generate(chat(tokenizer, first), max_new_tokens=24).result()
    assert answer.stats.cached_prompt_tokens == 0
    turns = [
        # the next turn: the history re-sent through the template (the answer's end and the new turn's start are
        # template tokens the cache never held)
        first + [{"role": "assistant", "content": tokenizer.decode(answer.token_ids, skip_special_tokens=True)},
                 {"role": "user", "content": "Now make it multiply."}],
        # another question: the shared prefix ends inside the template, in the user turn's header
        [{"role": "user", "content": "Name three colours."}],
    ]
    for messages in turns:
        prompt = chat(tokenizer, messages)
        entries = {key: held.copy() for key, held in backend.prefix_cache.entries.items()}
        shared = max(int((torch.tensor(held[: prompt.shape[1]]) == prompt[0, : len(held)]).cumprod(0).sum())
                     for held in entries.values())
        result = warm.generate(prompt, max_new_tokens=24).result()
        assert result.stats.cached_prompt_tokens == shared >= prefix.MIN_SHARED
        expected = cold.generate(prompt, max_new_tokens=24).result().token_ids
        assert_llama_cpps_own(cold.backend, prompt, result.token_ids, expected)
    assert backend.prefix_cache.stats.hits == 2


def counting(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts that share a prefix and part where the next number depends on the token after it."""
    count = ", ".join(str(i) for i in range(1, 30))
    first = tokenizer(f"Counting: {count}, ", return_tensors="pt").input_ids
    return first, tokenizer(f"Counting: {count.replace('29', '70')}, 71, ", return_tensors="pt").input_ids


def beside_a_running_row(backend, first: torch.Tensor, second: torch.Tensor, new: int):
    """`first` runs (read and decoding) when `second` arrives -> both finished sequences."""
    engine = BatchEngine(backend, None, max_batch=2)
    a = engine.submit(first, max_new_tokens=new)
    while backend.rows == 0:
        engine.step()
    b = engine.submit(second, max_new_tokens=new)
    while engine.has_work:
        engine.step()
    return a, b


@pytest.mark.parametrize("source", ["cached", "running"])
def test_a_prefix_shared_one_token_too_far_is_caught(smol, monkeypatch, source):
    """Mutation: the shared prefix runs one token too far (the new row gets the cell of a token its prompt does not
    have there), from a cached entry or from a running row. The output check above must fail on it."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, tokenizer = smol
    real = prefix.common_prefix
    monkeypatch.setattr(prefix, "common_prefix", lambda a, b: min(real(a, b) + 1, len(a), len(b)))
    cold = SpeculativeEngine(LlamaCppBackend(model, threads=2, prefix_cache=False), None)
    first, prompt = counting(tokenizer)
    if source == "cached":
        warm = SpeculativeEngine(LlamaCppBackend(model, threads=2), None)
        warm.generate(first, max_new_tokens=4).result()
        result = warm.generate(prompt, max_new_tokens=8).result()
    else:
        backend = LlamaCppBackend(model, threads=2, max_rows=2)
        _, seq = beside_a_running_row(backend, first, prompt, 8)
        assert backend.prefix_cache.stats.shared_running == 1
        result = seq.result
    assert result.stats.cached_prompt_tokens > 0
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_llama_cpps_own(cold.backend, prompt, result.token_ids, cold.generate(prompt, max_new_tokens=8).result().token_ids)


def test_llama_cpp_cache_under_memory_pressure_changes_no_answer(smol):
    """Few tokens kept: entries are evicted least recently used first for the newer ones. The answers stay the same,
    and the newest entry still serves its prompt."""
    from specdecode.backends.llamacpp import LlamaCppBackend
    from specdecode.prompts import load_prompts

    model, tokenizer = smol
    backend = LlamaCppBackend(model, threads=2, window=384, max_rows=2, prefix_tokens=600)
    cold = BatchEngine(LlamaCppBackend(model, threads=2, window=384, max_rows=2, prefix_cache=False), NgramDrafter(),
                       k=4, max_batch=2)
    warm = BatchEngine(backend, NgramDrafter(), k=4, max_batch=2)
    prompts = [tokenizer(p.text, return_tensors="pt").input_ids for p in load_prompts("edits")[:6]]
    requests = [dict(input_ids=p, max_new_tokens=16) for p in prompts]
    assert sum(p.shape[1] + 16 for p in prompts) > 600  # the entries cannot all stay
    expected = [s.result.token_ids for s in cold.generate_all(requests)]
    for prompt, seq, reference in zip(prompts, warm.generate_all(requests), expected):
        assert_llama_cpps_own(cold.backend, prompt, seq.result.token_ids, reference)
    assert backend.prefix_cache.stats.evictions > 0 and backend.prefix_cache.tokens <= 600
    assert set(backend._saved) == set(backend.prefix_cache.entries)  # evicted K/V are freed
    newest = list(backend.prefix_cache.entries.values())[-1]
    last = next(i for i, p in enumerate(prompts) if newest[: p.shape[1]].tolist() == p[0].tolist())
    again, = warm.generate_all(requests[last : last + 1])
    assert again.stats.cached_prompt_tokens == prompts[last].shape[1] - 1
    assert_llama_cpps_own(cold.backend, prompts[last], again.result.token_ids, expected[last])


def test_llama_cpp_an_entry_with_no_free_cells_to_go_back_into_is_read_whole(smol):
    """An entry goes back whole before it is cut to the shared prefix; where the cache has too few free cells for that,
    the prompt is read as if nothing were cached, to the same answer."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, _ = smol
    backend = LlamaCppBackend(model, threads=2, window=384, max_rows=2)
    engine = BatchEngine(backend, None, max_batch=2)
    first = random_prompt(3, 300, 49152)
    engine.generate_all([dict(input_ids=first, max_new_tokens=8)])
    later = torch.cat([first[:, :100], random_prompt(4, 20, 49152)], 1)
    filler = backend.open_row()  # a row holding all but 200 cells: room to read `later`, not to put 307 back
    filler.read(random_prompt(5, backend.context.cells - 200, 49152))
    seq, = engine.generate_all([dict(input_ids=later, max_new_tokens=8)])
    assert seq.stats.cached_prompt_tokens == 0 and backend.prefix_cache.stats.restore_failures == 1
    filler.discard()
    cold = SpeculativeEngine(LlamaCppBackend(model, threads=2, prefix_cache=False), None)
    expected = cold.generate(later, max_new_tokens=8).result().token_ids
    assert_llama_cpps_own(cold.backend, later, seq.result.token_ids, expected)
    again, = engine.generate_all([dict(input_ids=later, max_new_tokens=8)])  # room again: its entry serves it
    assert again.stats.cached_prompt_tokens == later.shape[1] - 1
    assert_llama_cpps_own(cold.backend, later, again.result.token_ids, expected)


@pytest.mark.parametrize("which", ["llama.cpp", "torch"])
def test_a_prefix_evicted_while_the_prompt_is_read_changes_nothing(smol, target, which):
    """The row that started from a spare keeps its cells when the spare is dropped mid-admission."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    if which == "llama.cpp":
        model, _ = smol
        make, vocab = (lambda cache: LlamaCppBackend(model, threads=2, max_rows=2, prefix_cache=cache)), 49152
    else:
        make, vocab = (lambda cache: TorchBackend(target, prefix_cache=cache)), 96
    shared = random_prompt(3, 40, vocab)
    later = torch.cat([shared, random_prompt(4, 60, vocab)], 1)
    cold = make(False)
    expected = SpeculativeEngine(cold, None).generate(later, max_new_tokens=12).result().token_ids
    backend = make(True)
    engine = BatchEngine(backend, None, max_batch=2, prefill_chunk=8)
    engine.generate_all([dict(input_ids=shared, max_new_tokens=4)])
    running = engine.submit(random_prompt(5, 5, vocab), max_new_tokens=40)
    engine.step()
    seq = engine.submit(later, max_new_tokens=12)
    engine.step()  # opens its row from the cached prefix and reads one chunk
    assert seq.stats.cached_prompt_tokens == 40 and seq.prompt_read < later.shape[1]
    backend.drop_cached_prefixes()
    while engine.has_work:
        engine.step()
    if which == "llama.cpp":
        assert_llama_cpps_own(cold, later, seq.result.token_ids, expected)
    else:
        assert seq.result.token_ids == expected
    assert running.result.finish_reason == "length"


def test_llama_cpp_an_entry_stays_whole_beside_a_row_that_shares_its_prefix(smol):
    """A new row takes an entry's prefix and the entry keeps its tail: a repeat of its prompt (or its conversation's
    next turn) after another request that shared only the system prompt is still served from it. The cache's cells
    hold the rows only: a finished row's leave the cache."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, _ = smol
    backend = LlamaCppBackend(model, threads=2, max_rows=2)

    def used() -> int:  # cells the rows' sequences hold
        return sum(max(0, model.lib.llama_memory_seq_pos_max(backend.context.memory, s) + 1) for s in range(2))

    engine = BatchEngine(backend, None, max_batch=2)
    shared = random_prompt(3, 40, 49152)
    first = torch.cat([shared, random_prompt(4, 30, 49152)], 1)
    engine.generate_all([dict(input_ids=first, max_new_tokens=6)])
    (entry, held), = backend.prefix_cache.entries.items()
    assert len(held) == 40 + 30 + 6 - 1 and used() == 0  # the last token was never fed back
    later = torch.cat([shared, random_prompt(5, 20, 49152)], 1)
    seq = engine.submit(later, max_new_tokens=6)
    engine.step()
    assert seq.stats.cached_prompt_tokens == 40 and used() == 60  # its 40 put back, 20 read
    assert len(backend.prefix_cache.entries[entry]) == 75  # the entry keeps its tail
    while engine.has_work:
        engine.step()
    held = backend.prefix_cache.entries
    assert len(held) == 2 and held[entry][:70].tolist() == first[0].tolist()
    again = engine.submit(first, max_new_tokens=6)
    engine.step()
    assert again.stats.cached_prompt_tokens == 69  # all but the last prompt token, whose logits are computed


def test_llama_cpp_a_row_shares_a_running_rows_prefix_cells(smol):
    """A prompt arriving while a row with the same prefix runs starts from that row's cells (no cached entry holds
    them yet), and both answer as they would alone."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, tokenizer = smol
    backend = LlamaCppBackend(model, threads=2, max_rows=2)
    first, second = counting(tokenizer)
    a, b = beside_a_running_row(backend, first, second, 8)
    assert b.stats.cached_prompt_tokens == prefix.common_prefix(first[0], second[0]) >= prefix.MIN_SHARED
    assert backend.prefix_cache.stats.shared_running == 1 and backend.prefix_cache.stats.hits == 0
    cold = SpeculativeEngine(LlamaCppBackend(model, threads=2, prefix_cache=False), None)
    for prompt, seq in ((first, a), (second, b)):
        assert_llama_cpps_own(cold.backend, prompt, seq.result.token_ids,
                              cold.generate(prompt, max_new_tokens=8).result().token_ids)


def burst(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts with one long prefix (155 tokens) and tails of their own (26 and 57 tokens)."""
    count = ", ".join(str(i) for i in range(1, 41))
    first = tokenizer(f"Counting: {count}, then the letters: a, b, c, d, e, f, g, h, i, j, k, l", return_tensors="pt")
    second = tokenizer(f"Counting: {count}, then down from 99: 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87",
                       return_tensors="pt")
    return first.input_ids, second.input_ids


def test_llama_cpp_a_row_shares_the_cells_of_a_row_being_read(smol):
    """A row opened while another is still being read starts from the cells that one has read of their shared prefix,
    and keeps them when the other is discarded; its logits are those of a cold row read in the same pieces."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, tokenizer = smol
    first, second = burst(tokenizer)
    backend = LlamaCppBackend(model, threads=2, max_rows=2)
    reader = backend.open_row(first)
    reader.read(first[:, :100])
    assert backend.to_read(second) == second.shape[1] - 100
    other = backend.open_row(second)
    assert other.cached == 100 and backend.prefix_cache.stats.shared_running == 1
    reader.read(first[:, 100:])
    reader.discard()
    got = other.read(second[:, 100:])
    cold = LlamaCppBackend(model, threads=2, prefix_cache=False).open_row()
    cold.read(second[:, :100])
    expected = cold.read(second[:, 100:])
    assert (got - expected).abs().max() < 1e-3


def test_llama_cpp_a_prompt_waits_for_the_reading_of_its_prefix(smol):
    """A row runs; two prompts with one long prefix that nothing holds yet arrive together and are read in chunks
    beside it. The second is not opened while the first has read only part of that prefix (it would read the rest
    again): it starts from all of it, and every answer is the one read cold."""
    from specdecode.backends.llamacpp import LlamaCppBackend

    model, tokenizer = smol
    first, second = burst(tokenizer)
    shared = prefix.common_prefix(first[0], second[0])
    # chunks of 64: the first's reading leaves room in its third step, when it holds 128 of the 155 shared tokens
    assert shared - 128 >= prefix.MIN_SHARED and first.shape[1] - 128 < 64
    backend = LlamaCppBackend(model, threads=2, max_rows=3)
    engine = BatchEngine(backend, None, max_batch=3, prefill_chunk=64)
    runner = engine.submit(tokenizer("Numbers: 100, 101, 102, ", return_tensors="pt").input_ids, max_new_tokens=48)
    while backend.rows == 0:
        engine.step()
    a, b = engine.submit(first, max_new_tokens=8), engine.submit(second, max_new_tokens=8)
    while engine.has_work:
        engine.step()
    assert len(runner.result.token_ids) == 48  # it ran beside both readings
    assert b.stats.cached_prompt_tokens == shared and backend.prefix_cache.stats.shared_running == 1
    cold = SpeculativeEngine(LlamaCppBackend(model, threads=2, prefix_cache=False), None)
    for prompt, seq in ((first, a), (second, b)):
        assert_llama_cpps_own(cold.backend, prompt, seq.result.token_ids,
                              cold.generate(prompt, max_new_tokens=8).result().token_ids)


@pytest.mark.parametrize("source", ["being read", "running"])
def test_torch_a_row_starts_from_the_kv_of_a_row_that_holds_its_prefix(target, source):
    """On torch too a new row starts from a copy of the K/V of a row that holds a prefix of its prompt, running or
    still being read (8-token chunks beside a running row), and every row answers as it would alone, exactly."""
    backend = TorchBackend(target)
    engine = BatchEngine(backend, None, max_batch=3, prefill_chunk=8)
    runner = engine.submit(random_prompt(5, 12), max_new_tokens=40)
    while backend.rows == 0:
        engine.step()
    head = random_prompt(7, 30)
    first, second = torch.cat([head, random_prompt(8, 6)], 1), torch.cat([head, random_prompt(9, 10)], 1)
    a = engine.submit(first, max_new_tokens=8)
    if source == "running":
        while backend.rows < 2:
            engine.step()
    b = engine.submit(second, max_new_tokens=8)
    while engine.has_work:
        engine.step()
    assert len(runner.result.token_ids) == 40  # it ran beside both readings
    # being read: the first's last chunk leaves room when it holds 32 tokens, all of the shared ones
    assert b.stats.cached_prompt_tokens == prefix.common_prefix(first[0], second[0]) >= 30
    assert backend.prefix_cache.stats.shared_running == 1 and backend.prefix_cache.stats.hits == 0
    cold = BatchEngine(TorchBackend(target, prefix_cache=False), None)
    for prompt, seq in ((first, a), (second, b)):
        alone, = cold.generate_all([dict(input_ids=prompt, max_new_tokens=8)])
        assert seq.result.token_ids == alone.result.token_ids


@pytest.mark.parametrize("source", ["being read", "running"])
def test_torch_logits_from_a_rows_kv_equal_a_cold_reading(target, source):
    """The copy a new row starts from is the shared prefix's K/V, no token more or less: the logits after its prompt
    equal a cold row's (to float rounding; a token's K/V off by one position moves them by far more)."""
    backend = TorchBackend(target)
    head = random_prompt(7, 30)
    first, second = torch.cat([head, random_prompt(8, 6)], 1), torch.cat([head, random_prompt(9, 10)], 1)
    shared = prefix.common_prefix(first[0], second[0])
    if source == "running":
        backend.add_row(first)
    else:
        backend.open_row(first).read(first)
    reader = backend.open_row(second)
    assert reader.cached == shared >= 30
    got = reader.read(second[:, shared:])
    expected = TorchBackend(target, prefix_cache=False).open_row().read(second)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
