"""Every drafter and controller keeps the output exact; the fast-draft pieces do what they claim."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdecode import ModelDrafter, NgramDrafter, SamplingParams, SpeculativeEngine, SuffixDrafter
from specdecode.bench.methods import parse_spec_method
from specdecode.control import AdaptiveK, ConfidenceCalibrator, CostModel, priors
from specdecode.drafters import ComboDrafter, Draft
from specdecode.drafters.suffix import ContextChains, CopyPointer, GramIndex
from specdecode.sampling import StreamDraws
from specdecode.backends.quant import Int4Linear, Int8Linear, RestrictedHead, int4_available, quantize
from replay import calibrated_controller, epyc_controller, observe_step, simulate_costs
from test_sampling import SAMPLES, VOCAB, assert_drafts_reached_the_second_position, assert_lossless, batched, check_results, sample_generations
from tiny import random_prompt, reference_greedy, tiny_model

PROMPTS = [(seed, 4 + seed % 9) for seed in range(8)]


def fast_drafter(seed=1, vocab=96, head=48, sharpness=8.0, quant="int8", compile=False):
    """The near draft with packed weights and a head restricted to `head` tokens (+ the prompt's)."""
    model = tiny_model(seed, vocab=vocab, sharpness=sharpness)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.2 * model.lm_head.weight.std())
    return ModelDrafter(model, quant=quant, head_tokens=head, compile=compile)


def engines(target, near_draft):
    return {
        "int8+head": SpeculativeEngine(target, fast_drafter(), k=5),
        "int4+head": SpeculativeEngine(target, fast_drafter(quant="int4"), k=5),
        # adaptive ones priced on a machine where drafting pays: on a tiny model's sub-millisecond passes, timings
        # alone might never let them draft
        "adaptive model": simulate_costs(SpeculativeEngine(target, ModelDrafter(near_draft), k=6, adaptive=True)),
        "adaptive ngram": simulate_costs(SpeculativeEngine(target, NgramDrafter(), k=6, adaptive=True)),
        "auto": simulate_costs(SpeculativeEngine(target, ComboDrafter(fast_drafter(), min_match=2), k=6, adaptive=True)),
    }


@pytest.mark.parametrize("which", ["int8+head", "int4+head", "adaptive model", "adaptive ngram", "auto"])
def test_greedy_output_equals_target_greedy(target, near_draft, which):
    engine = engines(target, near_draft)[which]
    second = 0  # drafts that reached their second token
    for seed, n in PROMPTS:  # one engine across prompts: the controller keeps learning between them
        prompt = random_prompt(seed, n)
        result = engine.generate(prompt, max_new_tokens=30).result()
        assert result.token_ids == reference_greedy(target, prompt, 30), f"{which}, prompt {seed}"
        second += sum(result.stats.drafted_per_position[1:2])
    assert second > 0, f"{which} never drafted two tokens: the identity above proves little"


def test_a_spawned_model_drafter_makes_its_row_when_it_first_drafts(target, near_draft, monkeypatch):
    """A row's drafter gets its own draft-model row (a llama.cpp context: ~0.1 s) only when it drafts, not when the
    request joins; then it drafts as the drafter it was spawned from."""
    from specdecode.backends.torchdraft import TorchDraftModel

    made = []
    real_twin = TorchDraftModel.twin
    monkeypatch.setattr(TorchDraftModel, "twin", lambda self: made.append(1) or real_twin(self))
    root = ModelDrafter(near_draft)
    spawned = root.spawn()
    spawned.reset()
    assert made == []
    prompt = random_prompt(3, 12)
    greedy = SamplingParams()
    assert spawned.propose(prompt, 4, greedy, None).tokens.tolist() == root.propose(prompt, 4, greedy, None).tokens.tolist()
    assert made == [1]


def test_fast_drafter_still_gets_accepted(target):
    stats = SpeculativeEngine(target, fast_drafter(), k=4).generate(random_prompt(2, 8), max_new_tokens=40).result().stats
    assert stats.acceptance_rate > 0.3, stats.acceptance_rate


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)], ids=["T1", "T0.8-p0.9"])
def test_restricted_head_sampling_is_lossless(params):
    """q = 0 outside the draft's head: the residual must cover those tokens exactly."""
    target = tiny_model(11, vocab=VOCAB, sharpness=6.0)
    drafter = fast_drafter(seed=12, vocab=VOCAB, head=6, sharpness=6.0)
    prompt = random_prompt(5, 6, vocab=VOCAB)
    generated, stats = sample_generations(batched(target, drafter), prompt, params, SAMPLES)
    assert_drafts_reached_the_second_position(stats)
    assert_lossless(check_results(generated, target, prompt, params))


def test_auto_sampling_is_lossless():
    """auto as shipped: n-gram or the int4 + restricted-head draft, adaptive."""
    target = tiny_model(11, vocab=VOCAB, sharpness=6.0)
    draft = fast_drafter(seed=12, vocab=VOCAB, head=8, sharpness=6.0, quant="int4")
    engine = simulate_costs(SpeculativeEngine(target, ComboDrafter(draft), k=3, adaptive=True))
    prompt = random_prompt(5, 6, vocab=VOCAB)
    params = SamplingParams(temperature=1.0)
    generated, stats = sample_generations(engine, prompt, params, SAMPLES)
    assert_drafts_reached_the_second_position(stats)
    assert_lossless(check_results(generated, target, prompt, params))


def test_int8_linear_is_close_to_the_original_for_one_row_and_exact_for_many():
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    q = Int8Linear(linear)
    one, many = torch.randn(1, 1, 64, dtype=torch.bfloat16), torch.randn(1, 7, 64, dtype=torch.bfloat16)
    assert torch.allclose(q(one).float(), linear(one).float(), atol=0.05, rtol=0.05)
    assert torch.equal(q(many), linear(many))  # wide passes keep the original weights


@pytest.mark.skipif(not int4_available(), reason="this torch has no CPU int4 kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_matches_its_dequantized_weights_for_one_row_and_the_original_for_many(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48).to(dtype)
    q = Int4Linear(linear)
    assert q.group_size == 64
    # Rebuild the 4-bit weights by hand: min-max per group of 64 inputs, 16 levels.
    w = linear.weight.detach().float().reshape(48, 2, 64)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = (high - low) / 15
    dequantized = (torch.round((w - low) / step) * step + low).reshape(48, 128)
    one, many = torch.randn(1, 1, 128, dtype=dtype), torch.randn(1, 7, 128, dtype=dtype)
    expected = one.float() @ dequantized.T + linear.bias.float()
    assert torch.allclose(q(one).float(), expected, atol=0.03, rtol=0.03)
    assert not torch.allclose(q(one).float(), linear(one).float(), atol=1e-4)  # it really is the 4-bit path
    assert torch.equal(q(many), linear(many))  # wide passes keep the original weights


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_swaps_linears_but_not_the_head(bits):
    model = tiny_model(4).to(torch.bfloat16)
    swapped = quantize(model, bits)
    assert swapped == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert isinstance(model.lm_head, torch.nn.Linear)
    packed = {type(m) for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))}
    assert packed == {Int4Linear if bits == 4 and int4_available() else Int8Linear}


def test_int4_falls_back_to_int8_for_layers_it_cannot_group():
    model = torch.nn.Sequential(torch.nn.Linear(40, 16), torch.nn.Linear(16, 64))
    assert quantize(model, 4) == 2
    assert isinstance(model[0], Int8Linear)  # 40 inputs: no group of 32 or 64 divides it
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize(model, 3)


