"""Prompts -> token ids, with the text a user wrote kept as text.

A chat template marks turns with special tokens (`<|im_start|>`, ...). Rendering the template to a string and
tokenizing it whole would turn the same strings inside a message into real control tokens: a user could forge a
system turn. So each message's content is rendered as a placeholder; the template's own text is tokenized with
its special tokens, and each content with special-token strings split into ordinary text.
"""

from __future__ import annotations

import threading

import torch

# Private-use code points: no template writes them, and they survive any template that does not edit content.
_MARK = "\ue000specdecode-content-{}\ue001"
# transformers' fast tokenizer keeps "split special tokens" as state on its Rust tokenizer, set by each call: two
# threads encoding at once (a server tokenizes each request in a worker thread) took each other's setting, and a
# user's "<|im_start|>system" became control tokens or the template's own became text (76 of 320 encodings wrong with
# 8 threads). One encode at a time per process.
_ENCODING = threading.Lock()


def eos_token_ids(backend, tokenizer) -> frozenset[int]:
    """Every token that ends a turn: the target's own (a Backend knows them) and the tokenizer's."""
    ids = set(backend.eos_token_ids) | {getattr(tokenizer, "eos_token_id", None)}
    return frozenset(i for i in ids if i is not None)


def _text_ids(tokenizer, text: str, specials: bool) -> list[int]:
    """Token ids of `text`; specials=False: special-token strings in it are ordinary text."""
    if not text:
        return []
    with _ENCODING:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=not specials)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages [{"role", "content"[, "name"]}] -> the model's template with a generation prompt, as token ids;
    contents (and names) can never become control tokens. Empty contents are empty turns; a template that drops a
    message (some drop system turns) drops it. A `name` the template has no place for is refused (ValueError)."""
    if not messages:
        raise ValueError("the prompt is empty: give at least one message")
    texts: list[str] = []  # what each mark stands for, in mark order

    def mark(text: str) -> str:
        texts.append(text)
        return _MARK.format(len(texts) - 1)

    marked = []
    for m in messages:
        entry = {**m, "content": mark(m.get("content") or "")}
        if m.get("name") is not None:
            entry["name"] = mark(m["name"])
        marked.append(entry)
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    for i, m in enumerate(messages):
        if m.get("name") is not None and marked[i]["name"] not in rendered:
            raise ValueError(f"messages[{i}].name: this model's chat template has no place for a name")
    ids: list[int] = []
    rest = rendered
    while True:  # the marks in the order the template wrote them
        found = [(rest.find(_MARK.format(n)), n) for n in range(len(texts)) if _MARK.format(n) in rest]
        if not found:
            break
        at, n = min(found)
        ids += _text_ids(tokenizer, rest[:at], specials=True) + _text_ids(tokenizer, texts[n], specials=False)
        rest = rest[at + len(_MARK.format(n)) :]
    ids += _text_ids(tokenizer, rest, specials=True)
    if not ids:
        raise ValueError("the prompt is empty after the chat template: give a message with content")
    return ids


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = False) -> torch.Tensor:
    """A prompt string (or chat messages) -> input_ids [1, L]; chat applies the model's template. A plain prompt is
    the model's raw input: special-token strings in it are parsed (callers format their own turns that way)."""
    if isinstance(prompt, list) or chat:
        ids = encode_chat(tokenizer, prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
    else:
        if not prompt:
            raise ValueError("the prompt is empty: give some text")
        with _ENCODING:
            ids = list(tokenizer(prompt)["input_ids"])
    return torch.tensor([ids], dtype=torch.long)
