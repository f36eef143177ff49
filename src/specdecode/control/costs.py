"""What the controller measures: costs of draft tokens and verify passes, and how acceptance follows confidence."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import priors


class Ema:
    """An exponential moving average. `jump`: a sample above jump x the average counts as jump x it (timings: one
    pass descheduled for seconds must not price every later pass, while a real slowdown is still followed within a
    few samples)."""

    def __init__(self, alpha: float, value: float | None = None, jump: float | None = None):
        self.alpha, self.value, self.jump = alpha, value, jump

    def update(self, x: float, weight: float | None = None) -> None:
        """weight: the sample's share instead of alpha (an average gone stale is mostly a guess)."""
        if self.value is None:
            self.value = x
            return
        if self.jump is not None and self.value > 0:
            x = min(x, self.jump * self.value)
        weight = self.alpha if weight is None else weight
        self.value = (1 - weight) * self.value + weight * x


def _timing(alpha: float = priors.EMA_ALPHA) -> Ema:
    return Ema(alpha, jump=priors.TIMING_JUMP)


class ConfidenceCalibrator:
    """P(accept | draft confidence) in confidence bins; starts from the identity (a calibrated draft
    is accepted with its own probability) and learns from every token the target judged."""

    BINS = 10

    def __init__(self, prior_weight: float = priors.CALIBRATION_WEIGHT):
        self.bins = [[(b + 0.5) / self.BINS * prior_weight, prior_weight] for b in range(self.BINS)]  # [accepted, seen]

    def _bin(self, confidence: float) -> list[float]:
        return self.bins[min(int(confidence * self.BINS), self.BINS - 1)]

    def predict(self, confidence: float) -> float:
        accepted, seen = self._bin(confidence)
        return accepted / seen

    def update(self, confidences: list[float], accepted_len: int) -> None:
        # Tokens after the first rejection were never judged by the target: they teach nothing.
        for i, conf in enumerate(confidences[: accepted_len + 1]):
            b = self._bin(conf)
            b[0] += 1.0 if i < accepted_len else 0.0
            b[1] += 1.0