def test_restricted_head_matches_full_head_on_its_tokens():
    lm_head = torch.nn.Linear(16, 40, bias=False)
    head = RestrictedHead(lm_head, base=10, specials=[39], int8=False)
    head.set_context(torch.tensor([[25, 3]]))
    hidden = torch.randn(2, 16)
    logits, full = head.logits(hidden), lm_head(hidden)
    kept = torch.tensor(sorted(set(range(10)) | {25, 39}))
    assert torch.allclose(logits[:, kept], full[:, kept])
    outside = torch.ones(40, dtype=torch.bool)
    outside[kept] = False
    assert torch.isinf(logits[:, outside]).all()


def test_ngram_prefers_the_longest_suffix_match():
    ids = torch.tensor([[7, 1, 2, 9, 9, 5, 1, 2, 3, 8, 4, 0, 5, 1, 2]])
    #  suffix [5, 1, 2] occurs at 5..7 (followed by 3, 8); [1, 2] alone last occurs at 6..7 too, and at 1..2 (followed by 9)
    draft = NgramDrafter(max_ngram=3).propose(ids, 2, SamplingParams(), None)
    assert draft.tokens.tolist() == [[3, 8]]
    assert NgramDrafter(max_ngram=3).propose(torch.tensor([[1, 2, 3]]), 2, SamplingParams(), None).length == 0


def test_calibrator_learns_that_confident_drafts_get_rejected():
    cal = ConfidenceCalibrator()
    for _ in range(50):
        cal.update([0.95, 0.95], accepted_len=0)  # first token rejected, second never judged
    assert cal.predict(0.95) < 0.2
    assert cal.predict(0.55) == pytest.approx(0.55)  # untouched bins keep the prior


def test_cost_model_interpolates_verify_time():
    costs = CostModel(alpha=1.0)
    costs.observe_verify(1, 0.20)
    costs.observe_verify(5, 0.28)
    assert costs.verify_time(3) == pytest.approx(0.24)
    assert costs.verify_time(9) == pytest.approx(0.28 + 0.5 * 0.28 / 5 * 4)  # past the data: never flat
    costs.observe_verify(9, 0.28)  # measured: the measurement rules
    assert costs.verify_time(9) == pytest.approx(0.28) and costs.verify_time(7) == pytest.approx(0.28)


def test_cost_model_prices_a_batch_pass_from_its_own_plain_pass_along_the_one_row_curve():
    """A batch of deep rows costs more than one shallow row of as many tokens (AMX Xeon, llama.cpp: 8 rows 250 ms a
    plain step, one row's 8-wide pass at load 150 ms). Keyed by tokens alone, the 8-row step overwrote the one-row
    price and a 4-wide batch pass kept the load's 32-token price: 1.2x a plain step, where it ran ~2x."""
    costs = CostModel(alpha=1.0)
    for width, seconds in ((1, 0.10), (8, 0.15), (32, 0.30)):  # one row, as timed at load
        costs.observe_verify(width, seconds)
    assert costs.verify_time(2, rows=4) == pytest.approx(0.15)  # no pass of 4 rows yet: the curve at 8 tokens
    costs.observe_verify(1, 0.25, rows=8)  # 8 rows, plain
    assert costs.measured(1, 8) and not costs.measured(1, 4) and costs.measured(8)
    assert costs.verify_time(8) == pytest.approx(0.15)  # one row's price is its own
    assert costs.verify_time(1, rows=8) == pytest.approx(0.25)
    assert costs.verify_time(4, rows=8) == pytest.approx(0.25 * 0.30 / 0.15)  # the plain step, scaled along the curve
    costs.observe_verify(4, 0.45, rows=8)  # measured: the measurement rules
    assert costs.verify_time(4, rows=8) == pytest.approx(0.45)


def test_cost_model_prices_a_batch_from_its_own_passes_when_no_row_ran_alone():
    costs = CostModel(alpha=1.0)
    costs.observe_verify(1, 0.40, rows=16)
    costs.observe_verify(3, 0.70, rows=16)
    assert costs.verify_time(2, rows=16) == pytest.approx(0.55)
    assert costs.verify_time(1, rows=8) is None


def test_a_width_not_run_since_load_is_priced_in_plain_passes_now():
    """Calibration reads one minute of the machine. Timed in a busy one (AMD EPYC llama.cpp: a plain pass 45 ms, 64
    positions 1,100) and run in a calm one (plain 33 ms), a 64-wide pass kept its busy price and looked 33 plain passes
    where it costs ~24: a server that started busy never drafted long copies. Each width keeps what it cost in plain
    passes of as many rows when last measured."""
    ctl = AdaptiveK()
    for width, ms in {1: 45, 2: 80, 4: 140, 8: 300, 16: 380, 32: 660, 64: 1100}.items():  # calibrated, busy
        ctl.observe_pass(width, 1, ms / 1e3)
    first, later = ctl.measured.lookup_rates("suffix/chain", 24)
    first.value, later.judged, later.rejected = 0.9, 100.0, 3.0  # long copies: right at 97 % a position
    copy = lambda: Draft(torch.arange(63)[None], source="suffix/chain", match_len=24)  # noqa: E731
    busy = ctl.trim(copy()).length
    assert busy >= 15
    for _ in range(20):  # then the machine calms down; only plain steps run
        ctl.observe_pass(1, 1, 0.033)
    calm = ctl.costs.verify_time(1) / 0.045
    assert calm == pytest.approx(33 / 45, rel=0.01)
    assert ctl.costs.verify_time(64) == pytest.approx(1.1 * calm)
    assert ctl.costs.verify_time(48) == pytest.approx((0.66 + 1.1) / 2 * calm)
    assert ctl.trim(copy()).length == busy  # the same bet in plain passes (priced at load: nothing drafted)
    ctl.observe_pass(64, 1, 1.2)  # measured again: the average, in today's terms, learns it
    assert ctl.costs.verify_time(64) == pytest.approx(0.8 * 1.1 * calm + 0.2 * 1.2)
    costs = CostModel(alpha=1.0)  # a batch's pass the same way, against the batch's own plain pass
    costs.observe_verify(1, 0.30, rows=8)
    costs.observe_verify(4, 0.60, rows=8)
    costs.observe_verify(1, 0.20, rows=8)
    assert costs.verify_time(4, rows=8) == pytest.approx(0.40)


def test_load_aware_control_turns_speculation_off_as_the_batch_grows():
    """Verification is nearly free for one row but not for 16 (a pass costs more with every scored token):
    the same measured costs make speculation pay at 1 row and lose at 16."""
    ctl = AdaptiveK(max_k=4, probe_every=1000)
    for rows in (1, 16):
        for positions in (1, 2, 3, 5):
            ctl.observe_pass(positions, rows, 0.25 + 0.004 * rows * positions)
    for _ in range(20):
        ctl.observe_row("model", [0.9, 0.9], drafted=2, accepted=2, draft_s=0.04)
    alone, sixteen = ctl.batch.plan(1), ctl.batch.plan(16)
    assert alone.cap is None and ctl.plan(10, batch=alone).length > 0  # one row: the single-sequence rule drafts
    assert sixteen.cap == 0 and ctl.plan(10, batch=sixteen).length == 0  # sixteen rows: plain decoding for all
    assert ctl.batch.plan(2).cap > 0  # two rows: verification is still nearly free
    assert ctl.batch.decisions[16] == [1, 0] and ctl.batch.decisions[2] == [0, 1]
    ctl.costs.observe_draft_prefill(100, 0.5)  # drafters that never drafted would first read their prompts:
    assert ctl.batch.plan(2, unread_prompt_tokens=400).cap == 0  # a one-off 2 s the step would pay


