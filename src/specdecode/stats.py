"""What one generation call counted and timed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


def count_positions(counts: list[int], upto: int) -> None:
    """Add one to counts[0:upto], growing the list as needed (per-draft-position tallies)."""
    counts.extend([0] * (upto - len(counts)))
    for i in range(upto):
        counts[i] += 1


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, served from the prefix cache (not read again)
    new_tokens: int = 0
    target_passes: int = 0  # prefill included
    draft_passes: int = 0  # forward passes of a draft model (0 for model-free drafters)
    steps: int = 0  # verify passes after the prefill
    plain_steps: int = 0  # steps where the controller chose not to draft (speculation off)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    leaf_tokens: int = 0  # extra tokens from an alternative the target corrected to (tree leaves, tree.py)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    accepted_len_histogram: list[int] = field(default_factory=list)  # [n] = steps that accepted n drafts
    # Which drafter proposed (a combination has several): source -> [steps, drafted tokens, accepted tokens]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    time_to_first_token_s: float = 0.0
    draft_prefill_s: float = 0.0  # the draft model reading the prompt (after the first token is out)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    note: str = ""  # what the controller decided for the whole request, said once (e.g. model drafts off here)

    def record_step(self, drafted: int, accepted: int, source: str = "") -> None:
        self.steps += 1
        if drafted:
            tally = self.by_source.setdefault(source or "draft", [0, 0, 0])
            tally[0], tally[1], tally[2] = tally[0] + 1, tally[1] + drafted, tally[2] + accepted
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        count_positions(self.drafted_per_position, drafted)
        count_positions(self.accepted_per_position, accepted)
        self.accepted_len_histogram.extend([0] * (accepted + 1 - len(self.accepted_len_histogram)))
        self.accepted_len_histogram[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Draft tokens accepted per verify step (the target adds one more token of its own)."""
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_len=self.mean_accepted_len,
            acceptance_per_position=self.acceptance_per_position,
            tokens_per_s=self.tokens_per_s,
        )
        return d
