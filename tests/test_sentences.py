"""A lookup's positions after a sentence's end, priced and learned apart from the rest of the copy
(control/sentences.py): a summary quotes its article a sentence at a time, so its copies break there."""

from types import SimpleNamespace

import torch

from specdecode.control import priors
from specdecode.control.sentences import SentenceEnds
from specdecode.control.step import StepPlan
from specdecode.drafters.base import Draft

from replay import epyc_controller

WORDS = ["<pad>", " the", " cat", " sat", ".", " It", " ran", "!", " x", ".y", " 1", ".5", ".\n", "?", "Then"]
TEXTS = WORDS + [f" w{i}" for i in range(len(WORDS), 200)]
FULL_STOP, NEXT = WORDS.index("."), WORDS.index(" It")


class WordTokenizer:
    """Token i is TEXTS[i]; answers the calls SentenceEnds makes of a transformers tokenizer."""

    def __len__(self):
        return len(TEXTS)

    def convert_ids_to_tokens(self, ids):
        return [TEXTS[i] for i in ids]

    def batch_decode(self, batches):
        return [self.decode(ids) for ids in batches]

    def decode(self, ids):
        return "".join(TEXTS[i] for i in ids)


TOKENIZER = WordTokenizer()  # one instance: the controller's table is made once per tokenizer


def test_a_sentence_ends_before_white_space_not_inside_a_word_or_a_number():
    text = [" the", " cat", " sat", ".", " It", " ran", "!", " x", ".y", " 1", ".5", ".\n", "Then", "?", " the"]
    marks = SentenceEnds(TOKENIZER).after([TEXTS.index(t) for t in text])
    assert [t for t, m in zip(text, marks) if m] == [" It", " x", "Then", " the"]
    assert SentenceEnds(TOKENIZER).after([FULL_STOP]) is None  # one token: nothing before it
    assert SentenceEnds(TOKENIZER).after([1, 2, 3]) is None  # no sentence ends: no marks to read
    assert SentenceEnds(TOKENIZER).after([10_000, NEXT, -1, NEXT]) is None  # ids outside the vocabulary end nothing


def copy(sentence_at=None, length=40):
    """A copy draft of `length` words, a sentence ending before position `sentence_at` (None: no sentence ends)."""
    tokens = list(range(100, 100 + length))
    if sentence_at is not None:
        tokens[sentence_at - 1], tokens[sentence_at] = FULL_STOP, NEXT
    return tokens


def taught(ctl, source="suffix/copy"):
    """What other requests taught: copies run 40 tokens inside a sentence, and break at the first word after one."""
    for _ in range(20):
        for _ in range(3):
            ctl.measured.observe_lookup(source, 8, 40, 40, copy())
        ctl.measured.observe_lookup(source, 8, 40, 12, copy(sentence_at=12))
    return ctl


def test_a_copy_is_cut_where_copies_broke_at_a_sentence_end():
    ctl = epyc_controller()
    ctl.read_vocabulary(TOKENIZER)
    taught(ctl)
    assert ctl.measured.after_sentence_rate("suffix/copy").value < 0.2
    crossing = ctl.trim(Draft(torch.tensor([copy(sentence_at=20)]), source="suffix/copy", match_len=8))
    assert 0 < crossing.length <= 20  # not past the sentence's end
    assert ctl.trim(Draft(torch.tensor([copy()]), source="suffix/copy", match_len=8)).length > 20

    blind = taught(epyc_controller())  # the control: without the vocabulary every position is alike
    assert blind.trim(Draft(torch.tensor([copy(sentence_at=20)]), source="suffix/copy", match_len=8)).length > 20
    # positions inside a sentence are priced as they were: the class's own rate counts every position judged
    assert ctl.measured.lookup_rates("suffix/copy", 8)[1].value == blind.measured.lookup_rates("suffix/copy", 8)[1].value


def test_a_refined_source_starts_from_its_parents_rate_after_a_sentence_end():
    ctl = epyc_controller()
    ctl.read_vocabulary(TOKENIZER)
    taught(ctl, "suffix")
    assert ctl.measured.after_sentence_rate("suffix/chain").value == ctl.measured.after_sentence_rate("suffix").value < 0.2
    assert ctl.measured.after_sentence_rate("answers").value == priors.AFTER_SENTENCE_ACCEPT


def test_a_copy_judged_in_hindsight_teaches_where_it_broke():
    """A copy the controller verified none of (priced too dear here) is judged whole as its row commits: right up to
    the sentence's end, wrong after it. The rate after a sentence end falls; a break inside one would not move it."""
    for sentence_at, falls in ((10, True), (None, False)):
        ctl = epyc_controller()
        ctl.read_vocabulary(TOKENIZER)
        for _ in range(20):
            ctl.measured.observe_lookup("suffix/copy", 8, 16, 0)  # copies from this class broke at their first token
        prompt, draft = [1, 2, 3], copy(sentence_at)
        seq = SimpleNamespace(serial=0, ids=torch.tensor([prompt]), finished=False, generated=0)
        drafts = [Draft(torch.tensor([draft]), source="suffix/copy", match_len=8)]
        ctl.fit([seq], StepPlan([]), drafts)
        assert drafts[0].length == 0
        seq.ids = torch.tensor([prompt + draft[:10] + [199]])  # the 11th token differs
        ctl.judge_in_hindsight()
        rate = ctl.measured.after_sentence_rate("suffix/copy").value
        assert (rate < priors.AFTER_SENTENCE_ACCEPT) == falls, rate


def test_an_adaptive_engine_with_a_tokenizer_reads_which_tokens_end_a_sentence(tokenizer):
    from specdecode.batch import BatchEngine
    from specdecode.drafters.ngram import NgramDrafter

    from tiny import tiny_model

    engine = BatchEngine(tiny_model(0), NgramDrafter(), tokenizer, k=4, adaptive=True, max_batch=1, calibrate_costs=False)
    sentences = engine.controller.measured.sentences
    assert sentences is not None and len(sentences.ends) == len(tokenizer) + 1  # and one for ids outside it
    assert BatchEngine(tiny_model(0), NgramDrafter(), k=4, adaptive=True, max_batch=1,
                       calibrate_costs=False).controller.measured.sentences is None  # no tokenizer: every position alike