def test_beside_a_prompt_reading_a_drafted_position_costs_what_it_adds_to_the_pass():
    """A pass that also reads a prompt chunk is compute-bound on a CPU: each drafted position costs about a prompt
    token's compute (the wide end of the pass table), and an accepted token saves its share of a plain step later.
    Counting the whole reading as the step's fixed cost instead made any draft look free beside it: every row read its
    prompt into the draft model (seconds) to draft a few tokens."""
    ctl = AdaptiveK(max_k=4, probe_every=1000)
    for tokens in (1, 2, 4, 8, 16, 32):
        ctl.observe_pass(tokens, 1, 0.08 + 0.015 * tokens)  # llama.cpp Q4_K_M on 2 cores: ~15 ms a position at 16-32
    assert ctl.measured.costs.riding(4) == pytest.approx((0.015, (0.08 + 0.015 * 4) / 4))
    for _ in range(20):
        ctl.observe_row("model", [0.8, 0.8], drafted=2, accepted=2, draft_s=0.05)  # the 0.5B: 25 ms a token
    # beside a reading a drafted position costs 15 ms + 25 ms drafting, and saves at most 35 ms
    assert ctl.batch.plan(4, reading=512).cap == 0
    # a row alone: a right token saves a 95 ms step, so a drafter that has read its prompt drafts...
    assert ctl.batch.plan(1, reading=512).cap > 0
    ctl.costs.observe_draft_prefill(64, 0.26)  # ...and one that would first read 700 tokens (2.8 s) does not
    assert ctl.batch.plan(1, unread_prompt_tokens=700, reading=512).cap == 0
    ngram = lambda n: Draft(torch.arange(n)[None], source="ngram")  # noqa: E731
    for _ in range(30):  # copied text: lookups nearly always right, and free to make
        ctl.observe_row("ngram", None, drafted=6, accepted=6, draft_s=0.0)
    # one row: a right token saves an 80-95 ms step for 15 ms of the reading pass; eight rows: ~25 ms for 15
    assert ctl.batch.plan_free(8, [ngram(6)] * 8, reading=512) == 6
    ctl.reading = 512  # as plan_step sets it for a step whose pass reads 512 prompt tokens (one row here)
    assert ctl.trim(ngram(6)).length == 6
    for _ in range(60):  # lookups right half the time: a right token (~12 ms saved at 8 rows) no longer pays 15 ms
        ctl.observe_row("ngram", None, drafted=6, accepted=0, draft_s=0.0)
        ctl.observe_row("ngram", None, drafted=6, accepted=6, draft_s=0.0)
    assert ctl.batch.plan_free(8, [ngram(6)] * 8, reading=512) == 0


def test_load_aware_control_probes_again_after_plain_steps():
    ctl = AdaptiveK(max_k=4, probe_every=2)
    for positions in (1, 2, 3, 5):
        ctl.observe_pass(positions, 4, 0.25 + 0.05 * 4 * positions)  # compute-bound: drafting never pays
    ctl.observe_row("model", [0.5], drafted=1, accepted=0, draft_s=0.05)
    caps, drafting_rows = [], []
    for _ in range(9):
        decision = ctl.batch.plan(4)
        caps.append(decision.cap)
        drafting_rows.append(sum(ctl.plan(10, batch=decision).length > 0 for _ in range(4)))
    assert caps == [0] * 7 + [1] + [0]  # every (probe_every x rows)-th step a probe...
    assert drafting_rows == [0] * 7 + [1] + [0]  # ...of one row (the others do not pay for it)


def test_load_aware_control_does_not_guess_for_a_batch():
    """A server that starts under load knows the verify cost of its batch but nothing of the draft model:
    no batch-wide drafting on a guess (it would make every row read its prompt and draft k tokens)."""
    ctl = AdaptiveK(max_k=8)
    ctl.observe_pass(1, 8, 0.30)
    assert ctl.batch.plan(8, unread_prompt_tokens=4000, ready_rows=0).cap == 0
    assert ctl.plan(10, batch=ctl.batch.plan(1)).length == 0  # a row alone first measures a plain pass...
    ctl.observe_pass(1, 1, 0.05)
    assert ctl.plan(10).length > 0  # ...then explores, and so measures the draft


def test_batch_probe_never_makes_a_row_read_its_prompt():
    ctl = AdaptiveK(max_k=4, probe_every=1)
    for positions in (1, 2, 3, 5):
        ctl.observe_pass(positions, 4, 0.25 + 0.05 * 4 * positions)  # drafting never pays
    ctl.observe_row("model", [0.5], drafted=1, accepted=0, draft_s=0.05)
    caps = [ctl.batch.plan(4, unread_prompt_tokens=400, ready_rows=0).cap for _ in range(12)]
    assert caps == [0] * 12  # probes due, but every row would first read its prompt: none
    while (decision := ctl.batch.plan(4, ready_rows=1)).cap == 0:
        pass
    lengths = [ctl.plan(10, ready, batch=decision).length for ready in (False, True, True, False)]
    assert lengths == [0, 1, 0, 0]  # the ready row probes


