"""Every number the controller assumes before, or instead of, measuring — in one place, each with its reason.
Times are never among them: what a pass or a draft token costs is measured on the machine that runs
(`calibrate` at load, then every step), because it differs by 100x between CPUs and backends."""

# Moving averages
EMA_ALPHA = 0.2  # costs and acceptance remember ~5 steps: quick to follow a change in the text or the machine's load
PASS_LEVEL_ALPHA = 0.3  # a pass's level follows the context length, which grows every step
LEAF_HIT_ALPHA = 0.1  # a leaf hit is learned only at rejections, a rare and noisy event

# Acceptance before anything is judged
FIRST_ACCEPT = 0.6  # a step's first draft token; the Qwen pair measured 0.55-0.8 by task, so drafting starts hopeful
CALIBRATION_WEIGHT = 4.0  # each confidence bin starts as 4 judged tokens on the identity (a calibrated draft)
# A lookup draft's first token by match class (measurements.match_class: unknown, 1, 2, 3, 4-7, 8-15, 16+ tokens): a
# longer match predicts copying better (unknown: no better guess than a coin).
# Suffix drafts on the Qwen pair's code edits measured 0.40, 0.48, 0.40, 0.68, 0.60, 0.98-1.0 on the AVX-512 EPYC,
# and 0.18, 0.49, 0.85 for matches of 1, 2, 3 after seven edits on the Ice Lake Xeon; fresh code (`make demo`) 0.24
# for matches of 1-3. Short ones stay near 0.5: a request tries them, and one or two rejections stop a class. Set at
# 0.40-0.45 they were rarely tried, matches of 3 were never learned to pay, and code edits lost 5-10 % (decode only;
# docs/results.md). Long ones are kept high: where a wide pass costs ~11 plain ones (llama.cpp, AVX-512 EPYC: width
# 16), a long copy is verified only above ~0.95, and below that prior it was never tried
POSITION_ACCEPT_BY_MATCH = (0.5, 0.45, 0.5, 0.5, 0.6, 0.8, 0.95)
# Matches of 1-3 tokens copy or not together, by the text (fresh code: 0.24 for all three): a class not judged yet
# starts as far from its prior as its judged siblings stand from theirs. Longer classes keep their own priors: on code
# edits short matches were right 40-48 % of the time and 16+ ones 98 %
SHORT_MATCH_CLASSES = (1, 2, 3)
# A short match the text went on from in more than one way (drafters/suffix.py: "contested"): its likeliest next token
# was right 9-20 % of the time on Spec-Bench answers, 6-33 % on fresh code and code edits (session 46's offers), where
# a short match seen once was right 37-45 %. Low, so it is verified only where a wider pass costs almost nothing
CONTESTED_ACCEPT = 0.15
# A lookup draft's later positions share one rate per match class (measurements.CopyRate): it starts as this many
# judged positions at the class's prior and forgets at this rate a judged position (half weight after ~35: about one
# long draft, so one rejection stops a copy's long drafts for a draft or two, not for dozens of steps)
COPY_PRIOR_WEIGHT = 4.0
COPY_DECAY = 0.98
# A lookup's position after a sentence's end, before any is judged (control/sentences.py): copies of prose broke there
# 25-100 % of the time (Spec-Bench answers), copies of code's comments never; a coin leaning to copying
AFTER_SENTENCE_ACCEPT = 0.7
LEAF_HIT = 0.3  # a rejection's correction among the runner-ups: measured ~42 % on the Qwen pair; lower, so leaves earn their width

# Margins: estimates are noisy and a wrong switch costs
MIN_GAIN = 1.05  # one sequence drafts only for a predicted 5 % over plain decoding
BATCH_MIN_GAIN = 1.15  # a batch, for 15 %: every row pays a draft and the pass widens for all
FREE_MIN_GAIN = 1.05  # lookup drafts switch nothing on (no reading, no draft model): a small margin
# A request's loss limit: a lookup bet goes out only as wide as its worst case (every drafted position rejected) could
# lose, in plain passes, within LOSS_STAKE + LOSS_SHARE x the tokens the request has made + what its drafts have saved
# so far. Acceptance rates are shared across requests: copies that ran long in one summary priced 63-wide bets in the
# next, whose copies broke at their first token (one 860 ms pass against a 35 ms plain one). A request that copies
# earns its wide bets within a few drafts. Replayed on four pass curves (AMD EPYC at 200 and 1,150 tokens, AVX2,
# AMX), stakes 4-12 and shares 0.05-0.2 all lifted Spec-Bench's worst prompt from 0.74x to 0.86-0.90x on the EPYC
# curve, and the code edits moved within the replay's noise (docs/results.md, session 36)
LOSS_STAKE = 8.0
LOSS_SHARE = 0.15

# Probing: drafting judged to lose is tried again now and then, more rarely while it keeps losing
PROBE_EVERY = 8  # plain steps before the first probe
MAX_PROBE_INTERVAL = 128  # at most this many: a probe then costs < 1 % even where a draft token costs two passes
START_DRAFT = 1  # a fresh controller's first draft is short: where each position costs, 8 tokens + leaves took 8 s (AVX2)
REGIME_CHANGE = 0.5  # a draft token this much cheaper than its average says the machine's load changed: probe soon
# A one-row pass run padded (a wider width measured cheaper) runs at its own width every this many times: else a plain
# pass priced in a busy minute above a 2-wide one is padded for good, never timed again (docs/results.md, session 42)
PAD_RECHECK = 16
# A pass or draft timed above this many times its average counts as this many: under a CPU hog (two busy processes on
# the 2 cores) one 33 ms plain pass took ~13 s, and the average it left (2.6 s) priced every width through the plain
# pass for hundreds of steps after the machine was quiet (ITL 60-100 against 32 ms; docs/results.md, session 43). A real
# slowdown is still followed: 1.4x a sample at EMA_ALPHA
TIMING_JUMP = 3.0
# A wide pass's price above the table timed at load (in plain passes) halves its excess every this many passes it is
# not run (CostModel._now): ~2 s of plain decoding on a CPU. A width priced too dear is never drafted, so never timed
# again: after a CPU hog 2- and 3-wide passes stayed priced at 4x their cost (docs/results.md, session 43)
STALE_HALF_LIFE = 64

# What a model draft could reach at best: where even this acceptance cannot beat plain decoding on the measured
# costs, the draft model is never run (no prompt reading, no probe). The Qwen pair's best task measured 0.8.
BEST_ACCEPT = 0.9
# Reading: a draft model reads the prompt once the answer so far, at the expected saving per token, would have earned
# back this many readings (ski rental: 1 costs at most twice what knowing the answer's length would have)
READ_PAYBACK = 1.0

# Verify-cost model
UNMEASURED_GROWTH = 0.5  # past the widest pass measured, cost grows at least half proportionally (batches are not free)
MIN_WIDTH_GAP = 3  # a slope needs passes this far apart in width: closer ones differ mostly by noise
SLOPE_SAMPLES = 9  # the slope is the median of this many: a hiccup does not move it
