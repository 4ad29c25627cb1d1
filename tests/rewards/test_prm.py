import json

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          LlamaForTokenClassification)

from groupwise.config_base import ConfigError
from groupwise.tasks import toy
from groupwise.rewards.prm import (PrefixClassificationPRM, StepTagPRM, TokenClassificationPRM, build_prm_input,
                                   build_prm_input_per_step, load_prm)

PROMPTS = ["q: 1+1", "q: 2+3"]
STEPS = [["1+1=2", "so 2"], ["2+3=5", "5", "done"]]


def _cfg(tokenizer, **kw):
    torch.manual_seed(0)
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, **kw)


def test_build_prm_input_positions(tokenizer):
    # char tokenizer: "ab" + ("c" + "\n") + ("de" + "\n") → ids a b c \n d e \n; judged at the "\n" tokens 3 and 6
    ids, pos = build_prm_input(tokenizer, "ab", ["c", "de"], "\n")
    assert tokenizer.decode(ids) == "abc\nde\n" and pos == [3, 6]
    ids, pos = build_prm_input(tokenizer, "ab", ["c", "de"], "\n", max_length=5)
    assert len(ids) == 5 and pos == [3]  # the second step was cut off
    # a prompt_separator between the prompt and step 1: a b \n c \n d e \n, judged at 4 and 7
    ids, pos = build_prm_input(tokenizer, "ab", ["c", "de"], "\n", prompt_separator="\n")
    assert tokenizer.decode(ids) == "ab\nc\nde\n" and pos == [4, 7]
    assert build_prm_input(tokenizer, "", ["c"], "\n", prompt_separator="\n")[1] == [1]  # no prompt text: none


def test_each_kind_keeps_the_prompt_and_step_1_apart(tokenizer):
    # joined with nothing, the question's last characters and step 1's first are tokenized together (a BPE merge
    # across them): " " for a step-tag PRM, Math-Shepherd's f"{question} {output}", "\n" for the other kinds
    tokenizer.add_tokens(["ки"])
    tag = StepTagPRM(LlamaForCausalLM(_cfg(tokenizer)).eval(), tokenizer)
    assert tag.prompt_separator == " "
    ids, _ = tag._inputs(["q: 1+1"], [["1+1=2", "so 2"]], tag.judge_char)[::2]
    assert tokenizer.decode(ids[0]) == "q: 1+1 1+1=2 ки\nso 2 ки\n"
    token = TokenClassificationPRM(LlamaForTokenClassification(_cfg(tokenizer, num_labels=2)), tokenizer)
    prefix = PrefixClassificationPRM(LlamaForSequenceClassification(_cfg(tokenizer, num_labels=1)), tokenizer)
    assert token.prompt_separator == prefix.prompt_separator == "\n"
    assert TokenClassificationPRM(token.model, tokenizer, prompt_separator="").prompt_separator == ""
    with pytest.raises(ConfigError, match="prompt_separator=3 must be a string"):
        TokenClassificationPRM(token.model, tokenizer, prompt_separator=3)


def test_token_classification_prm_matches_single_forward(tokenizer):
    model = LlamaForTokenClassification(_cfg(tokenizer, num_labels=2)).eval()
    prm = TokenClassificationPRM(model, tokenizer, batch_size=2)
    got = prm(prompts=PROMPTS, completions=["", ""], steps=STEPS)
    for p, s, row in zip(PROMPTS, STEPS, got, strict=True):
        ids, pos = build_prm_input(tokenizer, p, s, "\n", prompt_separator="\n")
        probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)[:, 1]
        assert row == pytest.approx([float(probs[i]) for i in pos], abs=1e-5)


def test_step_tag_prm_is_p_good_over_good_plus_bad(tokenizer):
    tokenizer.add_tokens(["ки"])
    model = LlamaForCausalLM(_cfg(tokenizer)).eval()
    prm = StepTagPRM(model, tokenizer, step_tag="ки", good_token="+", bad_token="-")
    got = prm(prompts=PROMPTS, completions=["", ""], steps=STEPS)
    good, bad = tokenizer.convert_tokens_to_ids("+"), tokenizer.convert_tokens_to_ids("-")
    tag = tokenizer.convert_tokens_to_ids("ки")
    for p, s, row in zip(PROMPTS, STEPS, got, strict=True):
        ids, _ = build_prm_input(tokenizer, p, s, " ки\n", prompt_separator=" ")
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        tag_positions = [i for i, t in enumerate(ids) if t == tag]
        expected = [float(torch.softmax(logits[i, [good, bad]], -1)[0]) for i in tag_positions]
        assert len(tag_positions) == len(s) and row == pytest.approx(expected, abs=1e-5)


