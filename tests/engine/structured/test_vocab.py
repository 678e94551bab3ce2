"""The vocabulary as bytes: byte-level BPE decoded through GPT-2's table, special tokens given no bytes."""

from stallfree.engine.structured.vocab import token_bytes


def test_every_token_is_the_bytes_it_decodes_to(default_model):
    tok = default_model.tokenizer
    vocab = token_bytes(tok)
    assert len(vocab) == tok.vocab_size
    text = 'Hello, wörld! {"a": [1, 2]}\n\t日本語 🙂'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids).decode() == text
    space_hello = tok.encode(" hello", add_special_tokens=False)
    assert vocab[space_hello[0]].startswith(b" ")


def test_special_tokens_have_no_bytes(default_model):
    tok = default_model.tokenizer
    vocab = token_bytes(tok)
    for text in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert vocab[tok.token_to_id(text)] == b""


def test_a_token_holding_part_of_a_character_keeps_its_raw_bytes(default_model):
    tok = default_model.tokenizer
    vocab = token_bytes(tok)
    ids = tok.encode("🙂", add_special_tokens=False)
    assert b"".join(vocab[i] for i in ids) == "🙂".encode()
    if len(ids) > 1:  # split inside the character: no piece is valid UTF-8 on its own
        assert any(not _is_utf8(vocab[i]) for i in ids)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True