def test_lookup_drafts_in_a_batch_keep_what_pays():
    """Under load only free drafts are left: each row's lookup draft is verified as far as the batch's
    expected tokens per second rise, every row paying for the widest."""
    ctl = AdaptiveK(max_k=8)
    ngram = lambda n: Draft(torch.arange(n)[None], source="ngram")  # noqa: E731
    empty = Draft(torch.empty(1, 0, dtype=torch.long), source="ngram")
    assert ctl.batch.plan_free(4, [ngram(6), empty, empty, empty]) == 0  # nothing measured yet: plain
    for tokens in (4, 8, 12, 16, 20, 24, 28):
        ctl.observe_pass(tokens // 4, 4, 0.25 + 0.002 * tokens)  # 4 rows: wider passes cost a little more
    for _ in range(30):  # copied text: the lookup's tokens are nearly always right
        ctl.observe_row("ngram", None, drafted=6, accepted=6, draft_s=0.0)
    assert ctl.batch.plan_free(4, [ngram(6), empty, empty, empty]) == 6
    assert ctl.batch.plan_free(4, [empty] * 4) == 0
    for _ in range(30):  # lookups that are always wrong
        ctl.observe_row("ngram", None, drafted=6, accepted=0, draft_s=0.0)
    assert ctl.batch.plan_free(4, [ngram(6), ngram(3), empty, empty]) == 0
    steep = AdaptiveK(max_k=8)  # verification far from free: one row's draft does not pay for widening all four
    for tokens in (4, 8, 12, 16, 20, 24, 28):
        steep.observe_pass(tokens // 4, 4, 0.25 + 0.1 * tokens)
    for _ in range(30):
        steep.observe_row("ngram", None, drafted=6, accepted=6, draft_s=0.0)
    assert steep.batch.plan_free(4, [ngram(6), empty, empty, empty]) == 0
    assert steep.batch.plan_free(4, [ngram(6)] * 4) == 6


def test_adaptive_falls_back_to_plain_and_probes_again():
    ctl = AdaptiveK(max_k=6, probe_every=4)
    for _ in range(10):  # an expensive draft the target always rejects
        observe_step(ctl, "model", [0.9], drafted=1, accepted=0, draft_s=0.5, verify_s=0.2)
        observe_step(ctl, "model", None, drafted=0, accepted=0, draft_s=0.0, verify_s=0.2)
    plans = [ctl.plan(10).length for _ in range(10)]
    assert plans[:4] == [0, 0, 0, 0] and plans[4] > 0  # 4 plain steps, then a probe
    assert ctl.skipped_steps >= 8


def test_a_hopeless_draft_never_makes_a_fresh_drafter_read_or_probe():
    """A draft token dearer than two plain passes loses even if every token were accepted: a drafter that has not
    read its prompt never reads it, not even for a probe (the costs said it all), and the controller says why."""
    ctl = AdaptiveK(max_k=6, probe_every=4)
    for width, seconds in ((1, 0.2), (2, 0.3), (4, 0.5), (8, 0.9)):
        ctl.observe_pass(width, 1, seconds)
    ctl.costs.observe_draft("model", 4, 2.0)
    ctl.observe_reading(20, 0.2)
    plans = [ctl.plan(6, ready=False, unread=20, remaining=1000, generated=500).length for _ in range(300)]
    assert sum(plans) == 0 and "model drafts off" in ctl.model_off
    ready = AdaptiveK(max_k=6, probe_every=4)  # a drafter in step with the text probes at once: it costs one token
    ready.measured.costs, ready.measured.pass_line = ctl.costs, ctl.pass_line
    assert [ready.plan(6, remaining=100).length for _ in range(5)] == [0, 0, 0, 0, 1]


def test_whether_a_model_draft_can_pay_follows_the_costs_it_was_decided_on():
    """The answer is kept while the prices it read stand (it is asked at every step of fresh text), and decided again
    when the draft gets cheaper or dearer against a plain pass, or when a wide pass is measured. Plain passes dearer
    since the draft was timed price it as dearer too (the same machine runs both)."""
    ctl = AdaptiveK(max_k=6)
    for width, seconds in ((1, 0.2), (2, 0.3), (4, 0.5), (8, 0.9)):
        ctl.observe_pass(width, 1, seconds)
    ctl.costs.observe_draft("model", 1, 0.5)
    assert not ctl.model_can_pay(6) and not ctl.model_can_pay(6)
    ctl.costs.draft_token_s["model"].value = 0.01  # a draft this cheap pays
    assert ctl.model_can_pay(6) and ctl.model_off is None
    ctl.costs.draft_token_s["model"].value = 0.25
    assert not ctl.model_can_pay(6)
    for _ in range(30):  # passes five times as dear (a busy minute): the draft is priced five times as dear
        ctl.observe_pass(1, 1, 1.0)
    assert not ctl.model_can_pay(6)
    for _ in range(30):  # timed again, at a twentieth of a plain pass now
        ctl.costs.observe_draft("model", 1, 0.05)
    assert ctl.model_can_pay(1)
    for _ in range(3):  # a two-position pass measured as dear as five plain ones
        ctl.observe_pass(2, 1, 5.0)
    assert not ctl.model_can_pay(1)


def test_a_slow_stretch_does_not_keep_speculation_off():
    """Probes re-measure what the on/off rule reads: one slow stretch must not poison it for good."""
    ctl = AdaptiveK(max_k=6, probe_every=3)
    for _ in range(5):  # the machine is busy: drafting and two-position passes cost double
        observe_step(ctl, "model", [0.9], drafted=1, accepted=1, draft_s=0.3, verify_s=0.6)
        observe_step(ctl, "model", None, drafted=0, accepted=0, draft_s=0.0, verify_s=0.25)
    plans = []
    for _ in range(60):  # then it is quiet again and every drafted token is accepted
        k = ctl.plan(6, remaining=100).length
        plans.append(k)
        observe_step(ctl, "model", [0.9] * k if k else None, drafted=k, accepted=k, draft_s=0.04 * k, verify_s=0.25 + 0.005 * k)
    assert plans[:4] == [0, 0, 0, 1]  # plain steps, then a one-token probe
    assert all(k > 1 for k in plans[-10:]), plans  # speculation came back


def test_model_drafter_reads_missed_tokens_in_a_pass_of_its_own():
    """After plain steps the drafter has tokens to catch up on: read apart (not charged as drafting), same drafts."""
    prompt, missed = random_prompt(6, 8), random_prompt(7, 6)
    committed = torch.cat([prompt, missed], dim=1)
    lagging = ModelDrafter(tiny_model(3))
    lagging.prefill(prompt)
    passes = lagging.forward_passes
    draft = lagging.propose(committed, 3, SamplingParams(), None)
    assert draft.reading_s > 0 and lagging.forward_passes - passes == 1 + 3
    fresh = ModelDrafter(tiny_model(3))
    fresh.prefill(committed[:, :-1])
    assert torch.equal(fresh.propose(committed, 3, SamplingParams(), None).tokens, draft.tokens)
    # the usual step: the last drafted token and the target's are new, read with the first draft pass
    after = torch.cat([committed, draft.tokens, torch.tensor([[5]])], dim=1)
    passes = lagging.forward_passes
    assert lagging.propose(after, 2, SamplingParams(), None).reading_s == 0.0 and lagging.forward_passes - passes == 2


def _drafts_through_rollbacks(drafter: ModelDrafter) -> list[Draft]:
    """Propose / commit through a partial accept, a full accept, a catch-up and a new sequence."""
    sampling, drafts = SamplingParams(temperature=1.0), []
    prompt = random_prompt(6, 9)
    drafter.reset()
    drafter.prefill(prompt)
    drafts.append(drafter.propose(prompt, 4, sampling, StreamDraws(torch.Generator().manual_seed(0))))
    committed = torch.cat([prompt, drafts[-1].tokens[:, :2], torch.tensor([[7]])], dim=1)  # 2 of 4 accepted
    drafter.commit(committed)
    drafts.append(drafter.propose(committed, 3, sampling, StreamDraws(torch.Generator().manual_seed(1))))
    committed = torch.cat([committed, drafts[-1].tokens, torch.tensor([[9]]), random_prompt(8, 4)], dim=1)
    drafter.commit(committed[:, :-4])  # all accepted, then plain steps the drafter sat out
    drafts.append(drafter.propose(committed, 5, sampling, StreamDraws(torch.Generator().manual_seed(2))))
    drafter.reset()
    other = random_prompt(9, 5)
    drafter.prefill(other)
    drafts.append(drafter.propose(other, 4, sampling, StreamDraws(torch.Generator().manual_seed(3))))
    return drafts


def test_compiled_draft_step_drafts_what_the_eager_one_does(target):
    """The compiled one-token step shares the cache with eager wide passes: same drafts, same q, through rollbacks."""
    eager = _drafts_through_rollbacks(ModelDrafter(tiny_model(3)))
    compiled_drafter = ModelDrafter(tiny_model(3), compile=True)
    assert compiled_drafter.model._one_token_step is not None, "compilation failed on this machine"
    compiled_drafter.model._stance = "fail_on_recompile"  # the graphs compiled at load serve every step below
    compiled = _drafts_through_rollbacks(compiled_drafter)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.probs, b.probs, atol=1e-5, rtol=1e-4)
    # in the engine, with packed weights and the restricted head: the target's greedy output, the same acceptance
    compiled_engine = SpeculativeEngine(target, fast_drafter(quant="int4", compile=True), k=4)
    eager_engine = SpeculativeEngine(target, fast_drafter(quant="int4"), k=4)
    for seed, n in PROMPTS[:3]:
        prompt = random_prompt(seed, n)
        result = compiled_engine.generate(prompt, max_new_tokens=30).result()
        assert result.token_ids == reference_greedy(target, prompt, 30)
        assert result.stats.accepted_tokens == eager_engine.generate(prompt, max_new_tokens=30).result().stats.accepted_tokens


def test_a_draft_that_cannot_compile_drafts_uncompiled(monkeypatch, capsys):
    def broken_compile(fn, **kwargs):
        def fails(*args, **kw):
            raise RuntimeError("no C++ compiler")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    drafter = ModelDrafter(tiny_model(3), compile=True)
    assert drafter.model._one_token_step is None and "could not compile the draft step (RuntimeError: no C++ compiler)" in capsys.readouterr().err
    assert drafter.forward_passes == 0 and drafter.cached_ids.shape[1] == 0
    assert [d.tokens.tolist() for d in _drafts_through_rollbacks(drafter)] == [
        d.tokens.tolist() for d in _drafts_through_rollbacks(ModelDrafter(tiny_model(3)))
    ]


def test_trim_measures_a_wider_pass_once_instead_of_trusting_the_guess():
    """Past the widest pass measured the cost is a conservative guess; a long lookup draft that the guess cuts at
    that width is verified whole once, and the measurement decides from then on."""
    def controller(costs):
        ctl = AdaptiveK(max_k=8)
        for width, seconds in costs.items():
            ctl.observe_pass(width, 1, seconds)
        first, later = ctl.measured.lookup_rates("ngram", 0)
        first.value, later.judged, later.rejected = 0.85, 100.0, 15.0  # lookups right 85 % of the time
        return ctl

    long_draft = lambda: Draft(torch.arange(16)[None], source="ngram")  # noqa: E731
    flat = {width: 0.25 for width in range(1, 10)}  # one-row passes flat up to 9 positions
    ctl = controller(flat)
    assert ctl.trim(long_draft()).length == 16  # the guess would cut at 8, the widest measured: explore once
    ctl.observe_pass(17, 1, 0.26)
    assert ctl.trim(long_draft()).length >= 12  # measured cheap: keep drafting long
    assert controller({**flat, 17: 2.0}).trim(long_draft()).length == 8  # measured dear: what pays


def test_one_rejection_deep_in_a_copy_does_not_keep_its_drafts_short():
    """A copy breaks at an edit, not more often deep in a draft: one rate for a lookup's later positions learns from
    every position judged. On the AMD EPYC's llama.cpp pass table (width 32 pays only for drafts nearly always accepted
    whole) a class whose 31-token drafts are accepted whole is verified whole from its third draft, and again from the
    third after one rejection at position 10 (moving averages per position: not within eight drafts, and from the
    fourth)."""
    ctl = AdaptiveK()
    for width, ms in {1: 35, 2: 63, 4: 110, 8: 250, 16: 305, 32: 540}.items():
        ctl.observe_pass(width, 1, ms / 1e3)

    def verify(right: int) -> int:
        """Trim a 31-token copy, verify what is left: its first `right` tokens are right. Returns the length verified."""
        draft = ctl.trim(Draft(torch.arange(31)[None], source="suffix", match_len=40))
        ctl.observe_row("suffix", None, draft.length, min(right, draft.length), 0.0, match_len=40)
        return draft.length

    assert [verify(31) for _ in range(8)][-1] == 31  # learned: this class copies whole
    assert verify(10) == 31  # an edit at position 10
    assert [verify(31) for _ in range(4)][2:] == [31, 31]
    assert ctl.measured.lookup_rates("suffix", 40)[1].value > 0.98


def test_an_unjudged_short_match_class_starts_where_its_judged_siblings_stand():
    """Fresh text: a match of 2 rejected twice moves an unjudged match of 3 (and of 1) as far below its prior, so the
    next short bet waits; long matches and other sources keep their priors. Once judged, a class learns its own."""
    ctl = AdaptiveK()
    measured = ctl.measured
    for _ in range(2):
        ctl.observe_row("suffix", None, 2, 0, 0.0, match_len=2)
    shift = measured.lookup_rates("suffix", 2)[0].value - priors.POSITION_ACCEPT_BY_MATCH[2]
    assert shift < -0.1
    assert measured.lookup_rates("suffix", 3)[0].value == pytest.approx(priors.POSITION_ACCEPT_BY_MATCH[3] + shift)
    assert measured.lookup_rates("suffix", 1)[0].value == pytest.approx(priors.POSITION_ACCEPT_BY_MATCH[1] + shift)
    assert measured.lookup_rates("suffix", 20)[0].value == priors.POSITION_ACCEPT_BY_MATCH[6]
    assert measured.lookup_rates("ngram", 3)[0].value == priors.POSITION_ACCEPT_BY_MATCH[3]
    ctl.observe_row("suffix", None, 1, 1, 0.0, match_len=3)  # judged: its own rate from the shifted start
    own = measured.lookup_rates("suffix", 3)[0].value
    assert own == pytest.approx(priors.POSITION_ACCEPT_BY_MATCH[3] + shift + priors.EMA_ALPHA * (1 - priors.POSITION_ACCEPT_BY_MATCH[3] - shift))
    ctl.observe_row("suffix", None, 2, 2, 0.0, match_len=2)  # a sibling's later judgement no longer moves it
    assert measured.lookup_rates("suffix", 3)[0].value == own


def test_context_chains_follow_the_latest_continuation_and_forget_the_oldest():
    chains = ContextChains(context=2, shortest=3, longest=5)
    chains.add(np.array([1, 2, 3, 4, 5, 6, 7]), 0, request=7)
    assert chains.follow(np.array([9, 1, 2]), 8) == ([3, 4, 5, 6, 7], 7)  # from the last 2 tokens, up to 5; seen by 7
    assert chains.follow(np.array([1, 2]), 4) == ([3, 4, 5, 6], 7)  # k cuts
    assert chains.follow(np.array([5, 6]), 8) == ([], -1)  # chains 1 token: short of 3
    assert chains.follow(np.array([1, 2]), 2) == ([], -1)  # k under the shortest chain offered
    chains.add(np.array([1, 2, 9, 9, 9, 9]), 2, request=8)  # [1, 2] seen again (by 8), followed by 9 now
    assert chains.follow(np.array([1, 2]), 8) == ([9, 9, 9, 9, 9], 8)
    assert chains.follow(np.array([3, 4]), 8) == ([5, 6, 7], 7)  # the first link decides whose chain it is
    small = ContextChains(context=2, shortest=1, longest=4, capacity=3)
    small.add(np.array([1, 2, 3, 4, 5, 6]), 0)  # four contexts, three kept: [1, 2] dropped
    assert small.follow(np.array([1, 2]), 4) == ([], -1) and small.follow(np.array([2, 3]), 4) == ([4, 5, 6], 0)
    with pytest.raises(ValueError, match="shortest <= longest"):
        ContextChains(shortest=8, longest=4)


def test_suffix_drafts_a_long_copy_as_a_chain_across_requests():
    """Where the text's last 24 tokens occurred before and chain on for 48+, the suffix drafter offers that chain
    (source suffix/chain, up to k); a shorter repetition stays a suffix-tree draft; a later request sharing the
    drafter's root drafts from an earlier one's text."""
    text = random_prompt(5, 80, vocab=5000)[0].tolist()
    first = SuffixDrafter()
    first.begin(torch.tensor([text]))
    draft = first.propose_free(torch.tensor([text + text[:30]]), 63)
    assert draft.source == "suffix/chain" and draft.match_len == 24
    assert draft.tokens[0].tolist() == (text[30:] + text[:30])[:63]
    first.reset()
    later = first.spawn()
    other = random_prompt(6, 20, vocab=5000)[0].tolist() + text[10:40]
    later.begin(torch.tensor([other]))
    copied = later.propose_free(torch.tensor([other]), 63)
    assert copied.source == "earlier/chain" and copied.tokens[0].tolist() == (text[30:] + text[:30])[10:73]
    alone = SuffixDrafter()  # text[:20] again: 20 tokens match, a context of 24 does not; the copy is followed
    alone.begin(torch.tensor([text]))
    short = alone.propose_free(torch.tensor([text + text[:20]]), 63)
    assert short.source == "suffix/copy" and short.match_len == 20 and short.tokens[0].tolist() == text[20:] + text[:3]
    fresh = SuffixDrafter()  # nothing repeated 8 tokens long: no copy, the tree's short match
    fresh.begin(torch.tensor([text]))
    assert fresh.propose_free(torch.tensor([text + text[:5]]), 63).source == "suffix"


def test_a_short_match_the_text_went_on_from_differently_is_priced_apart():
    """A 1-3 token match whose earlier occurrences went on in different ways ("contested": its likeliest next token
    under half) drafts as its own source, priced from priors.CONTESTED_ACCEPT: verified where a 2-wide pass costs about
    what a plain one does (torch bf16 on the AMX Xeon), not where it costs 1.35 plain ones (llama.cpp there), where the
    same match seen once goes on at its class's prior."""
    once, twice = [10, 1, 2, 3, 11, 12, 1, 2], [10, 1, 2, 3, 11, 1, 2, 4, 12, 1, 2]
    drafts = {}
    for name, text in (("once", once), ("twice", twice)):
        drafter = SuffixDrafter()
        drafter.begin(torch.tensor([text]))
        drafts[name] = drafter.propose_free(torch.tensor([text]), 8)
    assert (drafts["once"].source, drafts["once"].match_len, drafts["once"].tokens[0].tolist()) == ("suffix", 2, [3, 11])
    assert drafts["twice"].source == "suffix/contested" and drafts["twice"].match_len == 2

    def verified(curve: dict[int, float], draft: Draft) -> int:
        return calibrated_controller(curve).trim(copy.deepcopy(draft)).length

    amx_llama = {1: 66, 2: 89, 4: 99, 8: 122, 16: 147, 32: 199}  # cpu-profiles.json, xeon_amx
    amx_torch = {1: 191, 2: 195, 4: 192, 8: 195, 16: 202, 32: 232}
    assert verified(amx_llama, drafts["once"]) > 0 and verified(amx_llama, drafts["twice"]) == 0
    assert verified(amx_torch, drafts["twice"]) > 0


@pytest.mark.parametrize("chains", [True, False])
def test_a_request_asked_again_copies_the_earlier_answer_where_prompt_copies_had_failed(chains):
    """Drafts from earlier requests (a chain whose first link another request recorded: `earlier/chain`; without
    chains, the tree over answers: `answers`) are priced apart from matches in the request's own text. A server
    whose long prompt matches broke at once (a question quoted, then left) still copies a repeated request's answer in
    long drafts; priced as one source, the repeat drafted one token a step."""
    ctl = AdaptiveK()
    for width, ms in {1: 35, 2: 63, 4: 110, 8: 250, 16: 305, 32: 540, 64: 860}.items():  # AMD EPYC llama.cpp
        ctl.observe_pass(width, 1, ms / 1e3)
    for source in ("suffix", "suffix/chain"):
        for _ in range(6):
            ctl.observe_row(source, None, 15, 0, 0.0, match_len=30)
    prompt, answer = (random_prompt(seed, n, vocab=5000)[0].tolist() for seed, n in ((11, 60), (12, 80)))
    root = SuffixDrafter(chains=None if chains else ContextChains(shortest=1000, longest=1000))  # or: never offered

    def serve(drafter) -> tuple[int, dict]:
        """Decode `answer` greedily (each draft judged against it) -> (passes, {source: accepted tokens})."""
        drafter.begin(torch.tensor([prompt]))
        done = passes = 0
        accepted_by: dict[str, int] = {}
        while done < len(answer):
            ids = torch.tensor([prompt + answer[:done]])
            draft = ctl.trim(drafter.propose_free(ids, 63))
            accepted = 0
            while accepted < min(draft.length, len(answer) - done - 1) and draft.tokens[0, accepted] == answer[done + accepted]:
                accepted += 1
            if draft.length:
                ctl.observe_row(draft.source, None, draft.length, accepted, 0.0, match_len=draft.match_len)
                accepted_by[draft.source] = accepted_by.get(draft.source, 0) + accepted
            done, passes = done + accepted + 1, passes + 1
        drafter.commit(torch.tensor([prompt + answer]))
        drafter.reset()
        return passes, accepted_by

    first_passes, _ = serve(root)
    assert first_passes >= len(answer) - 5  # nothing to copy yet
    passes, accepted_by = serve(root.spawn())
    # a chain copies from the first token; the tree's drafts grow with the match (up to its length), and on this curve
    # matches under 8 tokens are not worth a wider pass at their priors
    assert passes <= (4 if chains else len(answer) // 4), (passes, accepted_by)
    assert accepted_by.get("earlier/chain" if chains else "answers", 0) >= 60, accepted_by


def test_a_rerun_after_forget_last_request_drafts_as_the_first_run_did():
    """A benchmark's repeat (or `generate --compare`) reruns a request: the suffix drafter must not copy the earlier
    run's answer, from its tree of earlier answers or from its chains, and what requests before it taught stays."""
    earlier, prompt = (random_prompt(seed, 60, vocab=5000)[0].tolist() for seed in (7, 8))
    answer = earlier[:40] + random_prompt(9, 50, vocab=5000)[0].tolist()  # copies an earlier request, then new text

    def run(drafter) -> list:
        drafter.begin(torch.tensor([prompt]))
        drafts = []
        for n in range(len(answer)):
            ids = torch.tensor([prompt + answer[:n]])
            drafter.commit(ids)
            draft = drafter.propose_free(ids, 63)
            drafts.append((draft.source, draft.match_len, draft.tokens[0].tolist()))
        drafter.commit(torch.tensor([prompt + answer]))
        drafter.reset()
        return drafts

    def root_after_earlier_request() -> SuffixDrafter:
        root = SuffixDrafter(chains=ContextChains(context=4, shortest=8, longest=16))
        root.begin(torch.tensor([earlier]))
        root.commit(torch.tensor([earlier + earlier[:5]]))
        root.reset()
        return root

    root = root_after_earlier_request()
    first = run(root)
    assert any(source == "earlier/chain" for source, *_ in first)  # the earlier request's text chains
    root.forget_last_request()
    assert run(root) == first
    assert run(root) != first  # a rerun that remembers copies the first run's answer (tree and chains)
    root = root_after_earlier_request()
    twin = root.spawn()  # another drafter of the same root (a server's next row) shares what it learns
    assert run(twin) == first
    root.forget_last_request()  # only its own last request: the twin's stays
    assert run(root) != first


def test_a_pass_measured_dearer_than_a_wider_one_runs_padded():
    """Where the backend pads passes, a width measured dearer than a wider one is run (and priced) at the wider one
    (AMD EPYC llama.cpp at a 1,150-token context: 58 positions 1,113 ms, 64 972); one not measured is not padded (the
    table interpolates it), and neither is a batch's pass or a backend that does not pad."""
    ctl = AdaptiveK()
    for width, ms in {1: 40, 2: 72, 4: 124, 8: 261, 16: 355, 32: 596, 64: 972}.items():
        ctl.observe_pass(width, 1, ms / 1e3)
    ctl.pads = True
    assert ctl.pass_width(58) == 58  # interpolated: 878 ms
    ctl.observe_pass(58, 1, 1.113)
    assert ctl.pass_width(58) == 64 and ctl.pass_width(64) == 64 and ctl.pass_width(17) == 17
    copy = lambda: Draft(torch.arange(57)[None], source="suffix/chain", match_len=24)  # noqa: E731
    for _ in range(6):  # long copies accepted whole
        draft = ctl.trim(copy())
        ctl.observe_row("suffix/chain", None, draft.length, draft.length, 0.0, match_len=24)
    assert ctl.trim(copy()).length == 57  # priced at the 64-wide pass
    ctl.pads = False
    assert ctl.pass_width(58) == 58 and ctl.trim(copy()).length == 31  # at 1,113 ms the 32-wide pass pays more
    ctl.pads, ctl.rows = True, 2
    assert ctl.pass_width(58) == 58


def test_a_padded_width_is_timed_again_now_and_then():
    """A plain pass priced in a busy minute above a 2-wide one is padded; every PAD_RECHECK-th time it runs at its own
    width, so once the machine is quiet again plain passes run unpadded within a few rechecks (padded for good before:
    every step ran 2-wide)."""
    ctl = AdaptiveK()
    true_ms = {1: 36, 2: 59, 4: 90, 8: 209}
    for width, ms in true_ms.items():
        ctl.observe_pass(width, 1, ms / 1e3)
    ctl.pads = True
    for _ in range(12):  # a busy stretch: plain passes at 75 ms
        ctl.observe_pass(1, 1, 0.075)
    for _ in range(12):  # then 2-wide passes at their usual price (one-token drafts), plain ones not run
        ctl.observe_pass(2, 1, 0.059)
    widths = []
    for _ in range(8 * priors.PAD_RECHECK):  # plain steps on a quiet machine, each timed at its width's price
        widths.append(ctl.pass_width(1))
        ctl.observe_pass(widths[-1], 1, true_ms[widths[-1]] / 1e3)
    assert widths[0] == 2 and widths.count(1) > 0
    assert widths[-priors.PAD_RECHECK:] == [1] * priors.PAD_RECHECK


def test_one_descheduled_pass_does_not_price_the_passes_after_it():
    """A plain pass that took seconds (its threads descheduled under a CPU hog: ~13 s for a 33 ms pass) moves its price
    by at most TIMING_JUMP x one sample. Before, its average (2.6 s) made the next width measured (a 7-wide draft at
    its usual 160 ms) look 0.06 plain passes, so every plain pass ran padded 7-wide (AMD EPYC: ITL 60-100 against 32 ms
    after the machine was quiet), the plain price coming back only 1 in PAD_RECHECK passes. A real slowdown is still
    followed."""
    ctl = AdaptiveK()
    true_ms = {1: 36, 2: 59, 4: 90, 7: 160, 8: 209}
    for width, ms in true_ms.items():
        if width != 7:
            ctl.observe_pass(width, 1, ms / 1e3)
    ctl.pads = True
    ctl.observe_pass(1, 1, 13.0)
    ctl.observe_pass(7, 1, 0.160)
    assert ctl.costs.verify_time(1) <= 0.036 * (1 + priors.EMA_ALPHA * (priors.TIMING_JUMP - 1)) + 1e-9
    widths = []
    for _ in range(2 * priors.PAD_RECHECK):
        widths.append(ctl.pass_width(1))
        ctl.observe_pass(widths[-1], 1, true_ms[widths[-1]] / 1e3)
    assert widths == [1] * len(widths)
    for _ in range(8):  # the machine really slows down: plain passes at 3x
        ctl.observe_pass(1, 1, 0.108)
    assert ctl.costs.verify_time(1) > 0.09


def test_a_width_priced_dear_in_a_busy_minute_comes_back_to_its_price_at_load():
    """Wide passes timed in a busy minute can stay priced far above their cost after it (2- and 3-wide at 4x, AMD EPYC
    under a CPU hog), and a width priced too dear is never drafted, so never timed again. Its excess over its price by
    the table timed at load (in plain passes; interpolated for a width first timed in the busy minute) halves every
    STALE_HALF_LIFE passes it is not run; one measured again prices it as measured."""
    ctl = AdaptiveK()
    true_ms = {1: 36, 2: 59, 4: 90, 8: 209}
    for width, ms in true_ms.items():
        ctl.observe_pass(width, 1, ms / 1e3)
    ctl.costs.keep_load_prices()
    for _ in range(12):  # a busy minute: plain passes at 100 ms, 2-wide ones at 400, a first 3-wide one at 3 s
        ctl.observe_pass(1, 1, 0.100)
    for _ in range(6):
        ctl.observe_pass(2, 1, 0.400)
    ctl.observe_pass(3, 1, 3.0)
    for _ in range(16):  # quiet again: plain passes only (nothing drafts at such prices)
        ctl.observe_pass(1, 1, 0.036)
    assert ctl.costs.verify_time(2) > 1.5 * 0.059 and ctl.costs.verify_time(3) > 3 * 0.0745
    for _ in range(5 * priors.STALE_HALF_LIFE):
        ctl.observe_pass(1, 1, 0.036)
    assert ctl.costs.verify_time(2) == pytest.approx(0.059, rel=0.05)
    assert ctl.costs.verify_time(3) == pytest.approx(0.0745, rel=0.1)  # between 2- and 4-wide at load
    assert ctl.costs.verify_time(4) == pytest.approx(0.090, rel=0.05)  # never dear: unmoved
    ctl.observe_pass(2, 1, 0.070)  # timed again: its own price from there
    assert 0.059 < ctl.costs.verify_time(2) < 0.070


def test_a_width_dearer_than_at_load_is_priced_as_it_runs_after_one_pass():
    """A width that really costs more than the table at load says (a batch's pass at deep contexts: 2x a plain step
    where the table said 1.2x, AMX Xeon) relaxes toward the table while not run; the next pass it runs counts as much
    as the price had relaxed, so one pass prices it again (not five at EMA_ALPHA, each a bet at the wrong price)."""
    ctl = AdaptiveK()
    true_ms = {1: 36, 2: 59, 4: 90, 8: 209}
    for width, ms in true_ms.items():
        ctl.observe_pass(width, 1, ms / 1e3)
    ctl.costs.keep_load_prices()
    for _ in range(10):
        ctl.observe_pass(4, 1, 0.180)  # twice the table's price, every time it runs
    assert ctl.costs.verify_time(4) == pytest.approx(0.180, rel=0.15)
    for _ in range(5 * priors.STALE_HALF_LIFE):
        ctl.observe_pass(1, 1, 0.036)
    assert ctl.costs.verify_time(4) < 0.1
    ctl.observe_pass(4, 1, 0.180)
    assert ctl.costs.verify_time(4) > 0.17


def test_a_refined_source_starts_where_its_parent_stands():
    """A chain draft (source "suffix/chain") is first priced by what this engine learned of its parent's long matches,
    not by a prior: where long copies broke early it is cut short; where its parent never drafted, the prior decides."""
    chain = lambda: Draft(torch.arange(63)[None], source="suffix/chain", match_len=24)  # noqa: E731
    fresh = epyc_controller().trim(chain()).length
    assert fresh >= 15  # the 16+ class's prior (0.95) verifies a long copy
    broke_early = epyc_controller()
    for _ in range(6):  # the parent's long matches: right for 2 tokens, then wrong
        draft = broke_early.trim(Draft(torch.arange(31)[None], source="suffix", match_len=30))
        broke_early.observe_row("suffix", None, draft.length, min(2, draft.length), 0.0, match_len=30)
    assert broke_early.trim(chain()).length < fresh
    first, later = broke_early.measured.lookup_rates("suffix/chain", 24)
    parent_first, parent_later = broke_early.measured.lookup_rates("suffix", 30)
    assert (first.value, later.value) == (parent_first.value, parent_later.value)
    broke_early.observe_row("suffix/chain", None, 4, 4, 0.0, match_len=24)  # then it learns its own
    assert later.value > parent_later.value and first is not parent_first


def test_adaptive_drafts_long_when_cheap_and_accepted():
    ctl = AdaptiveK(max_k=8)
    for _ in range(20):
        observe_step(ctl, "model", [0.99] * 8, drafted=8, accepted=8, draft_s=0.08, verify_s=0.25)
        observe_step(ctl, "model", None, drafted=0, accepted=0, draft_s=0.0, verify_s=0.24)
    plan = ctl.plan(8, remaining=20)
    assert plan.length == 8
    assert all(plan.keep_going(i, 0.99) for i in range(1, 5))
    assert not ctl.plan(8, remaining=20).keep_going(1, 0.05)  # a draft token this unsure: stop drafting


def test_adaptive_trims_ngram_drafts_that_never_hit():
    ctl = AdaptiveK(max_k=8)
    for _ in range(30):
        observe_step(ctl, "ngram", None, drafted=8, accepted=0, draft_s=0.0, verify_s=0.30)
        observe_step(ctl, "ngram", None, drafted=0, accepted=0, draft_s=0.0, verify_s=0.20)
    draft = ctl.trim(Draft(torch.arange(8)[None], source="ngram"))
    assert draft.length == 0


@pytest.mark.parametrize(
    "name, expected",
    [
        ("spec", ("qwen", 5, False)),
        ("spec:ngram", ("ngram", 5, False)),
        ("spec:ngram:8", ("ngram", 8, False)),
        ("spec:auto", ("auto", 8, True)),
        ("spec:auto:a8", ("auto", 8, True)),
        ("spec:auto:qwen", ("auto:qwen", 8, True)),
        ("spec:qwen+int8+head:a6", ("qwen+int8+head", 6, True)),
    ],
)
def test_parse_spec_method(name, expected):
    assert parse_spec_method(name, "qwen", None) == expected


def test_self_drafter_shares_weights_and_keeps_the_target_whole():
    from specdecode import SelfDrafter

    target = tiny_model(21, layers=3, sharpness=8.0)
    drafter = SelfDrafter(target, layers=1)
    assert len(target.model.layers) == 3 and target.config.num_hidden_layers == 3
    shallow = drafter.model.hf_model
    assert len(shallow.model.layers) == 1
    assert shallow.model.layers[0] is target.model.layers[0]
    assert shallow.lm_head is target.lm_head
    for seed, n in PROMPTS[:4]:
        prompt = random_prompt(seed, n)
        result = SpeculativeEngine(target, drafter, k=3).generate(prompt, max_new_tokens=20).result()
        assert result.token_ids == reference_greedy(target, prompt, 20)
        assert result.stats.draft_passes > 0


def test_self_drafter_calibrates_on_the_first_prompt(monkeypatch):
    """The depth is chosen at the first prefill: where one pays the drafter drafts with it, where none does it proposes
    nothing. Which one this tiny model gets is its business; both branches run here, the choice forced."""
    from specdecode import SelfDrafter
    from specdecode.drafters import early_exit

    target = tiny_model(21, layers=3, sharpness=8.0)
    prompt = random_prompt(1, 24)
    agreement = early_exit.early_exit_agreement(target, prompt)
    assert len(agreement) == 2 and all(0.0 <= a <= 1.0 for a in agreement)
    layers, rate = early_exit.calibrate_layers(target, prompt)
    assert layers is None or (1 <= layers < 3 and rate > 1.0)
    for chosen in (1, None):
        monkeypatch.setattr(early_exit, "calibrate_layers", lambda target, ids, chosen=chosen: (chosen, 1.5))
        drafter = SelfDrafter(target)
        result = SpeculativeEngine(target, drafter, k=3).generate(prompt, max_new_tokens=12).result()
        assert result.token_ids == reference_greedy(target, prompt, 12)
        assert drafter.layers == chosen
        assert (result.stats.drafted_tokens > 0) == (chosen is not None)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9])
