"""A token's bytes (OpenAI's logprobs ``bytes``): what the token stands for, even half a character."""

from __future__ import annotations

from bi_core.models.tokenizer import ByteTokenizer, HFTokenizer


def test_byte_tokenizer_gives_the_raw_byte_of_half_a_character():
    tok = ByteTokenizer()
    ids = tok.encode("é")  # two bytes, two tokens; each alone decodes to U+FFFD
    assert [tok.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == "é"
    assert tok.token_bytes(tok.eos_token_id) == b""


def test_byte_level_bpe_tokens_map_back_to_their_bytes(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["héllo wörld, batch invariance ✓ \n\t 日本語"] * 20
    bpe.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>").save_pretrained(str(tmp_path))
    tok = HFTokenizer(tmp_path)
    for s in ["héllo wörld ✓", " \n\t日本語", "batch invariance"]:
        ids = tok.encode(s)
        assert b"".join(tok.token_bytes(i) for i in ids) == s.encode("utf-8")
    end = tok._tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.token_bytes(end) == b"<|im_end|>"


def test_token_names_are_distinct_for_distinct_tokens():
    """Logprobs name a token by its text, or OpenAI's ``bytes:\\xNN`` for half a character (each
    alone decodes to U+FFFD), or a special token's name: one name per token of the vocabulary."""
    tok = ByteTokenizer()
    names = [tok.token_name(i) for i in range(260)]
    assert len(set(names)) == 260
    assert names[ord("a")] == "a" and names[0xC3] == "bytes:\\xc3" and names[tok.im_end] == "<|im_end|>"