def test_step_tag_bad_input(tokenizer):
    model = LlamaForCausalLM(_cfg(tokenizer)).eval()
    with pytest.raises(ValueError, match="does not have the step tag 'ки' as one token"):
        StepTagPRM(model, tokenizer, step_tag="ки")
    tokenizer.add_tokens(["ки"])
    with pytest.raises(ValueError, match="label token '\\+\\+' is not a single token"):
        StepTagPRM(model, tokenizer, step_tag="ки", good_token="++")


def test_prefix_classification_prm(tokenizer):
    model = LlamaForSequenceClassification(_cfg(tokenizer, num_labels=1)).eval()
    got = PrefixClassificationPRM(model, tokenizer, batch_size=3)(prompts=PROMPTS, completions=["", ""], steps=STEPS)
    assert [len(r) for r in got] == [2, 3]
    ids, _ = build_prm_input(tokenizer, PROMPTS[1], STEPS[1][:2], "\n", prompt_separator="\n")  # prompt + steps 1..2
    assert got[1][1] == pytest.approx(float(model(input_ids=torch.tensor([ids])).logits[0, 0]), abs=1e-5)


def test_prefix_classification_leaves_steps_cut_by_max_length_unscored(tokenizer):
    # char tokenizer, no BOS: "q:" = 2 tokens, then each step "ab" "cd" "ef" "gh" + "\n" = 3 tokens, so the steps'
    # separators sit at 4, 7, 10, 13; max_length=8 keeps steps 1 and 2 (prefixes of 5 and 8 tokens), and steps 3
    # and 4 get None, without a forward pass (before, they were scored on the cut 8-token prefix: step 2's score).
    # No prompt_separator, for these positions
    model = LlamaForSequenceClassification(_cfg(tokenizer, num_labels=1)).eval()
    rows_seen = []
    model.register_forward_hook(lambda m, args, kwargs, out: rows_seen.append(kwargs["input_ids"].shape),
                                with_kwargs=True)
    prm = PrefixClassificationPRM(model, tokenizer, max_length=8, prompt_separator="")
    with pytest.warns(RuntimeWarning, match=r"steps past max_length=8 tokens \(prompt \+ steps\) are unscored"):
        got = prm(prompts=["q:"], completions=[""], steps=[["ab", "cd", "ef", "gh"]])
    ids, pos = build_prm_input(tokenizer, "q:", ["ab", "cd", "ef", "gh"], "\n")
    assert pos == [4, 7, 10, 13]
    expected = [float(model(input_ids=torch.tensor([ids[:n]])).logits[0, 0]) for n in (5, 8)]
    assert got[0][:2] == pytest.approx(expected, abs=1e-5) and got[0][2:] == [None, None]
    assert rows_seen[0] == (2, 8)  # one batch: the two prefixes that fit (5 and 8 tokens, padded to 8)


def test_positive_label_is_checked_for_every_classifier(tokenizer):
    two = LlamaForSequenceClassification(_cfg(tokenizer, num_labels=2))
    with pytest.raises(ConfigError, match=r"positive_label=2 but the PRM has 2 labels: give .* 0 to 1"):
        PrefixClassificationPRM(two, tokenizer, positive_label=2)
    with pytest.raises(ConfigError, match=r"positive_label=-1 but the PRM has 2 labels"):
        TokenClassificationPRM(LlamaForTokenClassification(_cfg(tokenizer, num_labels=2)), tokenizer, positive_label=-1)
    # one label: the score is logits[0], positive_label (default 1) is not read
    PrefixClassificationPRM(LlamaForSequenceClassification(_cfg(tokenizer, num_labels=1)), tokenizer)