def test_long_ngram_drafts_respect_the_budget(target, max_new_tokens):
    """auto lets n-gram drafts run past k; never past max_new_tokens."""
    prompt = random_prompt(6, 5)
    drafter = ComboDrafter(fast_drafter(), min_match=1, lookup_stretch=4)
    result = SpeculativeEngine(target, drafter, k=3).generate(prompt, max_new_tokens=max_new_tokens).result()
    assert result.token_ids == reference_greedy(target, prompt, max_new_tokens)
    assert result.stats.drafted_tokens <= result.stats.steps * (max_new_tokens - 1)


def test_stats_count_steps_drafted_and_accepted_tokens_by_drafter(target):
    """auto mixes lookups and model drafts: the per-source tallies add up to the totals."""
    model = fast_drafter()
    engine = SpeculativeEngine(target, ComboDrafter(model, min_match=2), k=6)  # fixed k: no timing in the decisions
    stats = engine.generate(random_prompt(3, 10), max_new_tokens=40).result().stats
    assert set(stats.by_source) == {"ngram", model.name}, stats.by_source  # this prompt gets both
    steps, drafted, accepted = (sum(t[i] for t in stats.by_source.values()) for i in range(3))
    assert (steps, drafted, accepted) == (stats.drafted_per_position[0], stats.drafted_tokens, stats.accepted_tokens)


