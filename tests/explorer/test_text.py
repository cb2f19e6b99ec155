"""Characters, not bytes: the explorer's text of byte-level BPE tokens (the demo's kind and the release's English
tokenizer) and of the release's Chinese characters. Tokens that are pieces of one UTF-8 character make that
character together, each shows its own bytes, and every invisible character has a visible mark."""

from __future__ import annotations

import pytest
from _pages import WORLD, byte_model, release_chinese, release_english

from modeling_brillm.explorer import explore, label
from modeling_brillm.explorer.text import TokenText, char_groups, prose


@pytest.fixture(scope="module")
def byte_level():
    return byte_model()


def groups_of(tokenizer, line):
    ids = tokenizer(line)["input_ids"]
    texts = TokenText(tokenizer)
    return ids, texts, char_groups([texts.bytes(t) for t in ids])


def test_token_bytes_join_into_the_tokenizers_own_text(byte_level):
    _, tokenizer = byte_level
    for line in WORLD:
        ids, texts, _ = groups_of(tokenizer, line)
        joined = b"".join(texts.bytes(t) for t in ids if texts.bytes(t) is not None)
        assert joined.decode("utf-8") == tokenizer.decode(ids, skip_special_tokens=True) == line


def test_pieces_of_a_character_are_grouped_into_it(byte_level):
    _, tokenizer = byte_level
    for line in WORLD:
        ids, texts, groups = groups_of(tokenizer, line)
        pieces = [t for t in ids if not texts.whole(t)]
        if any(ord(c) > 0x3000 for c in line):  # Chinese and emoji are rare enough here to be split into bytes
            assert pieces
        covered = {i for first, last in groups for i in range(first, last + 1)}
        assert {i for i, t in enumerate(ids) if not texts.whole(t)} <= covered
        for first, last in groups:
            text = tokenizer.decode(ids[first:last + 1])
            assert "\ufffd" not in text and last > first  # whole characters, from two or more tokens
            assert all("\ufffd" in tokenizer.decode([t]) or texts.whole(t) for t in ids[first:last + 1])
    ids, texts, groups = groups_of(tokenizer, "\u4e2d\u6587")
    assert [tokenizer.decode(ids[a:b + 1]) for a, b in groups] == ["\u4e2d"]  # 中 is two tokens, 文 one
    assert texts.text(ids[1]).startswith("\\x") and label(texts.text(ids[-1])) == "\u6587"


def test_a_page_shows_characters_and_each_tokens_bytes(byte_level):
    model, tokenizer = byte_level
    page = explore(model, WORLD[2], tokenizer)
    path, data = page.data["paths"][0], page.data
    ids = tokenizer(WORLD[2])["input_ids"]
    assert [g[2] for g in path["groups"]] == ["\u2423\U0001f600", "\u2423\U0001f680"]  # the leading space marked
    assert [g[3] for g in path["groups"]] == [" \U0001f600", " \U0001f680"]  # prose keeps the space
    first, last = path["groups"][0][:2]
    texts = TokenText(tokenizer)
    for t in ids[first:last + 1]:
        if not texts.whole(t):
            assert data["bytes"][str(t)] == texts.bytes(t).hex(" ")
    assert "\ufffd" not in "".join(data["labels"].values())
    # what each candidate makes after the character's first bytes: the step holds it in context
    step = path["steps"][last - 1]  # its target is the group's last token, which completes the emoji
    assert step["ctx"][str(step["tgt"])] == "\U0001f600"
    waiting = b"".join(texts.bytes(t) for t in ids[first:last])[1:]  # the emoji's first three bytes (after " ")
    for a, _ in step["alts"]:
        data = texts.bytes(a)
        if data is None:
            expected = "a special token"
        elif not 0x80 <= data[0] < 0xC0:  # only a continuation byte can follow the three
            expected = "cannot follow"
        else:
            try:
                expected = label((waiting + data).decode("utf-8"))
            except UnicodeDecodeError:  # the character completes, and a stray byte follows
                expected = "cannot follow"
        assert step["ctx"][str(a)] == expected


def test_invisible_characters_are_visible_marks(byte_level):
    _, tokenizer = byte_level
    ids, texts, groups = groups_of(tokenizer, WORLD[3])
    shown = "".join(label(tokenizer.decode(ids[a:b + 1])) for a, b in groups)
    assert "\\u200b" in shown and "\\u202e" in shown and "\u200b" not in shown and "\u202e" not in shown
    assert prose("a b\nc\u200b") == "a b\nc\\u200b"
    assert label(" the") == "\u2423the" and label("the ") == "the\u2423" and label("a b") == "a b"
    assert label(" ") == "\u2423" and label("  ") == "\u2423\u2423"
    assert label("a\nb\tc\r") == "a\u21b5b\u21e5c\u240d" and label("\x07") == "\u2407" and label("\x7f") == "\u2421"
    assert label("\u202eevil") == "\\u202eevil" and label("zero\u200bwidth") == "zero\\u200bwidth"
    assert label("") == "\u2205" and label(None, 42) == "#42" and label("<b>") == "<b>"


def test_the_released_english_tokenizer_at_4000_nodes():
    model, tokenizer = release_english()
    assert model.config.vocab_size == len(tokenizer) == 4000
    for line in WORLD:
        page = explore(model, line, tokenizer)
        path = page.data["paths"][0]
        rebuilt, t = [], 0
        groups = {g[0]: g for g in path["groups"]}
        while t < len(path["tokens"]):  # the page's prose, token by token and group by group, is the text
            g = groups.get(t)
            rebuilt.append(g[3] if g else page.data["prose"][str(path["tokens"][t])])
            t = g[1] + 1 if g else t + 1
        assert "".join(rebuilt).strip() == prose(tokenizer.decode(path["tokens"])).strip()
        assert "\ufffd" not in "".join(rebuilt)


def test_the_released_chinese_characters_at_4001_nodes():
    model, tokenizer = release_chinese()
    assert model.config.vocab_size == len(tokenizer) == 4001
    text = "\u4e2d\u56fd\u7684\u5927\u5b66\u662f\u4e00\u4e2a\u5730\u65b9"  # every character is one token
    page = explore(model, text, tokenizer, prompt=text, max_new_tokens=5)
    trace = page.data["paths"][0]
    assert trace["groups"] == [] and trace["tokens"] == tokenizer(text)["input_ids"]
    assert [page.data["labels"][str(t)] for t in trace["tokens"]] == list(text)
    assert "".join(page.data["prose"][str(t)] for t in trace["tokens"]) == text