def test_load_prm_from_folder_with_recorded_kind(tmp_path, tokenizer):
    model = LlamaForTokenClassification(_cfg(tokenizer, num_labels=2))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "groupwise_prm.json").write_text(json.dumps({"kind": "token_classification", "separator": "\n"}))
    prm = load_prm(str(tmp_path))
    assert isinstance(prm, TokenClassificationPRM) and prm.separator == "\n"
    # a file from before prompt_separator was recorded: trained with nothing between prompt and step 1, read so
    assert prm.prompt_separator == ""
    # a file from before max_length was recorded still loads; its inputs stop at the model's position limit
    assert prm.max_length == model.config.max_position_embeddings == 2048
    assert len(prm(prompts=["a"], completions=[""], steps=[["b", "c"]])[0]) == 2
    with pytest.raises(ValueError, match="PRM kind"):
        load_prm(str(tmp_path), kind="value_head")
    # another kind would get this kind's recorded options (StepTagPRM: TypeError on positive_label)
    with pytest.raises(ValueError, match=r"trained by `groupwise prm train` as a token_classification PRM .*kind="
                                         r"'step_tag' cannot read it"):
        load_prm(str(tmp_path), kind="step_tag")


def _gpt2_token_classifier(tokenizer, n_positions):
    from transformers import GPT2Config, GPT2ForTokenClassification

    torch.manual_seed(0)
    return GPT2ForTokenClassification(GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=16, n_layer=1, n_head=2, num_labels=2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()


def test_a_prm_without_max_length_stops_at_its_position_limit(tokenizer):
    # GPT-2 (absolute positions) with 16 of them. Char tokenizer, no BOS: "q: 1+1" = 6 tokens, then "1+1=2" + "\n"
    # = 6 (separator at 11), "so the answer" + "\n" = 14 (separator at 25), "ok" + "\n" (28): 29 tokens. Without a
    # max_length the whole input went in and position 16 indexed past the table (IndexError on CPU, a device-side
    # assert on GPU); now the input stops at 16 tokens, step 1 is scored on them and steps 2–3 are unscored (None).
    # No prompt_separator, for these positions
    model = _gpt2_token_classifier(tokenizer, 16)
    prm = TokenClassificationPRM(model, tokenizer, prompt_separator="")
    assert prm.max_length == 16
    steps = ["1+1=2", "so the answer", "ok"]
    ids, pos = build_prm_input(tokenizer, "q: 1+1", steps, "\n")
    assert pos == [11, 25, 28] and len(ids) == 29
    with pytest.warns(RuntimeWarning, match=r"steps past max_length=16 tokens \(prompt \+ steps\) are unscored"):
        got = prm(prompts=["q: 1+1", "q: 1+1"], completions=["", ""], steps=[steps, steps[:1]])
    expected = float(torch.softmax(model(input_ids=torch.tensor([ids[:16]])).logits[0, 11], -1)[1])
    assert got[0][0] == pytest.approx(expected, abs=1e-5) and got[0][1:] == [None, None]
    assert got[1] == pytest.approx([expected], abs=1e-5)
    assert TokenClassificationPRM(model, tokenizer, max_length=12).max_length == 12  # a given max_length wins


def test_the_position_limit_is_also_the_tokenizers(tokenizer):
    """RoBERTa-like models declare max_position_embeddings = 514 but number positions from padding_idx + 1 = 2, so
    only 512 tokens fit: a tiny RoBERTa with 18 declared positions takes 16 tokens; 18 index past its table. Their
    tokenizers say 512 (here 16): the smaller limit is the one taken."""
    import copy

    from transformers import RobertaConfig, RobertaForTokenClassification

    torch.manual_seed(0)
    model = RobertaForTokenClassification(RobertaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=18, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=2, pad_token_id=1)).eval()
    model(input_ids=torch.full((1, 16), 5))  # 16 tokens fit
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        model(input_ids=torch.full((1, 17), 5))  # position 18 of a table of 18
    tok = copy.deepcopy(tokenizer)
    tok.model_max_length = 16
    prm = TokenClassificationPRM(model, tok)
    assert prm.max_length == 16
    with pytest.warns(RuntimeWarning, match="steps past max_length=16"):
        assert prm(prompts=["q: 1+1"], completions=[""], steps=[["1+1=2", "so the answer", "ok"]])[0][1:] == [None, None]