@dataclass
class CostModel:
    """Seconds per draft token and per verify pass, as moving averages. One row's passes are kept by width
    (`verify_s`: the curve timed at load, then every step); a batch's by (rows, positions) (`batch_s`). A batch pass
    not measured yet is priced as the batch's own plain pass scaled by the one-row curve (its pass of rows x positions
    tokens against one of rows tokens): 8 rows decoding deep contexts cost 250 ms a plain step where one row's 8-wide
    pass at load cost 150, so the load table's 32-token price (300 ms) made a 4-wide batch pass look 1.2x a plain
    step; it ran 1.7-2.2x (AMX Xeon, llama.cpp)."""

    alpha: float = priors.EMA_ALPHA
    draft_token_s: dict[str, Ema] = field(default_factory=dict)
    verify_s: dict[int, Ema] = field(default_factory=dict)  # one row's pass by width
    batch_s: dict[tuple[int, int], Ema] = field(default_factory=dict)  # a batch's pass by (rows, positions)
    draft_prefill_token_s: Ema = field(default_factory=_timing)  # a drafter reading, per token
    # The plain pass of as many rows when each wide pass was last measured. A width not run since is priced at what it
    # cost then in plain passes, times a plain pass now: calibration reads one minute of a noisy machine, and a width
    # never drafted would keep that minute's price for the server's life.
    _plain_then: dict[tuple[int, int], float] = field(default_factory=dict)
    # The plain pass when each drafter's token was last timed (`draft_share`)
    _draft_plain_then: dict[str, float] = field(default_factory=dict)
    # One row's passes by width in plain passes as timed at load (`keep_load_prices`). A wide pass priced above what
    # this table says (interpolated; a batch's against its own plain pass) relaxes toward it, halving the excess every
    # STALE_HALF_LIFE passes it is not run: a busy minute priced 2- and 3-wide passes 4x their cost, and a width priced
    # too dear is never drafted, so never timed again (docs/results.md, session 43).
    load_ratios: dict[int, float] = field(default_factory=dict)
    _at_load_memo: dict[tuple[int, int], float] = field(default_factory=dict)  # `_at_load` of the table (fixed at load)
    _seen_at: dict[tuple[int, int], int] = field(default_factory=dict)  # `passes_seen` when each was last measured
    _curve_now: dict[int, float] | None = None  # one row's curve priced now, until the next pass is observed
    passes_seen: int = 0
    wide_passes_seen: int = 0  # passes of more than one position observed (what prices in plain passes move with)

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_prefill_token_s.update(seconds / tokens)

    def observe_draft(self, source: str, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_token_s.setdefault(source, _timing(self.alpha)).update(seconds / tokens)
            plain = self._plain(1)
            if plain is not None:
                self._draft_plain_then[source] = plain

    def observe_verify(self, positions: int, seconds: float, rows: int = 1) -> None:
        table, key = (self.verify_s, positions) if rows == 1 else (self.batch_s, (rows, positions))
        e, weight = table.get(key), None
        if e is None:  # a first timing counts at most TIMING_JUMP x the price it had unmeasured, as later ones do
            expected = self.verify_time(positions, rows)
            seconds = seconds if not expected else min(seconds, priors.TIMING_JUMP * expected)
            e = table[key] = _timing(self.alpha)
        elif positions > 1:
            e.value = self._now(rows, positions, e.value)  # the average in today's terms before it learns today's pass
            # an average not fed for a while is old news (where it was dear, mostly the table's guess by now): today's
            # pass counts as much as a price would have relaxed since, so a width dearer than at load (a batch's at deep
            # contexts) is priced as it runs after one pass, not five
            age = self.passes_seen - self._seen_at[rows, positions]
            weight = max(self.alpha, 1 - 0.5 ** (age / priors.STALE_HALF_LIFE))
        e.update(seconds, weight)
        self._curve_now = None
        self.passes_seen += 1
        if positions > 1:
            self.wide_passes_seen += 1
            self._seen_at[rows, positions] = self.passes_seen
            plain = self._plain(rows)
            if plain is not None:
                self._plain_then[rows, positions] = plain

    def _plain(self, rows: int) -> float | None:
        e = self.verify_s.get(1) if rows == 1 else self.batch_s.get((rows, 1))
        return None if e is None else e.value

    def keep_load_prices(self) -> None:
        """The one-row passes measured so far (calibration's table) become what stale prices relax toward."""
        plain = self._plain(1)
        if plain:
            self.load_ratios = {n: t / plain for n, t in self._curve().items()}
            self._at_load_memo = {}

    def _at_load(self, rows: int, positions: int) -> float | None:
        """A pass of rows x positions in plain passes of as many rows, by the table timed at load (None: no table)."""
        if not self.load_ratios:
            return None
        ratio = self._at_load_memo.get((rows, positions))
        if ratio is None:  # every price of every step asks: the interpolation is done once a shape
            ratio = _interpolate(self.load_ratios, rows * positions) / _interpolate(self.load_ratios, rows)
            self._at_load_memo[rows, positions] = ratio
        return ratio

    @property
    def prices_moved(self) -> tuple[int, int]:
        """Changes whenever prices in plain passes may have moved: a wide pass measured, or a stale one relaxed."""
        return self.wide_passes_seen, self.passes_seen // priors.STALE_HALF_LIFE

    def _now(self, rows: int, positions: int, seconds: float) -> float:
        """A measured pass's price now: what it cost in plain passes when measured, times a plain pass now; above its
        price by the table timed at load, relaxed toward that as passes go by without it (`load_ratios`)."""
        then, plain = self._plain_then.get((rows, positions)), self._plain(rows)
        if then is None or plain is None:
            return seconds
        price, at_load = seconds * plain / then, self._at_load(rows, positions)
        if at_load is not None and price > at_load * plain:
            age = self.passes_seen - self._seen_at[rows, positions]
            price = at_load * plain + (price - at_load * plain) * 0.5 ** (age / priors.STALE_HALF_LIFE)
        return price

    def _curve(self) -> dict[int, float]:
        """One row's passes by width, priced now (kept till the next pass: a long lookup's trim prices every length,
        twice)."""
        if self._curve_now is None:
            self._curve_now = {n: self._now(1, n, e.value) for n, e in self.verify_s.items() if e.value is not None}
        return self._curve_now

    def measured(self, positions: int, rows: int = 1) -> bool:
        e = self.verify_s.get(positions) if rows == 1 else self.batch_s.get((rows, positions))
        return e is not None and e.value is not None

    def widest(self) -> int:
        """The most tokens a measured pass scored (0: none yet)."""
        return max((n for n, e in self.verify_s.items() if e.value is not None), default=0)

    def cheapest_pass(self, positions: int) -> tuple[int, float | None]:
        """(width, seconds) to run a one-row pass of `positions` at: a wider one measured cheaper, if any (padded: on
        the AMD EPYC's llama.cpp a 64-wide pass costs 0.78x a 63-wide one, 32 0.92x 31, 16 0.83x 15); else `positions`
        at its own cost. A width not measured is priced by interpolation, which puts no wider pass below it: it pads
        once measured dear."""
        own = self.verify_time(positions)
        if own is None:
            return positions, None
        wider = [(t, n) for n, t in self._curve().items() if n > positions and t < own]
        seconds, width = min(wider, default=(own, positions))
        return width, seconds

    def draft_time(self) -> float:
        """Seconds per drafted token of the costliest drafter seen (with several, the model one)."""
        return max((e.value for e in self.draft_token_s.values() if e.value is not None), default=0.0)

    def draft_share(self) -> float | None:
        """The costliest drafter's token in plain passes as when it was last timed (None: not timed beside a plain
        pass). A draft is timed only while drafting and a plain pass at every plain step, so their ratio now moves with
        every busy minute of plain steps: a draft that cannot pay looked as if it could, and ran (replays: 5-10 %)."""
        shares = [e.value / self._draft_plain_then[source] for source, e in self.draft_token_s.items()
                  if e.value is not None and source in self._draft_plain_then]
        return max(shares, default=None)

    def position_cost(self) -> float | None:
        """Seconds a position adds to a pass at the wide end of what was measured (the widest pass against the one
        about half as wide): what a row's position costs in a pass that also reads a prompt chunk, hundreds of
        tokens wide, past where positions come nearly free. None: nothing measured yet."""
        known = sorted(self._curve().items())
        if len(known) < 2:
            return known[0][1] / known[0][0] if known else None
        n1, t1 = known[-1]
        n0, t0 = max(((n, t) for n, t in known[:-1] if n <= n1 // 2), default=known[-2])
        return max(t1 - t0, 0.0) / (n1 - n0)

    def riding(self, rows: int) -> tuple[float, float] | None:
        """Beside a prompt reading: (seconds a drafted position adds to the pass, seconds an accepted token saves: its
        share of a plain step of these rows later). None: nothing measured yet. (Counting the whole reading as the
        step's fixed cost made any draft look nearly free beside it; on a CPU a position there costs a prompt
        token's compute, ~15 ms, about what 8 plain rows spend on a token.)"""
        per_position, plain = self.position_cost(), self.verify_time(1, rows)
        return None if per_position is None or plain is None else (per_position, plain / rows)

    def verify_time(self, positions: int, rows: int = 1) -> float | None:
        """Seconds for a pass of `rows` rows x `positions` positions: measured; for a batch, its plain pass scaled by
        the one-row curve (class docstring); else the one-row curve at rows x positions tokens, interpolated linearly
        between the nearest measured widths, or extrapolated conservatively past them (None: nothing yet).
        Past the widest pass measured it grows at least UNMEASURED_GROWTH of proportionally: one-row passes look
        free up to ~9 tokens on a CPU, and a flat extrapolation to an 8-row x 9-position pass would price it at a plain
        one (calibrate measures up to the widest pass the engine runs, so this is a fallback)."""
        curve = self._curve()
        if rows > 1:
            own, plain = self.batch_s.get((rows, positions)), self._plain(rows)
            if own is not None and own.value is not None:
                return self._now(rows, positions, own.value)
            if not curve:  # no one-row pass measured: this batch's own passes
                return _interpolate({p: self._now(rows, p, e.value) for (r, p), e in self.batch_s.items()
                                     if r == rows and e.value is not None}, positions)
            narrow = _interpolate(curve, rows)
            if plain is not None and narrow:
                return plain * _interpolate(curve, rows * positions) / narrow
        return _interpolate(curve, rows * positions)


def _interpolate(known: dict[int, float], n: int) -> float | None:
    """A pass of n tokens from passes measured by width: linear between the nearest, past the widest along the last
    segment but at least UNMEASURED_GROWTH of proportionally, below the narrowest at its price (None: nothing)."""
    if n in known:
        return known[n]
    widths = sorted(known)
    if not widths:
        return None
    below, above = [w for w in widths if w < n], [w for w in widths if w > n]
    if below and above:
        n0, n1 = below[-1], above[0]
        return known[n0] + (known[n1] - known[n0]) * (n - n0) / (n1 - n0)
    if not below:  # smaller than anything measured
        return known[widths[0]]
    n1 = widths[-1]
    slope = (known[n1] - known[widths[-2]]) / (n1 - widths[-2]) if len(widths) > 1 else 0.0
    return known[n1] + max(slope, priors.UNMEASURED_GROWTH * known[n1] / n1) * (n - n1)


class PassCostLine:
    """One sequence's verify pass as level + slope x positions. The level follows the current context (a pass
    over 700 cached tokens costs ~2x one over 100 here); the slope, which is what deciding one more drafted token
    reads, is learned only from consecutive passes (same context, same machine load) of clearly different widths.
    (A table keyed by width alone would remember each width at whatever context it was last measured in.)

    The slope is the median of the latest samples, not a clamped average: a position costs ~1 ms on one CPU and
    ~170 ms on another (bf16 emulated), so no bound in seconds fits both, while a median shrugs off a hiccup."""

    def __init__(self, alpha_level: float = priors.PASS_LEVEL_ALPHA):
        # no TIMING_JUMP: a level (a pass less its positions' share) can sit near zero, where a bound relative to it
        # would stop it following; it is fed by every one-row pass, so a hiccup leaves it within ~10 passes
        self.level = Ema(alpha_level)
        self.slope_samples: list[float] = []
        self.recent: list[float] = []  # the latest passes' seconds: none costs less than the cheapest of them
        self._last: tuple[int, float] | None = None

    @property
    def slope(self) -> float | None:
        if not self.slope_samples:
            return None
        return statistics.median(self.slope_samples)

    def observe(self, positions: int, seconds: float) -> None:
        if self._last is not None and abs(positions - self._last[0]) >= priors.MIN_WIDTH_GAP:
            sample = (seconds - self._last[1]) / (positions - self._last[0])
            self.slope_samples = [*self.slope_samples[-(priors.SLOPE_SAMPLES - 1):], max(sample, 0.0)]
        self._last = (positions, seconds)
        self.recent = [*self.recent[-(priors.SLOPE_SAMPLES - 1):], seconds]
        if self.slope is not None:
            self.level.update(seconds - self.slope * positions)

    def new_context(self) -> None:
        """A new request: its passes are not comparable with the last one's."""
        self._last = None
        self.recent = []

    def time(self, positions: int) -> float | None:
        """A line cannot follow a pass flat up to some width and steep past it: it would put the narrow passes
        below zero. They cost at least what the cheapest recent pass did."""
        if self.level.value is None:
            return None
        return max(self.level.value + self.slope * positions, min(self.recent, default=0.0))
