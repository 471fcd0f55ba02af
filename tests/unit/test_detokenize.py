"""The text options (vLLM's names): include_stop_str_in_output, skip_special_tokens,
spaces_between_special_tokens, in the byte tokenizer, the incremental TextStream and the engine."""

from __future__ import annotations

import attrs
import pytest
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.models.tokenizer import ByteTokenizer
from bi_core.runtime.detokenize import TextStream

TOK = ByteTokenizer()
END, START = TOK.im_end, TOK.im_start
IDS = [*"hé".encode(), END, START, *b"x", TOK.eos_token_id]


def test_byte_tokenizer_skips_or_keeps_special_tokens():
    assert TOK.decode(IDS) == "héx"
    assert TOK.decode(IDS, skip_special_tokens=False) == "hé <|im_end|> <|im_start|> x <|endoftext|>"
    assert TOK.decode(IDS, skip_special_tokens=False, spaces_between_special_tokens=False) == \
        "hé<|im_end|><|im_start|>x<|endoftext|>"
    assert TOK.decode(IDS, spaces_between_special_tokens=False) == "héx"  # nothing to space when skipped


@pytest.mark.parametrize("skip,spaces", [(True, True), (False, True), (False, False)])
def test_text_stream_equals_the_whole_decode(skip, spaces):
    """Token by token (half a character held back, special tokens between), the same text."""
    stream = TextStream(TOK, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    for t in IDS:
        stream.feed(t)
    stream.flush()
    assert stream.text == TOK.decode(IDS, skip_special_tokens=skip, spaces_between_special_tokens=spaces)


def test_include_stop_str_keeps_the_match_and_cuts_after_it():
    ids = list(b"say STOP now")
    trimmed, kept = TextStream(TOK, ("STOP",)), TextStream(TOK, ("STOP",), include_stop=True)
    for t in ids:
        trimmed.feed(t)
        kept.feed(t)
        assert kept.settled == len(kept.text)  # a kept match never cuts what was streamed
    assert trimmed.text == "say " and kept.text == "say STOP" and kept.stop_reason == "STOP"
    one = TextStream(TOK, ("ST",), include_stop=True)  # a delta with text after the match
    one._add("xSTy")
    assert one.text == "xST"


@pytest.fixture(scope="module")
def eng():
    return build_engine(EngineConfig.from_dict(tiny_config(model={"random": {"preset": "tiny-moe", "seed": 1}})))


def test_engine_stop_strings_and_stop_tokens_with_include_stop_str(eng):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    full = eng.generate([[1, 2, 3, 4]], params)[0]
    text = TOK.decode(full.token_ids)
    k = next(i for i, t in enumerate(full.token_ids) if i > 1 and 32 < t < 127)  # an ASCII token
    stop_str = chr(full.token_ids[k])
    cut = text.index(stop_str)
    by_str = eng.generate([[1, 2, 3, 4]], attrs.evolve(params, stop=stop_str, include_stop_str_in_output=True))[0]
    assert by_str.text == text[:cut + 1] and by_str.stop_reason == stop_str
    for streamed in (False, True):  # the text decoded at once, and incrementally
        kw = dict(stop_token_ids=full.token_ids[k])
        dropped = run(eng, attrs.evolve(params, **kw), streamed)
        kept = run(eng, attrs.evolve(params, include_stop_str_in_output=True, **kw), streamed)
        assert dropped.token_ids == kept.token_ids and dropped.token_ids[-1] == full.token_ids[k]
        assert dropped.text == TOK.decode(dropped.token_ids[:-1]) and kept.text == TOK.decode(kept.token_ids)


def run(eng, params, streamed: bool):
    """One request to the end, with its text decoded incrementally (as the server asks) or at once."""
    if not streamed:
        return eng.generate([[1, 2, 3, 4]], params)[0]
    seq = eng.add_request([1, 2, 3, 4], params, text=True)
    while eng.has_work():
        eng.step()
    return eng.output_of(seq)


@pytest.mark.parametrize("streamed", [False, True])
def test_engine_keeps_special_tokens_in_the_text_when_asked(eng, streamed):
    """Greedy tiny-moe (seed 1) ends its 40 tokens with <|im_start|> (id 257)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = run(eng, params, streamed)
    assert plain.token_ids[-1] == START and "<|" not in plain.text
    spaced = run(eng, attrs.evolve(params, skip_special_tokens=False), streamed)
    tight = run(eng, attrs.evolve(params, skip_special_tokens=False, spaces_between_special_tokens=False), streamed)
    assert spaced.text == plain.text + " <|im_start|>" and tight.text == plain.text + "<|im_start|>"


def test_hf_tokenizer_passes_the_options_on(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from bi_core.models.tokenizer import HFTokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["hello world"] * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>").save_pretrained(str(tmp_path))
    tok = HFTokenizer(tmp_path)
    ids = tok.encode("hello") + [tok._tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|>"