def test_load_prm_in_another_dtype(tmp_path, tokenizer):
    model = LlamaForTokenClassification(_cfg(tokenizer, num_labels=2))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prm = load_prm(str(tmp_path), kind="token_classification", dtype="bfloat16")  # was: TypeError from the PRM
    assert prm.model.dtype == torch.bfloat16
    [row] = prm(prompts=["a"], completions=[""], steps=[["b", "c"]])
    assert len(row) == 2 and all(isinstance(v, float) and 0 < v < 1 for v in row)
    assert load_prm(str(tmp_path), kind="token_classification").model.dtype == torch.float32
    with pytest.raises(ConfigError, match="dtype='bf17' is not a torch dtype"):
        load_prm(str(tmp_path), kind="token_classification", dtype="bf17")


def test_a_one_label_token_classifier_scores_its_logit(tokenizer):
    # a softmax over one label is 1.0 whatever the model says: every step scored 1, no signal. With one label the
    # score is the logit at the judged position, as PrefixClassificationPRM reads a one-label head
    model = LlamaForTokenClassification(_cfg(tokenizer, num_labels=1)).eval()
    got = TokenClassificationPRM(model, tokenizer)(prompts=PROMPTS, completions=["", ""], steps=STEPS)
    for p, s, row in zip(PROMPTS, STEPS, got, strict=True):
        ids, pos = build_prm_input(tokenizer, p, s, "\n", prompt_separator="\n")
        logits = model(input_ids=torch.tensor([ids])).logits[0, :, 0]
        assert row == pytest.approx([float(logits[i]) for i in pos], abs=1e-5)
    assert len({round(v, 6) for row in got for v in row}) > 1