def test_the_copy_pointer_follows_a_copy_through_an_insertion_and_a_jump():
    """An answer copying its input in order: found on 8 tokens anywhere, left for an inserted comment and followed
    again where it resumes; a jump far ahead (out of the window where a short match may resync) is found on 8 tokens."""
    source = list(range(100, 400))
    prompt = np.array([1, 2, 3] + source + [4, 5], dtype=np.int32)
    copy = CopyPointer(start=len(prompt))
    text = lambda *parts: np.concatenate([prompt] + [np.array(p, dtype=np.int32) for p in parts])  # noqa: E731
    copy.follow(text(source[:10]))
    assert copy.run == 10 and copy.draft(text(source[:10]), 5) == source[10:15]
    copy.follow(text(source[:10], [900, 901]))  # a comment: the copy is left
    assert copy.run == 0 and copy.draft(text(source[:10], [900, 901]), 5) == []
    resumed = text(source[:10], [900, 901], source[10:13])
    copy.follow(resumed)
    assert copy.run == 3 and copy.draft(resumed, 4) == source[13:17]
    jumped = text(source[:10], [900, 901], source[10:13], source[200:208])  # 190 tokens ahead
    copy.follow(jumped)
    assert copy.draft(jumped, 4) == source[208:212]
    fresh = CopyPointer(start=len(prompt))
    fresh.follow(text([7, 8, 9, 10, 11, 12, 13, 14, 15]))
    assert fresh.draft(text([7, 8, 9, 10, 11, 12, 13, 14, 15]), 4) == []


