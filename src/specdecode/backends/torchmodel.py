"""The torch backend: a transformers causal LM and its DynamicCache.

A DynamicCache keeps one length for the whole batch, so rows share the cache's slot axis and differ in
which slots are live (`mask`):
- a pass feeds every row its inputs padded to the widest; `position_ids` are the row's own positions and
  the attention mask marks its live slots (padding and rejected draft slots are holes);
- `keep` moves a kept leaf's K/V to its slot and crops the shared tail to the longest row, so holes remain
  only in rows that kept less; when gathering each row's live slots to the right would free enough of the
  cache, rows are compacted;
- a new row is prefilled alone and joins by left-padding (its cache or the batch's) to a common length;
  rows leave with `batch_select_indices`.
A leaving row's live K/V are kept (the prefix cache, bounded in tokens): a new row whose prompt shares a prefix
with one starts its own cache from a copy of that prefix and reads only the rest.
A row alone takes the model's own causal path (no mask), so one request decodes exactly as transformers does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .base import Backend, RowReader, chain_offsets
from .prefix import PrefixCache

PREFIX_CACHE_TOKENS = 8192  # K/V of finished rows kept for later prompts (Qwen 1.5B in bf16: 28 kB a token)
PREFIX_CACHE_ENTRIES = 8


def target_logits(model, tokens: torch.Tensor, cache: DynamicCache, last_only: bool = False, **kwargs) -> torch.Tensor:
    """One pass over tokens [B, n] on top of `cache` -> fp32 logits where the model runs [B, n or 1, V]."""
    with torch.inference_mode():
        out = model(
            input_ids=tokens.to(model.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            **kwargs,
        )
    return out.logits.float()


def rollback(cache: DynamicCache, keep_len: int) -> None:
    """Drop cache entries past keep_len (crop takes a negative count)."""
    extra = cache.get_seq_length() - keep_len
    if extra > 0:
        cache.crop(-extra)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool [B, 1, Q, K] mask -> the additive float mask attention takes (0 where allowed)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


class TorchRowReader(RowReader):
    """A row read into a cache of its own; joining left-pads it beside the batch's rows."""

    def __init__(self, backend: "TorchBackend", prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 tokens: list[int] | None = None):
        self.backend = backend
        self.cache = DynamicCache(config=backend.model.config)
        self.tokens = tokens or []  # what its cache holds
        self.cached = len(self.tokens)
        for layer, (keys, values) in enumerate(prefix or []):  # a copy: the entry stays for other prompts
            self.cache.update(keys[None, :, : self.cached].clone(), values[None, :, : self.cached].clone(), layer)

    def read(self, tokens: torch.Tensor) -> torch.Tensor:
        before = self.cache.get_seq_length()
        try:
            logits = target_logits(self.backend.model, tokens, self.cache, last_only=True)[:, -1].cpu()
        except BaseException:
            rollback(self.cache, before)
            raise
        self.tokens += tokens[0].tolist()
        return logits

    def join(self) -> None:
        self.backend._readers.discard(self)
        self.backend._join(self.cache, self.tokens)
        self.cache = None

    def discard(self) -> None:
        self.backend._readers.discard(self)
        self.cache = None


