"""When to stop: EOS tokens, stop strings, the token budget. Never emit past any of them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopCondition:
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None
    _window: int = field(init=False, default=0)

    def __post_init__(self):
        self.stop_strings = tuple(s for s in self.stop_strings if s)
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the generated text")
        # A stop string of c characters spans at most c tokens, plus a few for partial UTF-8 bytes.
        self._window = max((len(s) for s in self.stop_strings), default=0) + 4

    def first_stop(self, generated: list[int], start: int) -> int | None:
        """Scan generated[start:] (the tokens just added) token by token; return how many tokens of
        `generated` to keep when one of them ends generation, else None."""
        for end in range(start + 1, len(generated) + 1):
            if generated[end - 1] in self.eos_token_ids:
                return end
            if self.stop_strings:
                tail = self.tokenizer.decode(generated[max(0, end - self._window) : end])
                if any(s in tail for s in self.stop_strings):
                    return end
        return None

    def trim_text(self, text: str) -> str:
        """The text before the first stop string (OpenAI convention: the stop string is not returned)."""
        cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=len(text))
        return text[:cut]
