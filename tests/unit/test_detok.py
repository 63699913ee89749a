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
    # Invalid bytes just before the cut, not yet handed out, go with it (as vLLM's do)
    d = IncrementalDetokenizer(tok, [])
    d.add(tok.encode("x") + [lone, lone, lone])
    assert d.take(is_final=True) == "x"


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


def _counting(d):
    """d's decoder, counting the ids it is given (the detokenizer's work)."""
    decode, seen = d._decode, [0]

    def count(ids):
        seen[0] += len(ids)
        return decode(ids)

    d._decode = count
    return seen


def test_a_window_that_never_makes_a_whole_character_costs_a_bounded_amount_a_token(tiny_model):
    """Tokens that decode to lone bytes (a character's first byte again and again), or to
    nothing (special tokens, ids the tokenizer lacks): each costs the same however long the
    output, where the window once grew with it (the output's square on the frontend's loop)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    lone = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    unknown = len(tok) + 1  # the model's vocabulary may be larger than the tokenizer's
    assert tok.decode([unknown]) == ""
    for ids in ([lone] * 3000, [lone, unknown, tok.all_special_ids[0]] * 1000, [unknown] * 3000):
        d = IncrementalDetokenizer(tok, ["never"])
        seen = _counting(d)
        pieces = []
        for t in ids:
            d.add([t])
            pieces.append(d.take())
        pieces.append(d.take(is_final=True))
        assert seen[0] <= 40 * len(ids), seen[0]
        # The tokens' text, less its last marks not yet handed out (those the stop string's
        # holdback kept, and the last lone byte, which could have begun a character)
        text, whole = "".join(pieces), tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(text) and len(whole) - len(text) <= d.holdback + 1
        assert text.rstrip("\ufffd") == whole.rstrip("\ufffd")


def test_a_long_stream_keeps_only_its_unsent_tail(tiny_model):
    """Each token adds to the text not yet handed out, never to the whole output: what a
    stream holds is its stop strings' holdback and a token's text, however long it runs
    (a text grown in place would be copied whole a token, its cost the output's square)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode("the quick brown fox jumps over the lazy dog 中文 🙂 ") * 200
    d = IncrementalDetokenizer(tok, ["never in it", "nor this"])
    pieces, longest = [], 0
    for t in ids:
        d.add([t])
        longest = max(longest, len(d.unsent))
        pieces.append(d.take())
    pieces.append(d.take(is_final=True))
    assert "".join(pieces) == tok.decode(ids) and len(pieces[-1]) == d.holdback
    assert longest <= d.holdback + max(len(tok.decode([t])) for t in ids) and not d.unsent


def test_tokens_of_no_text_between_a_characters_bytes_change_nothing(tiny_model):
    """Special tokens the tokenizer skips (its added ones, not only those it names special)
    between a character's bytes, more of them than a window holds."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode("x\u4e2d the")
    named = set(tok.all_special_ids)
    special = next(i for i, t in tok.added_tokens_decoder.items() if t.special and i not in named)
    for ids in (ids[:2] + [special] * 40 + ids[2:], [ids[0]] + [special] * 40 + ids[1:]):
        d = IncrementalDetokenizer(tok, ["th"])
        d.add(ids)
        assert d.unsent == "x\u4e2d " and d.is_stopped, ids


def test_any_tokens_in_any_updates_make_the_text_they_make_decoded_whole(tiny_model):
    """Random ids, many of them partial characters, specials or ids the tokenizer lacks,
    arriving a few at a time: the streamed text is the tokens' text decoded at once."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    odd = tok.all_special_ids + [len(tok), len(tok) + 7]
    rng = random.Random(0)
    for _ in range(300):
        ids = [
            rng.choice(partial)
            if rng.random() < 0.5
            else rng.choice(odd)
            if rng.random() < 0.4
            else rng.randrange(len(tok))
            for _ in range(rng.randint(1, 80))
        ] + tok.encode(" end")
        d, pieces, i = IncrementalDetokenizer(tok, []), [], 0
        while i < len(ids):
            k = rng.randint(1, 6)
            assert d.add(ids[i : i + k]) == len(ids[i : i + k])
            pieces.append(d.take())
            i += k
        pieces.append(d.take(is_final=True))
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True), ids


def test_a_stop_string_inside_an_update_takes_the_tokens_up_to_it(tiny_model):
    """A verify step's update carries several tokens: those after the one that completed
    the stop string are not taken, as one token a step would never have made them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    ids = tok.encode("the water is hot and the day is long")
    one = IncrementalDetokenizer(tok, ["is hot"])
    num_taken = next(n + 1 for n, t in enumerate(ids) if one.add([t]) and one.is_stopped)
    assert num_taken < len(ids)
    many = IncrementalDetokenizer(tok, ["is hot"])
    assert many.add(ids[:2]) == 2
    assert many.add(ids[2:]) == num_taken - 2 and many.is_stopped
    assert many.add(ids[:1]) == 0
    assert many.take(is_final=True) == one.take(is_final=True) == "the water "


def _fast(vocab: dict[str, int], decoder):
    """A tokenizer of these whole tokens (no merges) with this decoder, as transformers
    loads one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    t.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=t, clean_up_tokenization_spaces=False)


