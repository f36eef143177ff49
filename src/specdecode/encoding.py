"""Prompts -> token ids, with the text a user wrote kept as text.

A chat template marks turns with special tokens (`<|im_start|>`, ...). Rendering the template to a string and
tokenizing it whole would turn the same strings inside a message into real control tokens: a user could forge a
system turn. So each message's content is rendered as a placeholder; the template's own text is tokenized with
its special tokens, and each content with special-token strings split into ordinary text.
"""

from __future__ import annotations

import torch

# Private-use code points: no template writes them, and they survive any template that does not edit content.
_MARK = "\ue000specdecode-content-{}\ue001"


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every token that ends a turn: the generation config's EOS ids and the tokenizer's."""
    ids = set(getattr(model, "eos_token_ids", ()))  # a backend knows its own
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(i for i in ids if i is not None)


def _text_ids(tokenizer, text: str, specials: bool) -> list[int]:
    """Token ids of `text`; specials=False: special-token strings in it are ordinary text."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=not specials)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages [{"role", "content"}] -> the model's template with a generation prompt, as token ids; the
    contents can never become control tokens. A template that drops a message (some drop system turns) drops it."""
    if not messages or not all(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
        raise ValueError("the prompt is empty: give at least one message with content")
    marks = [_MARK.format(i) for i in range(len(messages))]
    rendered = tokenizer.apply_chat_template(
        [{**m, "content": mark} for m, mark in zip(messages, marks)], add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = []
    rest = rendered
    for mark, message in zip(marks, messages):
        before, found, after = rest.partition(mark)
        if not found:
            continue
        ids += _text_ids(tokenizer, before, specials=True) + _text_ids(tokenizer, message["content"], specials=False)
        rest = after
    return ids + _text_ids(tokenizer, rest, specials=True)


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
    """A prompt string (or chat messages) -> input_ids [1, L]; chat applies the model's template. A plain prompt is
    the model's raw input: special-token strings in it are parsed (callers format their own turns that way)."""
    if isinstance(prompt, list) or chat:
        ids = encode_chat(tokenizer, prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
    else:
        if not prompt:
            raise ValueError("the prompt is empty: give some text")
        ids = list(tokenizer(prompt)["input_ids"])
    return torch.tensor([ids], dtype=torch.long)
