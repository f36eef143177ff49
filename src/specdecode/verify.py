"""Acceptance rules: pure tensor functions, batched over rows, no models.

Each returns `(accepted_len [B], next_token [B])`: row b keeps draft_tokens[b, :accepted_len[b]] and
then next_token[b], the target's own token (the correction at the first rejection, or the bonus
token when the whole draft was accepted). Rows may carry drafts of different lengths (`draft_lens`);
positions past a row's length count as rejected. A target distribution may be given over the tokens it keeps
(`target_ids`: the token id of each column, as `sampling.Kept` holds them; None: column i is token i).
"""

from __future__ import annotations

import numpy as np
import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the first of ties as torch's. CPU fp32 goes through numpy: torch's CPU argmax does not vectorise
    (a Qwen row of 151,936 logits: ~130 us against numpy's ~10 on an AMD EPYC AVX-512), and greedy decoding pays it
    at every position of every pass. A tensor subclass keeps torch's dispatch."""
    if _on_numpy(x):
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1), dtype=np.int64))
    return x.argmax(-1)


def _on_numpy(x: torch.Tensor) -> bool:
    return type(x) is torch.Tensor and x.device.type == "cpu" and x.dtype == torch.float32


def greedy_verdicts(drafts: list[torch.Tensor], target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """greedy_accept for rows whose drafts [1, n_b] differ in length, logits [B, max n_b + 1, V] where the model ran (a
    row's logits past its n_b + 1 positions are never read):
    (accepted lengths, next tokens) as ints. On the CPU in plain Python over numpy's argmax: right after a pass over
    the weights every small op runs with cold caches, and the batched rule's dozen tensor ops cost ~0.24 ms a step
    there (AMD EPYC, llama.cpp backend; ~0.05 ms warm). Elsewhere one batched greedy_accept where the model ran, and
    only the [B] verdicts move."""
    if _on_numpy(target_logits):
        logits = target_logits.detach().numpy()
        lens, nexts = [], []
        for row, draft in enumerate(drafts):  # a row's own positions only: past them a shorter row's are not scored
            wanted = logits[row, : draft.shape[1] + 1].argmax(-1).tolist()
            n = 0
            for token in draft.tolist()[0]:
                if token != wanted[n]:
                    break
                n += 1
            lens.append(n)
            nexts.append(wanted[n])
        return lens, nexts
    k = max(draft.shape[1] for draft in drafts)
    tokens = torch.zeros(len(drafts), k, dtype=torch.long)  # drafts padded to the longest
    for row, draft in enumerate(drafts):
        tokens[row, : draft.shape[1]] = draft[0]
    lengths = torch.tensor([draft.shape[1] for draft in drafts])
    device = target_logits.device
    lens, nexts = greedy_accept(tokens.to(device), target_logits, lengths.to(device))
    return lens.tolist(), nexts.tolist()


def _valid_mask(draft_tokens: torch.Tensor, draft_lens: torch.Tensor | None) -> torch.Tensor:
    B, k = draft_tokens.shape
    if draft_lens is None:
        return torch.ones(B, k, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(k, device=draft_tokens.device)[None, :] < draft_lens[:, None]


def _prefix_len(accept: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] length of the all-True prefix."""
    return accept.long().cumprod(-1).sum(-1)


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, k]
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_lens: torch.Tensor | None = None,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept while the draft equals the target's argmax; the output is the target's greedy output."""
    return _accept_equal(draft_tokens, argmax(target_logits), draft_lens)


def _accept_equal(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
                  draft_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's prefix that equals the target's own tokens [B, k+1], and the target's token after it."""
    k = draft_tokens.shape[1]
    accept = (draft_tokens == target_tokens[:, :k]) & _valid_mask(draft_tokens, draft_lens)
    accepted_len = _prefix_len(accept)
    next_token = target_tokens.gather(1, accepted_len[:, None]).squeeze(1)
    return accepted_len, next_token


def _probs_of(probs: torch.Tensor, ids: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """probs [..., C] over the tokens `ids` [..., C] (None: all, in order) -> the probability of tokens [...]."""
    if ids is None:
        return probs.gather(-1, tokens[..., None]).squeeze(-1)
    return (probs * (ids == tokens[..., None])).sum(-1)


def speculative_accept(
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] processed q; None = deterministic draft (q one-hot)
    target_probs: torch.Tensor,  # [B, k+1, C] processed p (C = V, or over target_ids)
    generator: torch.Generator | None = None,
    draft_lens: torch.Tensor | None = None,  # [B]
    target_ids: torch.Tensor | None = None,  # [B, k+1, C] the token of each column of target_probs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x with probability min(1, p(x)/q(x)); at the first rejection sample from
    normalize(max(0, p - q)); after a fully accepted draft sample the bonus token from p. The
    emitted tokens are then distributed exactly as if sampled from p one at a time. max(0, p - q) is 0 wherever p
    is, so p given over the tokens it keeps gives the residual whole.
    """
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=draft_tokens.device)
    p_x = _probs_of(target_probs[:, :k], None if target_ids is None else target_ids[:, :k], draft_tokens)  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    u = torch.rand(B, k, generator=generator, device=p_x.device)
    accept = (u * q_x < p_x) & _valid_mask(draft_tokens, draft_lens)  # u < p/q without dividing by 0
    accepted_len = _prefix_len(accept)

    lens = draft_lens if draft_lens is not None else torch.full_like(accepted_len, k)
    rejected = accepted_len < lens  # [B]
    p_at = target_probs[rows, accepted_len]  # [B, C] (a copy)
    ids_at = None if target_ids is None else target_ids[rows, accepted_len]
    residual = p_at
    if rejected.any():
        at = accepted_len.clamp(max=k - 1)  # the first rejected position of each rejected row
        x = draft_tokens[rows, at]
        if draft_probs is None:  # q one-hot: p without x (unnormalised: sample_tokens scales)
            at_x = torch.nn.functional.one_hot(x, p_at.shape[-1]).bool() if ids_at is None else ids_at == x[:, None]
            residual = p_at.masked_fill(at_x & rejected[:, None], 0.0)
        else:
            q_at = draft_probs[rows, at]
            q_at = q_at if ids_at is None else q_at.gather(-1, ids_at)
            residual = torch.where(rejected[:, None], (p_at - q_at).clamp(min=0), p_at)
        empty = residual.sum(-1) <= 0
        if empty.any():  # p == q up to rounding, where the rejection itself was a rounding event
            residual = torch.where(empty[:, None], p_at, residual)
    index = sample_tokens(residual, generator)
    next_token = index if ids_at is None else ids_at.gather(-1, index[:, None]).squeeze(-1)
    return accepted_len, next_token


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, V] probabilities (rows need not sum to 1) -> [B] token ids, one uniform draw a row by the inverse of the
    cumulative distribution (float64). torch.multinomial took 5 ms a row over 151,936 tokens on a 2-core CPU, this
    0.3 ms. A token of probability 0 is never drawn (its cumulative sum equals the one before it)."""
    cumulative = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    return torch.searchsorted(cumulative, u * cumulative[:, -1:], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def keyed_accept(
    draft_tokens: torch.Tensor,  # [B, k]
    target_probs: torch.Tensor,  # [B, k+1, C] processed p (C = V, or over target_ids)
    noise: torch.Tensor,  # [k+1, V] Gumbel noise of those positions
    target_ids: torch.Tensor | None = None,  # [B, k+1, C] the token of each column of target_probs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance over the Gumbel-perturbed log-probabilities log p + g: the target's token at each position
    is its Gumbel-max sample, and the draft's prefix that equals those is kept."""
    return _accept_equal(draft_tokens, gumbel_max(target_probs, noise, target_ids))


def gumbel_max(probs: torch.Tensor, noise: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(log p + g) as token ids: probs [..., C] over `ids` [..., C] (None: the vocabulary), noise [..., V]
    (made on the CPU: moved to where p is, a draft model's on a GPU)."""
    noise = noise.to(probs.device)
    if ids is None:
        return argmax(probs.log() + noise)
    chosen = argmax(probs.log() + noise.expand(*ids.shape[:-1], -1).gather(-1, ids))
    return ids.gather(-1, chosen[..., None]).squeeze(-1)