def _byte_text(data: bytes) -> str:
    """Bytes as a byte-level BPE token's text: printable Latin-1 stands for itself, the
    other bytes for the characters from 256 on, in order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in kept)}
    return "".join(chr(b) if b in kept else others[b] for b in data)


def test_characters_split_at_every_token_boundary_stream_whole_and_cheaply():
    """Byte-level tokens can end every one inside a character (a euro sign's bytes E2 82 |
    AC E2 82 | AC ...): no token ends a character, yet each is streamed as it completes
    one, and the window stays short (it once grew with the output)."""
    from tokenizers import decoders

    tok = _fast(
        {_byte_text(b"a"): 0, _byte_text(b"\xe2\x82"): 1, _byte_text(b"\xac\xe2\x82"): 2},
        decoders.ByteLevel(),
    )
    ids = [1] + [2] * 2000
    d = IncrementalDetokenizer(tok, [])
    seen, pieces = _counting(d), []
    for t in ids:
        d.add([t])
        pieces.append(d.take())
    assert pieces[1:4] == ["\u20ac"] * 3 and seen[0] <= 40 * len(ids)
    assert "".join(pieces) + d.take(is_final=True) == "\u20ac" * 2000


def test_a_space_that_is_text_only_beside_others_is_kept():
    """A sentencepiece decoder strips the text's first space: "\u2581" alone decodes to
    nothing, yet before a word it is a space (an indented first line keeps its indent).
    Its byte fallback shows a run of bytes as a U+FFFD a byte until the run is all UTF-8:
    characters written in byte tokens, one after another for longer than a window."""
    from tokenizers import decoders

    decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    vocab = {"<unk>": 0, "\u2581": 1, "\u2581Hello": 2, "<0x20>": 3, "\u2581x\ufffd": 11}
    vocab |= {f"<0x{b:02X}>": 4 + i for i, b in enumerate("\u4e2d\U0001f642".encode())}
    tok = _fast(vocab, decoder)
    # byte fallback: a character still coming shows as one U+FFFD a byte (中: 3, 🙂: 4)
    cjk, emoji = [4, 5, 6], [7, 8, 9, 10]
    runs = [2, *cjk, *cjk, *emoji, 1, 2], [*(cjk + emoji) * 20, 1, 2], [2, *cjk * 40]
    runs += ([2, 11], [11, 2, 11])  # a word's own U+FFFD is no byte still coming
    for ids in ([1, 2], [1, 1, 1, 2], [3, 2], [2, 1, 1, 2], [2, *cjk, 1, *emoji, 2, *cjk], *runs):
        d = IncrementalDetokenizer(tok, [])
        pieces = [d.take() for t in ids if d.add([t]) is not None]
        assert "".join(pieces) + d.take(is_final=True) == tok.decode(ids), ids
    d = IncrementalDetokenizer(tok, [])
    seen = _counting(d)
    d.add([7] * 2000)  # an emoji's first byte again and again: a run that is never UTF-8
    assert seen[0] <= 40 * 2000 and d.unsent == "\ufffd" * len(d.unsent)


def test_a_stop_string_is_found_in_text_a_token_ends_inside_a_character():
    """The stable text of a token that also begins a character ("a" of a token a|E2) is
    searched for stop strings as it comes, and the tokens after the one that completed it
    are not taken, even in one update (a verify step's)."""
    from tokenizers import decoders

    vocab = {_byte_text(b"a"): 0, _byte_text(b"a\xe2"): 1, _byte_text(b"\xc3"): 2}
    vocab |= {_byte_text(b"\xa9\xff"): 3, _byte_text(b"\xff"): 4}
    tok = _fast(vocab, decoders.ByteLevel())
    d = IncrementalDetokenizer(tok, ["aa"])
    assert d.add([0, 1, 0, 0]) == 2 and d.is_stopped and d.take(is_final=True) == ""
    d = IncrementalDetokenizer(tok, ["\u00e9"])  # é: C3 | A9, then bytes never valid
    assert d.add([2, 3] + [4] * 12) == 2 and d.is_stopped
    d = IncrementalDetokenizer(tok, ["\ufffd\ufffd"])  # marks of invalid bytes, as stop
    assert d.add([4, 4, 4, 4]) == 3 and d.is_stopped
