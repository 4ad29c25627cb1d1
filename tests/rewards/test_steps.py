import pytest

from groupwise.rewards.steps import StepSplitter


@pytest.fixture(scope="module")
def bpe():
    return _train_bpe()


def _train_bpe():
    """A byte-level BPE tokenizer trained in-process, whose merges make tokens that span "\\n" and whose byte
    pieces split multi-byte characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # merges may cross "\n"
    tk.decoder = decoders.ByteLevel()
    corpus = ["x = 1 + 2.\nThen y = 3.\nSo z = 4.\n"] * 50 + ["café 中文 ки\n"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>")


def _check_ends(tok, ids, steps, splitter):
    """Brute-force reference: a step ends at the first token whose decoded prefix contains the whole step."""
    text = tok.decode(ids, skip_special_tokens=True)
    pieces = splitter.split_text(text)
    for (piece, char_end), end in zip(pieces, steps.ends):
        if char_end == -1:
            assert end == len(ids) - 1 or end == len(ids)  # the final open step ends at the last token
            continue
        assert tok.decode(ids[: end + 1]).startswith(text[:char_end])
        assert end == 0 or not tok.decode(ids[:end]).startswith(text[:char_end])


def test_char_tokenizer_by_hand(tokenizer):
    # "ab\n\ncd\nef<eos>": tokens a b \n \n c d \n e f <eos> = indices 0..9
    # steps: "ab" ends at its "\n" (2); the blank "\n" step is dropped; "cd" ends at 6; "ef" (no delimiter) ends at
    # the EOS (9), so the decision to stop shares the last step's advantage
    ids = tokenizer("ab\n\ncd\nef", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    s = StepSplitter().split(ids, tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("ab", "cd", "ef") and s.ends == (2, 6, 9) and not s.truncated_last


def test_the_eos_after_a_closing_delimiter_belongs_to_the_last_step(tokenizer):
    # "ab\ncd\n<eos>": tokens a b \n c d \n <eos> = 0..6; "cd" ends at the EOS (6), not at its "\n" (5), which
    # left the EOS after every step end and so with advantage 0 under process supervision
    ids = tokenizer("ab\ncd\n", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    s = StepSplitter().split(ids, tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("ab", "cd") and s.ends == (2, 6) and not s.truncated_last
    # blank text before the EOS joins the last step too: "ab\n\n \n<eos>" = 0..6, "ab" ends at 6
    ids = tokenizer("ab\n\n \n", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert StepSplitter().split(ids, tokenizer, ends_with_eos=True, truncated=False).ends == (6,)
    # cut by the length limit (no EOS): the trailing "\n" is not a decision to stop, the step ends at its "\n"
    cut = tokenizer("ab\ncd\n", add_special_tokens=False).input_ids
    assert StepSplitter().split(cut, tokenizer, ends_with_eos=False, truncated=True).ends == (2, 5)


def test_truncated_final_step_is_marked(tokenizer):
    ids = tokenizer("ab\ncd", add_special_tokens=False).input_ids  # cut by the length limit: no EOS
    s = StepSplitter().split(ids, tokenizer, ends_with_eos=False, truncated=True)
    assert s.texts == ("ab", "cd") and s.ends == (2, 4) and s.truncated_last
    assert s.drop_last().texts == ("ab",)
    closed = tokenizer("ab\ncd\n", add_special_tokens=False).input_ids
    assert not StepSplitter().split(closed, tokenizer, ends_with_eos=False, truncated=True).truncated_last


def test_no_steps(tokenizer):
    ids = tokenizer("\n\n", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert len(StepSplitter().split(ids, tokenizer, ends_with_eos=True, truncated=False)) == 0


def test_bpe_tokens_spanning_the_delimiter_and_multibyte_characters(bpe):
    text = "x = 1 + 2.\nThen y = 3.\nSo z = 4.\ncafé 中文\nend"
    ids = bpe(text, add_special_tokens=False).input_ids
    spans = [bpe.decode([i]) for i in ids]
    assert any("\n" in s and s.strip() for s in spans), f"no merge crosses the delimiter: {spans}"
    assert any("\ufffd" in bpe.decode([i]) for i in ids), "no token splits a multi-byte character"
    ids = ids + [bpe.eos_token_id]
    splitter = StepSplitter()
    steps = splitter.split(ids, bpe, ends_with_eos=True, truncated=False)
    assert steps.texts == ("x = 1 + 2.", "Then y = 3.", "So z = 4.", "café 中文", "end")
    assert list(steps.ends) == sorted(steps.ends)
    _check_ends(bpe, ids[:-1], steps, splitter)


def test_regex_and_tag_modes(bpe, tokenizer):
    ids = tokenizer("1+1=2. 2+2=4. done", add_special_tokens=False).input_ids
    s = StepSplitter("regex", pattern=r"\.\s").split(ids, tokenizer, ends_with_eos=False, truncated=False)
    assert s.texts == ("1+1=2", "2+2=4", "done") and s.ends == (6, 13, 17)
    tag_ids = bpe("x = 1 ки\ny = 2 ки\n", add_special_tokens=False).input_ids
    t = StepSplitter("tag", step_tag="ки").split(tag_ids, bpe, ends_with_eos=False, truncated=False)
    assert t.texts == ("x = 1", "y = 2")  # the trailing "\n" after the last tag is a blank step, dropped
    # "ки" is 4 bytes in UTF-8: the step ends at the token completing it, not at a token holding half of "и"
    assert "ки" in bpe.decode(tag_ids[: t.ends[0] + 1]) and "ки" not in bpe.decode(tag_ids[: t.ends[0]])
    _check_ends(bpe, tag_ids, t, StepSplitter("tag", step_tag="ки"))


def test_a_step_tag_that_is_a_special_token(tokenizer):
    # "<extra_0>" added as a special token (Qwen-style markers are): a=1<extra_0>b=2<extra_0><eos> = tokens 0..8.
    # Decoding with skip_special_tokens=True would drop the tag and find one step "a=1b=2"; the tag is kept:
    # "a=1" ends at its tag (3), "b=2" at the EOS (8)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    tag = tokenizer.convert_tokens_to_ids("<extra_0>")
    a, b = (tokenizer(t, add_special_tokens=False).input_ids for t in ("a=1", "b=2"))
    splitter = StepSplitter("tag", step_tag="<extra_0>")
    s = splitter.split(a + [tag] + b + [tag, tokenizer.eos_token_id], tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("a=1", "b=2") and s.ends == (3, 8) and not s.truncated_last
    # other special tokens are still dropped from the text without moving the boundaries: a <pad> at 1 and at 5,
    # a = <pad> 1 <extra_0> b <pad> = 2 (cut, no EOS) = 0..8; "a=1" ends at its tag (4), "b=2" (open) at 8
    pad = tokenizer.pad_token_id
    ids = a[:1] + [pad] + a[1:] + [tag] + b[:1] + [pad] + b[1:]
    s = splitter.split(ids, tokenizer, ends_with_eos=False, truncated=True)
    assert s.texts == ("a=1", "b=2") and s.ends == (4, 8) and s.truncated_last


@pytest.mark.parametrize("pattern", ["<extra_0>", r"<extra_\d+>"])
def test_a_step_pattern_that_matches_a_special_token(tokenizer, pattern):
    """step_split='regex' whose pattern is a special token's text: decoding with skip_special_tokens=True dropped it,
    so every completion was one step (the delimiter and tag modes kept theirs). a=1<extra_0>b=2<extra_0><eos>:
    "a=1" ends at its marker (3), "b=2" at the EOS (8); a <pad> the pattern does not match is still dropped
    (a <pad> = 1 <extra_0> b = 2, cut: "a=1" ends at 4, "b=2", open, at 7)."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    mark = tokenizer.convert_tokens_to_ids("<extra_0>")
    a, b = (tokenizer(t, add_special_tokens=False).input_ids for t in ("a=1", "b=2"))
    splitter = StepSplitter("regex", pattern=pattern)
    s = splitter.split(a + [mark] + b + [mark, tokenizer.eos_token_id], tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("a=1", "b=2") and s.ends == (3, 8)
    s = splitter.split(a[:1] + [tokenizer.pad_token_id] + a[1:] + [mark] + b, tokenizer, ends_with_eos=False,
                       truncated=True)
    assert s.texts == ("a=1", "b=2") and s.ends == (4, 7) and s.truncated_last


def test_special_and_plain_step_tags_split_alike():
    """The same token ids split the same whether the tag is a special token or a plain added one, on byte-level
    BPE with merges across the tag and multi-byte characters (a seeded fuzz)."""
    import random

    special, plain = _train_bpe(), _train_bpe()
    special.add_special_tokens({"additional_special_tokens": ["<t>"]})
    plain.add_tokens(["<t>"])
    assert special.convert_tokens_to_ids("<t>") == plain.convert_tokens_to_ids("<t>")
    rng = random.Random(0)
    pieces = ["x", " = ", "1", "2.", "\n", "Then", " y", "é", "中", "文", " ", "<t>", "<t>\n", " <t>"]
    splitter = StepSplitter("tag", step_tag="<t>")
    found = 0
    for _ in range(150):
        ids = plain("".join(rng.choice(pieces) for _ in range(rng.randint(1, 20))), add_special_tokens=False).input_ids
        if not ids:
            continue
        eos = rng.random() < 0.5
        full = ids + [plain.eos_token_id] if eos else ids
        want = splitter.split(full, plain, ends_with_eos=eos, truncated=not eos)
        assert splitter.split(full, special, ends_with_eos=eos, truncated=not eos) == want
        found += len(want) > 1
    assert found > 50  # most samples have a tag inside


def test_a_turn_finished_before_the_cut_is_not_truncated(tokenizer):
    # turn "ab" + EOS = tokens 0..2, then the tool result "=2\n" = 3..5 fills max_completion_length, so the rollout
    # does not end with EOS (truncated) but its only turn ended at 2 < 5: complete, kept by drop-last
    turn = tokenizer("ab", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    ids = turn + tokenizer("=2\n", add_special_tokens=False).input_ids
    s = StepSplitter("turn").split_turns(ids, [1, 1, 1, 0, 0, 0], [2], tokenizer, truncated=True)
    assert s.texts == ("ab",) and s.ends == (2,) and not s.truncated_last
    # the second turn "cd" = 6..7 cut by the budget (its end 7 is the last token): truncated
    ids2 = ids + tokenizer("cd", add_special_tokens=False).input_ids
    s = StepSplitter("turn").split_turns(ids2, [1, 1, 1, 0, 0, 0, 1, 1], [2, 7], tokenizer, truncated=True)
    assert s.texts == ("ab", "cd") and s.ends == (2, 7) and s.truncated_last


def test_bad_splitter_settings():
    with pytest.raises(ValueError, match="step_pattern"):
        StepSplitter("regex")
    with pytest.raises(ValueError, match="step_tag"):
        StepSplitter("tag")
    with pytest.raises(ValueError, match="step_split='lines'"):
        StepSplitter("lines")


def test_a_delimiter_that_is_a_special_token(tokenizer):
    # step_split="delimiter" with "<extra_0>" a special token: decoding with skip_special_tokens=True dropped it, so
    # "a=1<extra_0>b=2<extra_0><eos>" (tokens 0..8) was one step "a=1b=2" ending at the EOS. Now as in tag mode:
    # "a=1" ends at its delimiter (3), "b=2" at the EOS (8)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    sep = tokenizer.convert_tokens_to_ids("<extra_0>")
    a, b = (tokenizer(t, add_special_tokens=False).input_ids for t in ("a=1", "b=2"))
    ids = a + [sep] + b + [sep, tokenizer.eos_token_id]
    s = StepSplitter("delimiter", delimiter="<extra_0>").split(ids, tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("a=1", "b=2") and s.ends == (3, 8)
    # a plain delimiter decodes as before (special tokens dropped from the text, boundaries unmoved)
    ids = tokenizer("a=1\nb=2", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    s = StepSplitter().split(ids, tokenizer, ends_with_eos=True, truncated=False)
    assert s.texts == ("a=1", "b=2") and s.ends == (3, 7)


@pytest.mark.parametrize("pattern", [r"(?=Step \d)", r"^", r"\b", r"x{0}"])
def test_a_step_pattern_whose_matches_are_all_empty_is_refused(pattern):
    # an empty match ends no step: the completion silently became one step; refused at config time, naming the fix
    from groupwise import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match=r"step_pattern=.* only matches empty text.*match the delimiter itself"):
        StepSplitter("regex", pattern=pattern)
    with pytest.raises(ConfigError, match="step_pattern="):
        GRPOConfig(supervision="process", step_split="regex", step_pattern=pattern)


def test_step_patterns_that_match_text_are_kept():
    # a lookahead after the delimiter, or a pattern that may but need not match empty text, still splits
    assert StepSplitter("regex", pattern=r"\n(?=Step \d)").split_text("Step 1: a\nStep 2: b") == [
        ("Step 1: a", 10), ("Step 2: b", -1)]
    assert [t for t, _ in StepSplitter("regex", pattern=r"\n*").split_text("a\n\nb")] == ["a", "b"]