def _last_match_by_search(text: np.ndarray, m: int, lo: int, hi: int, near: int | None) -> int | None:
    """GramIndex.last_match's contract written as a search over every start."""
    if hi <= lo or len(text) < m + 1:
        return None
    ends = [s + m for s in range(lo, hi) if list(text[s : s + m]) == list(text[-m:])]
    if not ends:
        return None
    return ends[-1] if near is None else min(ends, key=lambda end: (abs(end - near), end))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=80), st.sampled_from([1, 3, 8]), st.data())
def test_the_gram_index_finds_what_a_search_of_the_text_finds(tokens, m, data):
    """Over a text growing a token at a time (as the copy pointer sees it), the index's earlier occurrence of the
    tail is the search's: the nearest to `near` (the earlier of two as near) or the latest, inside lo..hi only."""
    index = GramIndex(m)
    for n in range(1, len(tokens) + 1):
        text = np.array(tokens[:n], dtype=np.int32)
        hi = data.draw(st.integers(-2, max(n - m, -1)))
        lo = data.draw(st.integers(0, max(hi, 0)))
        near = data.draw(st.none() | st.integers(0, n))
        assert index.last_match(text, lo, hi, near) == _last_match_by_search(text, m, lo, hi, near)


def test_the_gram_index_takes_the_earlier_of_two_occurrences_as_near():
    text = np.array([5, 7, 0, 7, 1, 1, 7, 2, 7], dtype=np.int32)  # the tail 7 ends at 2, 4, 7 (and 9: itself)
    index = GramIndex(1)
    assert [index.last_match(text, 0, 8, near) for near in (3, 5, 6, None)] == [2, 4, 7, 7]
    assert index.last_match(text, 2, 8, 3) == 4 and index.last_match(text, 0, 3, 9) == 2


def test_the_copy_pointer_writes_a_learned_rename_into_later_drafts():
    """A variable renamed where the answer first meets it (the source's token 110, written as 777 777) is written
    renamed where the copy meets it again; the draft runs on past it."""
    source = list(range(100, 140))
    source[30] = 110  # the variable again
    prompt = np.array([1, 2] + source + [3], dtype=np.int32)
    copy = CopyPointer(start=len(prompt))
    answer = source[:10] + [777, 777] + source[11:29]  # renamed, then copied on (found again on 3 tokens, near)
    text = np.concatenate([prompt, np.array(answer, dtype=np.int32)])
    for end in range(len(prompt) + 1, len(text) + 1):  # a token a step, as the engine commits them
        copy.follow(text[:end])
    assert copy.draft(text, 5) == [source[29], 777, 777, source[31], source[32]]