def _left_pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """Pad a [B, H, T, D] cache tensor with n empty slots on the left of T."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros(*x.shape[:2], n, x.shape[3]), x], dim=2)


class TorchBackend(Backend):
    name = "torch"
    supports_tree = True

    def __init__(self, model, compact_above: float = 0.5, prefix_cache: bool = True, prefix_tokens: int | None = None):
        self.model = model
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_window = getattr(model.config, "max_position_embeddings", None)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        layers = DynamicCache(config=model.config).layers
        # Rows side by side need left padding and holes, which a sliding-window layer cannot hold.
        full_attention = all(type(layer) is DynamicLayer for layer in layers)
        self.max_rows = None if full_attention else 1
        self.compact_above = compact_above
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, T] bool: which cache slots each row attends
        self._pass_start: int | None = None  # the cache's length before the pending pass
        self._tokens: list[list[int]] = []  # row -> the tokens its live slots hold, in order
        self._pending: list[list[int]] | None = None  # row -> its inputs in the pass not yet kept
        # A sliding-window layer's cache is not a prefix of positions: only full-attention models cache prefixes.
        use_cache = prefix_cache and full_attention
        tokens = PREFIX_CACHE_TOKENS if prefix_tokens is None else prefix_tokens
        self.prefix_cache = PrefixCache(PREFIX_CACHE_ENTRIES, tokens) if use_cache else None
        self._prefixes: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # entry -> per layer [H, n, D] K, V
        self._next_entry = 0
        self._readers: set[TorchRowReader] = set()  # rows being read (open_row), not yet joined

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    NEAR_TIE_GAP = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}

    @property
    def near_tie_gap(self) -> float:
        return self.NEAR_TIE_GAP.get(self.dtype, 1e-3)

    def describe(self) -> str:
        return f"torch, {str(self.dtype).removeprefix('torch.')}"

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def hf_model(self):
        return self.model

    def make_drafter(self, spec, *, dtype=None, tokenizer=None, compile_draft=False, threads=None):
        from ..drafters.factory import make_drafter

        return make_drafter(spec, dtype=dtype, tokenizer=tokenizer, target=self.model, compile_draft=compile_draft)

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def length(self, row: int) -> int:
        return int(self.mask[row].sum())

    @property
    def shares_rows(self) -> bool:  # part of the prefix cache: off with it
        return self.prefix_cache is not None

    def open_row(self, prompt: torch.Tensor | None = None) -> "TorchRowReader":
        if prompt is None or self.prefix_cache is None:
            reader = TorchRowReader(self)
        else:
            entry, shared, source, held = self._start_from(prompt[0].numpy())
            if entry is not None:
                reader = TorchRowReader(self, self._prefixes[entry], prompt[0, :shared].tolist())
            elif held:  # a running row or one being read holds the most of it: its K/V are copied
                self.prefix_cache.stats.shared_running += 1
                reader = TorchRowReader(self, self._live_prefix(source, held), prompt[0, :held].tolist())
            else:
                reader = TorchRowReader(self)
        self._readers.add(reader)
        return reader

    def _held(self):  # keyed by row index, or by the reader
        yield from enumerate(self._tokens)
        yield from ((reader, reader.tokens) for reader in self._readers)

    def _live_prefix(self, source: int | TorchRowReader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer [H, n, D] K, V of the first n positions a row (its live slots, in order) or a reader holds."""
        if isinstance(source, TorchRowReader):
            return [(layer.keys[0, :, :n], layer.values[0, :, :n]) for layer in source.cache.layers]
        slots = self.mask[source].nonzero().flatten()[:n].to(self.model.device)
        return [(layer.keys[source].index_select(1, slots), layer.values[source].index_select(1, slots))
                for layer in self.cache.layers]

    def drop_cached_prefixes(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.entries.clear()
            self._prefixes.clear()

    def _retire(self, rows: list[int]) -> None:
        """Leaving rows' live K/V go to the prefix cache (a copy: the batch's tensors are about to shrink)."""
        if self.prefix_cache is None:
            return
        for row in rows:
            tokens = self._tokens[row]
            if not tokens:
                continue
            key, self._next_entry = self._next_entry, self._next_entry + 1
            freed = self.prefix_cache.add(key, tokens)
            if key not in freed:
                slots = self.mask[row].nonzero().flatten().to(self.model.device)
                self._prefixes[key] = [(layer.keys[row].index_select(1, slots), layer.values[row].index_select(1, slots))
                                       for layer in self.cache.layers]
            for old in freed:
                self._prefixes.pop(old, None)

    def forward(self, tokens, widths, offsets=None, visibility=None):
        self.check_visibility(visibility)
        B, W = tokens.shape
        T = self.mask.shape[1]
        self._pass_start = T
        self._pending = [tokens[row, : widths[row]].tolist() for row in range(B)]
        if B == 1 and visibility is None and bool(self.mask.all()):  # the model's own path
            return target_logits(self.model, tokens[:, : widths[0]], self.cache)
        offsets = chain_offsets(B, W) if offsets is None else offsets
        real = torch.arange(W)[None, :] < torch.tensor(widths)[:, None]  # [B, W]: inputs that are not padding
        position_ids = self.mask.sum(1)[:, None] + offsets
        if visibility is not None:
            fed = visibility & real[:, None, :] & real[:, :, None]
            fed |= torch.eye(W, dtype=torch.bool)  # padding attends itself (its output is never read)
            allowed = torch.cat([self.mask[:, None, :].expand(B, W, T), fed], dim=2)[:, None]
            attention_mask = additive_mask(allowed, self.dtype)
        else:  # chains: a 2-D mask of live slots (the model makes it causal)
            attention_mask = torch.cat([self.mask, real], dim=1)
        device = self.model.device
        return target_logits(
            self.model, tokens, self.cache, attention_mask=attention_mask.to(device), position_ids=position_ids.to(device),
        )

    @torch.inference_mode()
    def keep(self, kept: list[list[int]]) -> None:
        T, self._pass_start = self._pass_start, None
        for row, inputs in enumerate(kept):
            self._tokens[row] += [self._pending[row][src] for src in inputs]
            for slot, src in enumerate(inputs):
                if src != slot:  # a leaf's K/V (which carry their rotary position, the slot's) move to the slot
                    for layer in self.cache.layers:
                        for kv in (layer.keys, layer.values):
                            kv[row, :, T + slot] = kv[row, :, T + src]
        longest = max(len(inputs) for inputs in kept)
        rollback(self.cache, T + longest)
        live = torch.arange(longest)[None, :] < torch.tensor([len(inputs) for inputs in kept])[:, None]
        self.mask = torch.cat([self.mask, live], dim=1)
        assert self.mask.shape[1] == self.cache.get_seq_length()
        self._compact_if_sparse()

    def truncate(self, row: int, length: int) -> None:
        live = self.mask[row].nonzero().flatten()
        self.mask[row, live[length:]] = False
        del self._tokens[row][length:]
        used = self.mask.any(0).nonzero()
        end = int(used[-1]) + 1 if len(used) else 0
        rollback(self.cache, end)
        self.mask = self.mask[:, :end]

    def remove_rows(self, rows: list[int]) -> None:
        stay = [i for i in range(self.rows) if i not in set(rows)]
        if len(stay) == self.rows:
            return
        self._retire([i for i in range(self.rows) if i not in stay])
        self._tokens = [self._tokens[i] for i in stay]
        if not stay:
            self.cache = self.mask = None
            return
        self.cache.batch_select_indices(torch.tensor(stay, device=self.model.device))
        self.mask = self.mask[stay]
        # Slots no remaining row attends at the left (padding for rows that left) can go.
        first_live = int(self.mask.any(0).long().argmax())
        if first_live:
            self._keep_slots(torch.arange(first_live, self.mask.shape[1]).expand(len(stay), -1))

    def _join(self, cache: DynamicCache, tokens: list[int]) -> None:
        length = cache.get_seq_length()
        self._tokens.append(tokens)
        if self.cache is None:
            self.cache, self.mask = cache, torch.ones(1, length, dtype=torch.bool)
            return
        T = self.mask.shape[1]
        common = max(T, length)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, common - T), _left_pad(theirs.keys, common - length)])
            mine.values = torch.cat([_left_pad(mine.values, common - T), _left_pad(theirs.values, common - length)])
        own = torch.zeros(1, common, dtype=torch.bool)
        own[:, common - length :] = True
        self.mask = torch.cat([torch.nn.functional.pad(self.mask, (common - T, 0)), own])

    def _compact_if_sparse(self) -> None:
        """Gather each row's live slots to the right when that frees more than `compact_above` of the cache.
        Holes alone are no reason: a short prompt's left padding beside a long one cannot be freed, and
        gathering the whole cache every step for nothing cost ~50 ms a step at 4 rows on the Qwen pair."""
        live = self.mask.sum(1)
        common = int(live.max())
        if self.mask.shape[1] - common <= self.compact_above * self.mask.shape[1]:
            return
        index = torch.zeros(self.rows, common, dtype=torch.long)
        for i, row in enumerate(self.mask):
            slots = row.nonzero().flatten()
            index[i, common - len(slots) :] = slots
        self._keep_slots(index)
        self.mask = torch.arange(common)[None, :] >= (common - live)[:, None]

    def _keep_slots(self, index: torch.Tensor) -> None:
        """Keep cache slots index[b] (a [B, T'] slot index) of each row b, in that order."""
        self.mask = self.mask.gather(1, index)
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            gather = index.to(layer.keys.device)[:, None, :, None].expand(B, H, index.shape[1], D)
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
