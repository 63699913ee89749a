"""Incremental detokenization: multi-byte characters and stop strings."""

from frontend.detok import IncrementalDetokenizer


def _stream(tok, ids, stop=()):
    d = IncrementalDetokenizer(tok, list(stop))
    pieces = []
    for t in ids:
        d.add([t])
        pieces.append(d.take())
        if d.is_stopped:
            break
    pieces.append(d.take(is_final=True))
    return pieces, d


def test_multibyte_characters_are_never_split(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = "emoji 🙂🚀 and 中文字符 and café"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are partial characters
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_a_cut_inside_a_character_drops_its_bytes_not_earlier_marks(tiny_model):
    """max_tokens ending inside a character: no U+FFFD for its bytes (harnesses compare
    text); a replacement mark for invalid bytes the model made earlier stays."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode("ab 🙂")
    cut = next(i for i in range(len(ids), 0, -1) if tok.decode(ids[:i]).endswith("\ufffd"))
    pieces, _ = _stream(tok, ids[:cut])
    assert "".join(pieces) == "ab "
    lone = next(i for i in ids if "\ufffd" in tok.decode([i]))  # a character's first byte alone
    pieces, _ = _stream(tok, tok.encode("x") + [lone] + tok.encode(" y") + [lone])
    assert "".join(pieces) == "x\ufffd y"


def test_stop_string_ends_and_is_not_streamed(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = "the water is hot and the day is long"
    pieces, d = _stream(tok, tok.encode(text), stop=["is hot"])
    assert d.is_stopped
    assert "".join(pieces) == "the water "
    # A stop string never seen: everything streams, the held-back tail at the end.
    pieces, d = _stream(tok, tok.encode(text), stop=["zzz"])
    assert not d.is_stopped and "".join(pieces) == text


def test_the_direct_decoder_matches_the_tokenizer_and_is_used_only_where_it_may_be(tiny_model):
    import random

    from transformers import AutoTokenizer

    from frontend.detok import text_decoder

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert tok.clean_up_tokenization_spaces is False
    decode, rng = text_decoder(tok), random.Random(0)
    specials = tok.all_special_ids
    for _ in range(200):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
            for _ in range(rng.randint(1, 12))
        ]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = True  # the wrapper's clean-up must then run
    calls = []
    tok.decode = lambda ids, **kw: calls.append(kw) or "x"
    assert text_decoder(tok)([1, 2]) == "x" and calls == [{"skip_special_tokens": True}]