def _llama_like_and_byte_level():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Step 1: x = 1 + 2.\n\nStep 2: y = 3.\nSo z = 4.\n"] * 50
    llama = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))  # SentencePiece-like: Metaspace '▁'
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    llama.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<eos>"] +
                                                          [f"<0x{i:02X}>" for i in range(256)]))
    byte = Tokenizer(models.BPE())
    byte.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte.decoder = decoders.ByteLevel()
    byte.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return [PreTrainedTokenizerFast(tokenizer_object=llama, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"),
            PreTrainedTokenizerFast(tokenizer_object=byte, eos_token="<eos>", pad_token="<eos>")]


@pytest.mark.parametrize("which", [0, 1], ids=["metaspace", "byte_level"])
def test_prm_input_is_the_joint_tokenization_of_the_text(which):
    # a PRM is trained on "prompt + step 1 + sep + step 2 + sep" tokenized at once (Math-Shepherd); tokenizing the
    # pieces apart gave every step a leading '▁' (Metaspace) and broke merges across steps (byte-level "3.\n")
    tok = _llama_like_and_byte_level()[which]
    prompt, steps, sep = "Q: x = 1 + 2.", ["Step 1: x = 3.", "Step 2: So z = 4."], "\n"
    text = prompt + "".join(s + sep for s in steps)
    enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, pos = build_prm_input(tok, prompt, steps, sep)
    assert ids == enc.input_ids
    ends = [len(prompt) + len(steps[0]) + 1, len(text)]  # where each separator ends
    assert pos == [next(i for i, (a, b) in enumerate(enc.offset_mapping) if a < e <= b) for e in ends]
    assert tok.decode(ids[:pos[0] + 1]).endswith("x = 3.\n") and pos[1] == len(ids) - 1
    cut_ids, cut_pos = build_prm_input(tok, prompt, steps, sep, max_length=pos[1])
    assert cut_ids == ids[:pos[1]] and cut_pos == pos[:1]  # the second step cut by max_length: unscored


def _trl_tokenize_row(tokenizer, prompt, steps, separator, max_length=None):
    """TRL's PRMTrainer.tokenize_row (TRL ≤ 1.x, before the trainer was removed), as a plain loop: the prompt and
    each step tokenized apart without special tokens, the separator's ids after each step, the step's label on its
    last token, the BOS first when the tokenizer has one, then input_ids[:max_length]. Returns the ids and the
    labelled positions."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    separator_ids = tokenizer.encode(separator, add_special_tokens=False)
    completion_ids, labels = [], []
    for step in steps:
        piece = tokenizer(step, add_special_tokens=False)["input_ids"] + separator_ids
        completion_ids += piece
        labels += [-100] * (len(piece) - 1) + [1]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    input_ids, labels = prompt_ids + completion_ids, [-100] * len(prompt_ids) + labels
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return input_ids, [i for i, label in enumerate(labels) if label != -100]


@pytest.mark.parametrize("which", [0, 1], ids=["metaspace", "byte_level"])
@pytest.mark.parametrize("bos", [None, "<eos>"])
def test_per_step_tokenization_is_trls_prm_trainer_layout(which, bos):
    """A PRM trained by TRL's PRMTrainer saw the prompt and each step tokenized apart: tokenization='per_step' gives
    exactly its input ids and judges each step where its label was. With the Metaspace tokenizer that differs from
    the joint tokenization (each step then starts with '▁'), which is why the option exists."""
    tok = _llama_like_and_byte_level()[which]
    if bos is not None:
        tok.bos_token = bos
    prompt, steps, sep = "Q: x = 1 + 2.", ["Step 1: x = 3.", "Step 2: So z = 4."], "\n"
    ids, pos = build_prm_input_per_step(tok, prompt, steps, sep)
    assert (ids, pos) == _trl_tokenize_row(tok, prompt, steps, sep)
    assert (ids[0] == tok.bos_token_id) == (bos is not None)
    cut = _trl_tokenize_row(tok, prompt, steps, sep, max_length=pos[1])
    assert build_prm_input_per_step(tok, prompt, steps, sep, max_length=pos[1]) == cut and cut[1] == pos[:1]
    if which == 0:  # the joint reading of the same text, which the PRM never saw
        assert build_prm_input(tok, prompt, steps, sep, prompt_separator="")[0] != ids


def test_a_per_step_prm_scores_trls_input_at_trls_labels():
    tok = _llama_like_and_byte_level()[0]
    model = LlamaForTokenClassification(_cfg(tok, num_labels=2)).eval()
    prm = TokenClassificationPRM(model, tok, tokenization="per_step", batch_size=2)
    assert prm.prompt_separator == ""  # TRL: the prompt's ids, then step 1's
    prompts, steps = ["Q: x = 1 + 2.", "Q: y = 3."], [["Step 1: x = 3.", "So z = 4."], ["y = 3."]]
    got = prm(prompts=prompts, completions=["", ""], steps=steps)
    for p, s, row in zip(prompts, steps, got, strict=True):
        ids, pos = _trl_tokenize_row(tok, p, s, "\n")
        probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)[:, 1]
        assert row == pytest.approx([float(probs[i]) for i in pos], abs=1e-5)
    # a step tag inside the separator is judged at the tag's token, as in the joint reading
    tok = _llama_like_and_byte_level()[1]  # '+' and '-' are single tokens of the byte-level one
    tok.add_tokens(["ки"])
    tag = StepTagPRM(LlamaForCausalLM(_cfg(tok)).eval(), tok, tokenization="per_step")
    ids, pos = tag._build(["Q: 1"], [["a = 1.", "so 1."]], tag.judge_char)[0]
    assert [tok.convert_ids_to_tokens(ids[i]) for i in pos] == ["ки", "ки"]


def test_per_step_tokenization_is_checked(tmp_path, tokenizer):
    model = LlamaForTokenClassification(_cfg(tokenizer, num_labels=2))
    with pytest.raises(ConfigError, match=r"tokenization='apart' is not one of \['joint', 'per_step'\]"):
        TokenClassificationPRM(model, tokenizer, tokenization="apart")
    with pytest.raises(ConfigError, match="tokenization='per_step' reads plain text.*chat_template=True"):
        TokenClassificationPRM(model, tokenizer, tokenization="per_step", chat_template=True)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "groupwise_prm.json").write_text(json.dumps({"kind": "token_classification", "separator": "\n"}))
    with pytest.raises(ConfigError, match="trained by `groupwise prm train` on text tokenized at once"):
        load_prm(str(tmp_path), tokenization="per_step")


def test_a_slow_tokenizer_is_refused_with_the_fix(tokenizer):
    class Slow:
        is_fast = False

        def __call__(self, text, **kw):
            return tokenizer(text, **kw)

    with pytest.raises(ValueError, match="slow tokenizer.*use_fast=True"):
        build_prm_input(Slow(), "q", ["a"], "\n")


def test_prefix_classification_is_batch_size_independent_when_the_config_pads_with_another_id():
    # HF pools at the last token that is not config.pad_token_id; rows were padded with the tokenizer's pad (here
    # eos, 0) while the config said 5, so padded rows pooled on padding: batch_size 8 differed from batch_size 1
    from groupwise.tasks import toy

    tok = toy.build_tokenizer(pad_is_eos=True)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=2, pad_token_id=5)).eval()
    assert tok.pad_token_id != 5
    prm = PrefixClassificationPRM(model, tok, batch_size=1)
    steps = [["1+1=2", "so 2"], ["2+3=5", "5", "done"], ["7"]]
    one = prm(prompts=["q: 1+1", "q: 2+3", "q: 7"], completions=[""] * 3, steps=steps)
    prm.batch_size = 8
    eight = prm(prompts=["q: 1+1", "q: 2+3", "q: 7"], completions=[""] * 3, steps=steps)
    assert [v for r in eight for v in r] == pytest.approx([v for r in one for v in r], abs=1e-6)


def test_load_prm_defaults_to_float32_for_a_bf16_saved_prm(tmp_path, tokenizer):
    # the docstring's default: a PRM saved in bfloat16 loaded as bfloat16 when dtype was not given
    LlamaForTokenClassification(_cfg(tokenizer, num_labels=2)).to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert load_prm(str(tmp_path), kind="token_classification").model.dtype == torch.float32
    assert load_prm(str(tmp_path), kind="token_classification", dtype="auto").model.dtype == torch.bfloat16
    assert load_prm(str(tmp_path), kind="token_classification", dtype="bfloat16").model.dtype == torch.bfloat16


@pytest.mark.parametrize("batch_size", [1, 8])
def test_prefix_classification_judges_the_separator_even_when_it_is_the_pad_token(batch_size):
    # HF pools at the rightmost token that is not config.pad_token_id; here that id is "\n", the separator every
    # prefix ends with, so HF alone would pool on the step's last character instead of its separator
    from groupwise.tasks import toy

    tok = toy.build_tokenizer()
    newline = tok.convert_tokens_to_ids("\n")
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=newline)).eval()
    prm = PrefixClassificationPRM(model, tok, batch_size=batch_size)
    got = prm(prompts=PROMPTS, completions=["", ""], steps=STEPS)
    for p, s, row in zip(PROMPTS, STEPS, got, strict=True):
        expected = []
        for j in range(len(s)):
            ids, pos = build_prm_input(tok, p, s[:j + 1], "\n", prompt_separator="\n")
            assert ids[pos[-1]] == newline  # the judged token is the pad id
            with torch.no_grad():  # the score head at the judged (last) position, by hand
                hidden = model.model(input_ids=torch.tensor([ids[:pos[-1] + 1]])).last_hidden_state
                expected.append(float(model.score(hidden)[0, -1, 0]))
        assert row == pytest.approx(expected, abs=1e-5)
    assert model.config.pad_token_id == newline  # restored after each forward


def test_a_checkpoint_without_the_kinds_head_is_refused_not_scored_at_random(tmp_path):
    """A causal LM's folder loaded as a token_classification (or prefix_classification) PRM loaded without an error
    and scored with a freshly initialised head: two loads of one folder gave different scores. Refused, naming the
    missing weights."""
    from groupwise.config_base import ConfigError
    from groupwise.rewards.prm import load_prm

    tok = toy.build_tokenizer()
    toy.build_model(tok, seed=0, hidden_size=32).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    for kind in ("token_classification", "prefix_classification"):
        with pytest.raises(ConfigError, match=rf"its checkpoint has no weights for (score\.bias, )?score\.weight, which a {kind}"):
            load_prm(str(tmp_path / "lm"), kind)
    load_prm(str(tmp_path / "lm"), "step_tag", step_tag="a", good_token="b", bad_token="c")  # its own head


def test_a_max_length_past_the_models_positions_is_named():
    """max_length=4096 on a 32-position model was taken as is, and the first long input failed in the forward with
    a tensor-size RuntimeError (a device-side assert on GPU)."""
    from transformers import AutoModelForTokenClassification

    tok = toy.build_tokenizer()
    model = AutoModelForTokenClassification.from_config(toy.build_model(tok, hidden_size=32, max_positions=32).config)
    with pytest.raises(ConfigError, match=r"PRM max_length=4096 is more than the 32 positions the model takes"):
        TokenClassificationPRM(model, tok, max_length=4096)
    assert TokenClassificationPRM(model, tok).max_length == 32 and TokenClassificationPRM(model, tok, max_length=16).max_length == 16
