"""Tiny random causal LMs built from configs: fast, fp32, small vocabulary."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def tiny_model(seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, sharpness: float = 1.0):
    """A random Llama; `sharpness` scales the output head: larger = more peaked next-token distributions."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def random_prompt(seed: int, length: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (1, length), generator=g)  # no BOS/EOS inside prompts


def reference_greedy(model, input_ids: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Greedy decoding with no cache at all: the slowest, most obviously correct reference."""
    ids = input_ids
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(ids).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over the tiny vocabulary: token i is the word 'w{i}' (0 = <s>, 1 = </s>),
    with a chat template that joins the messages' contents. Text in, text out, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<s>", pad_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def keep_one_stale_entry(monkeypatch) -> None:
    """Mutation: after each pass the cache keeps one input too many (the first rejected token's K/V), the
    off-by-one rollback every backend could make. The greedy tests must catch it."""
    from specdecode.tree import TreeLayout

    real = TreeLayout.kept_inputs

    def stale(self, accepted, leaf):
        kept = real(self, accepted, leaf)
        return kept + [kept[-1] + 1] if leaf is None and kept[-1] + 1 < self.width else kept

    monkeypatch.setattr(TreeLayout, "kept_inputs", stale)
