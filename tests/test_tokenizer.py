"""The GPT-2 BPE tokenizer: transformers' ids, <|endoftext|> in user text stays text, damaged BPE files refused."""
import shutil

import pytest
from transformers import GPT2TokenizerFast

from data import EOT_ID, TokenizerFileError, bpe_files, build_tokenizer, get_tokenizer

TEXTS = [
    "Hello world",
    "Amanda: I baked cookies. Do you want some?\r\nJerry: Sure! 🍪😀",
    "Lily: 你好，世界！ これはテストです。 안녕하세요",
    "Tom: <file_photo> look at this <file_gif>",
    "   leading and      long     whitespace\n\n\n\t\ttabs   ",
    "numbers 1234567 3.14159 and punctuation?!... don't won't I'll we've",
    "mixed\r\n\r\nCRLF lines\rcarriage",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    encoder_json, vocab_bpe = bpe_files()
    folder = tmp_path_factory.mktemp("gpt2-tokenizer")
    shutil.copy(encoder_json, folder / "vocab.json")
    shutil.copy(vocab_bpe, folder / "merges.txt")
    return GPT2TokenizerFast.from_pretrained(folder)


def test_hello_world_and_eot():
    enc = get_tokenizer()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == EOT_ID == 50256
    assert enc.n_vocab == 50257
    assert get_tokenizer() is enc


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(hf_tokenizer, text):
    ours = get_tokenizer().encode_ordinary(text)
    assert ours == hf_tokenizer(text)["input_ids"]
    assert get_tokenizer().decode(ours) == text


def test_eot_in_user_text_stays_text():
    # A dialogue that happens to contain the marker must not inject a real end-of-text token.
    assert EOT_ID not in get_tokenizer().encode_ordinary("a <|endoftext|> b")


def test_corrupted_vocab_is_refused(tmp_path):
    encoder_json, vocab_bpe = bpe_files()
    corrupted = tmp_path / "vocab.bpe"
    blob = bytearray(open(vocab_bpe, "rb").read())
    blob[100] ^= 1
    corrupted.write_bytes(bytes(blob))
    with pytest.raises(TokenizerFileError, match="sha256"):
        build_tokenizer(encoder_json, str(corrupted))


def test_corrupted_encoder_is_refused(tmp_path):
    encoder_json, vocab_bpe = bpe_files()
    corrupted = tmp_path / "encoder.json"
    corrupted.write_text(open(encoder_json).read().replace('"hello"', '"hellO"'))
    with pytest.raises(TokenizerFileError, match="sha256"):
        build_tokenizer(str(corrupted), vocab_bpe)
