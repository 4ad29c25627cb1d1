"""Audit of `groupwise prm train` (prm_train.py): train/score consistency, dtype, schedule, split, metrics, data
errors, output_dir. Tiny in-process Llama + the character-level toy tokenizer (one token per character)."""

import json
import warnings

import pytest
import torch

from groupwise.config import ConfigError
from groupwise.prm_train import PRMTrainConfig, _encode, evaluate_prm, read_step_jsonl, split_by_prompt, train_prm
from groupwise.rewards.prm import load_prm


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(n):
    """Deterministic rows: a step is bad (0) exactly when it contains 'x'."""
    pool = ["abc", "xbc", "cab", "axa", "bca", "ccx"]
    return [{"prompt": "q:", "steps": [pool[i % 6], pool[(i + 1) % 6]],
             "labels": [int("x" not in pool[i % 6]), int("x" not in pool[(i + 1) % 6])]} for i in range(n)]


def _log(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_bfloat16_base_is_trained_in_float32(tmp_path, tokenizer):
    # from_pretrained keeps the saved dtype in transformers 5 (dtype="auto"): a bf16 base (most hub LMs) was trained
    # in pure bf16, where AdamW's first step (each weight moves by about lr = 1e-5) is below half a bf16 ulp for a
    # weight of size 0.02 (ulp 2^-13 ≈ 1.2e-4) and rounds away; and the trainer evaluated in bf16 while load_prm
    # scores in float32. Now the weights are float32: every q_proj weight moves, and the saved file is float32.
    from safetensors.torch import load_file

    from groupwise.tasks import toy

    base = tmp_path / "bf16"
    toy.build_model(tokenizer, seed=0, hidden_size=32).to(torch.bfloat16).save_pretrained(base)
    tokenizer.save_pretrained(base)
    rows = _rows(2)
    train_prm(PRMTrainConfig(model_name_or_path=str(base), train_file=_write(tmp_path / "t.jsonl", rows),
                             eval_file=_write(tmp_path / "e.jsonl", rows), output_dir=str(tmp_path / "prm"),
                             learning_rate=1e-5, lr_scheduler_type="constant", max_grad_norm=0.0,
                             per_device_train_batch_size=2))
    saved = load_file(str(tmp_path / "prm" / "model.safetensors"))
    start = load_file(str(base / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert saved[key].dtype == torch.float32 and saved["score.weight"].dtype == torch.float32
    moved = (saved[key] - start[key].float()).abs()
    assert (moved > 0).float().mean() > 0.9 and moved.max() < 2e-5  # Adam: |Δ| ≈ lr wherever the gradient ≠ 0


def test_a_causal_lm_base_says_it_gets_a_new_head(tmp_path, model_dir, capsys):
    rows = _rows(4)
    cfg = dict(train_file=_write(tmp_path / "t.jsonl", rows), eval_file=_write(tmp_path / "e.jsonl", rows),
               per_device_train_batch_size=4)
    train_prm(PRMTrainConfig(model_name_or_path=model_dir, output_dir=str(tmp_path / "prm"), **cfg))
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "new 2-label token-classification head" in out and "score.weight" in out
    # a trained PRM as the base keeps its head: no such line
    train_prm(PRMTrainConfig(model_name_or_path=str(tmp_path / "prm"), output_dir=str(tmp_path / "prm2"), **cfg))
    assert "new 2-label" not in capsys.readouterr().out
    # an outcome reward model (a 1-label sequence classifier) as the base: its backbone, a new head (was:
    # transformers' "ignore_mismatched_sizes" RuntimeError after loading)
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    orm = tmp_path / "orm"
    LlamaForSequenceClassification(AutoConfig.from_pretrained(model_dir, num_labels=1)).save_pretrained(orm)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(orm)
    train_prm(PRMTrainConfig(model_name_or_path=str(orm), output_dir=str(tmp_path / "prm3"), **cfg))
    out = capsys.readouterr().out
    assert "LlamaForSequenceClassification): a new 2-label token-classification head (score.bias" in out or \
        "LlamaForSequenceClassification): a new 2-label token-classification head (score.weight" in out


def test_the_schedule_counts_only_updates(tmp_path, model_dir):
    # [short, long] × 3, batch 1, 2 epochs: the long rows' only step is past max_length=12, so 3 rows × 2 epochs = 6
    # updates. The linear schedule used to count 12 batches, so its rate ended at 1e-3 × 7/12 instead of decaying
    # over the 6 updates that happen: 1e-3 × (6 − k)/6 for k = 0..5 → 1e-3 × [1, 5/6, 4/6, 3/6, 2/6, 1/6]
    short = {"prompt": "q:", "steps": ["abc", "xbc"], "labels": [1, 0]}
    long_ = {"prompt": "q" * 20, "steps": ["abc"], "labels": [1]}
    metrics = train_prm(PRMTrainConfig(
        model_name_or_path=model_dir, output_dir=str(tmp_path / "prm"), max_length=12, learning_rate=1e-3,
        per_device_train_batch_size=1, num_train_epochs=2, logging_steps=1,
        train_file=_write(tmp_path / "t.jsonl", [short, long_] * 3), eval_file=_write(tmp_path / "e.jsonl", [short])))
    log = _log(tmp_path / "prm" / "train_log.jsonl")
    assert [x["learning_rate"] for x in log] == pytest.approx([1e-3 * k / 6 for k in (6, 5, 4, 3, 2, 1)])
    assert metrics["train/steps"] == 6.0 and metrics["train/examples"] == 6.0
    assert metrics["train/examples_without_steps"] == 3.0


def test_labels_sit_where_scoring_reads_and_round_trip(tmp_path, model_dir):
    # a three-token separator " .\n" (one token per character), and max_length 14 that cuts the last step:
    # "q:" (tokens 0-1) + the prompt_separator "\n" (2) + "ab .\n" (3-7) + "xb .\n" (8-12) + "ca .\n" (13-17): steps are
    # judged at the separator's last token, 7, 12 and 17; 17 ≥ 14, so the third step has neither a label nor a score
    rows = [{"prompt": "q:", "steps": ["ab", "xb", "ca"], "labels": [1, 0, 1]}]
    cfg = PRMTrainConfig(model_name_or_path=model_dir, train_file="unused", separator=" .\n", max_length=14)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    [(ids, labels)] = _encode(rows, tok, cfg, 14)
    assert len(ids) == 14 and {i: y for i, y in enumerate(labels) if y != -100} == {7: 1, 12: 0}

    data = [{"prompt": "q:", "steps": [a, b, c], "labels": [int("x" not in s) for s in (a, b, c)]}
            for a, b, c in (("ab", "xb", "ca"), ("xa", "cb", "ax"), ("bb", "ca", "xc"), ("ac", "bx", "cc"))]
    train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=_write(tmp_path / "t.jsonl", data * 4),
                             eval_file=_write(tmp_path / "e.jsonl", data), output_dir=str(tmp_path / "prm"),
                             separator=" .\n", max_length=14, learning_rate=3e-3, num_train_epochs=2))
    metrics = json.loads((tmp_path / "prm" / "eval_metrics.json").read_text())
    prm = load_prm(str(tmp_path / "prm"))
    assert prm.separator == " .\n" and prm.max_length == 14 and prm.model.dtype == torch.float32
    assert prm.prompt_separator == "\n"  # recorded by training, so scoring builds the inputs training saw
    with pytest.warns(RuntimeWarning, match="steps past max_length=14 tokens"):
        scores = prm(prompts=[r["prompt"] for r in data], completions=[""] * 4, steps=[r["steps"] for r in data])
    assert all(row[2] is None and None not in row[:2] for row in scores)  # the cut step, unscored
    # the trainer's held-out numbers, recomputed from what load_prm scores: 4 rows × the 2 steps that fit
    pairs = [(s, g) for row, r in zip(scores, data) for s, g in zip(row, r["labels"]) if s is not None]
    assert metrics["eval/steps"] == len(pairs) == 8
    assert metrics["eval/accuracy"] == pytest.approx(sum((s > 0.5) == bool(g) for s, g in pairs) / 8)
    # and per step: P(good) at the labelled tokens of the saved model = load_prm's score
    enc = _encode(data, prm.tokenizer, cfg, 14)
    with torch.no_grad():
        logits = prm.model(input_ids=torch.tensor([e[0] for e in enc])).logits  # all 14 tokens long: no padding
    direct = [torch.softmax(logits[i, p], -1)[1].item() for i, (_, y) in enumerate(enc) for p in range(14)
              if y[p] != -100]
    assert direct == pytest.approx([s for s, _ in pairs], abs=1e-6)


class _Fixed(torch.nn.Module):
    """Logits favouring label `pred[i][t]` at row i, token t (the eval's argmax)."""

    def __init__(self, pred):
        super().__init__()
        self.pred = torch.tensor(pred)
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.device = self.w.device  # as a transformers model's

    def forward(self, input_ids, attention_mask):
        from types import SimpleNamespace

        p = self.pred[:, :input_ids.size(1)]
        return SimpleNamespace(logits=torch.stack([1.0 - p, p.float()], -1))


def test_metrics_by_hand():
    # gold (labelled tokens only) 1 1 0 0 1 0 | predictions 1 0 0 1 1 0
    # accuracy 4/6; good: tp 2 (t0, t4), fp 1 (t3), fn 1 (t1) → P = R = F1 = 2/3;
    # bad: tp 2 (t2, t5), fp 1 (t1), fn 1 (t3) → P = R = F1 = 2/3
    enc = [([5, 6, 7, 8], [-100, 1, 1, 0]), ([5, 6, 7, 8], [0, 1, -100, 0])]
    model = _Fixed([[0, 1, 0, 0], [1, 1, 1, 0]])
    m = evaluate_prm(model, enc, pad_id=0)
    assert m["eval/steps"] == 6 and m["eval/accuracy"] == pytest.approx(4 / 6)
    for k in ("good_precision", "good_recall", "good_f1", "bad_precision", "bad_recall", "bad_f1"):
        assert m[f"eval/{k}"] == pytest.approx(2 / 3), k
    # no bad step anywhere, all predicted good: accuracy 1, good F1 1; bad P, R, F1 are 0/0 → 0 (sklearn's
    # zero_division=0)
    m = evaluate_prm(_Fixed([[1, 1, 1, 1]]), [([5, 6, 7, 8], [1, -100, 1, 1])], pad_id=0)
    assert m["eval/accuracy"] == 1 and m["eval/good_f1"] == 1
    assert (m["eval/bad_precision"], m["eval/bad_recall"], m["eval/bad_f1"]) == (0, 0, 0)


def test_the_held_out_split_is_seeded_and_disjoint(tmp_path, model_dir):
    # 5 rows, one prompt each, eval_fraction 0.1: round(0.5) = 0, at least 1 held out → 1 eval row (2 steps), 4
    # train rows; 3 rows with eval_fraction 0.9 would hold out round(2.7) = 3 = all of them: 2, one stays to train
    rows = [dict(r, prompt=f"q{i}:") for i, r in enumerate(_rows(5))]
    metrics = train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=_write(tmp_path / "t.jsonl", rows),
                                       output_dir=str(tmp_path / "prm"), per_device_train_batch_size=4))
    assert metrics["train/examples"] == 4.0 and metrics["eval/steps"] == 2.0 and metrics["train/steps"] == 1.0
    train, held = split_by_prompt(rows[:3], 0.9, 42, "t3.jsonl")
    assert (len(train), len(held)) == (1, 2)


def test_the_held_out_split_keeps_a_problems_solutions_together():
    """Math-Shepherd / PRM800K have several solutions per problem: a split by example held out solutions of problems
    the PRM trained on (its held-out accuracy then measured memorised problems). Prompts A×3 B×2 C D×2 E F G H I:
    14 rows, eval_fraction 0.3 → round(4.2) = 4 rows held out, whole prompts taken in the seeded order until 4."""
    prompts = ["A"] * 3 + ["B"] * 2 + ["C"] + ["D"] * 2 + list("EFGHI") + [[{"role": "user", "content": "A"}]]
    rows = [{"prompt": p, "steps": [f"s{i}"], "labels": [1]} for i, p in enumerate(prompts)]
    for seed in range(20):
        train, held = split_by_prompt(rows, 0.3, seed, "t.jsonl")
        assert sorted(r["steps"][0] for r in train + held) == sorted(r["steps"][0] for r in rows)  # a partition
        key = lambda r: json.dumps(r["prompt"])  # noqa: E731
        assert not {key(r) for r in train} & {key(r) for r in held}  # no prompt on both sides
        sizes = {}
        for r in held:
            sizes[key(r)] = sizes.get(key(r), 0) + 1
        # at least 4 held out, and no more prompts than needed: the last one taken brought it to 4 or more
        assert len(held) >= 4 and any(len(held) - n < 4 for n in sizes.values())
        assert split_by_prompt(rows, 0.3, seed, "t.jsonl") == (train, held)  # seeded
    assert len({json.dumps(split_by_prompt(rows, 0.3, s, "t.jsonl")[1]) for s in range(20)}) > 1


def test_one_prompt_for_all_examples_is_split_by_example_with_a_warning(tmp_path):
    rows = _rows(10)  # all "q:"
    with pytest.warns(UserWarning, match=r"t.jsonl: all 10 examples have one prompt.*give an eval_file"):
        train, held = split_by_prompt(rows, 0.2, 42, "t.jsonl")
    assert (len(train), len(held)) == (8, 2)


def test_an_eval_file_sharing_prompts_with_train_file_is_a_warning(tmp_path, model_dir):
    train = _write(tmp_path / "t.jsonl", [dict(r, prompt=f"q{i}:") for i, r in enumerate(_rows(4))])
    held = _write(tmp_path / "e.jsonl", [dict(r, prompt=f"q{i}:") for i, r in enumerate(_rows(2))])
    with pytest.warns(UserWarning, match=r"2 prompt\(s\) of eval_file .*e.jsonl are also in train_file"):
        train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=train, eval_file=held,
                                 output_dir=str(tmp_path / "prm"), per_device_train_batch_size=4))


def test_bad_prompts_and_bytes_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    ok = json.dumps({"prompt": "q", "steps": ["a"], "labels": [1]})
    # a null prompt passed the reader and failed after the model loaded, as a TypeError traceback with no line
    p.write_text(ok + "\n" + json.dumps({"prompt": None, "steps": ["a"], "labels": [1]}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: 'prompt' must be a string or a list of chat messages"):
        read_step_jsonl(str(p))
    # chat messages are a prompt (their contents are the text)
    p.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}], "steps": ["a"], "labels": [1]}) + "\n")
    assert read_step_jsonl(str(p))[0]["prompt"] == [{"role": "user", "content": "q"}]
    p.write_bytes(ok.encode() + b"\n" + b'{"prompt": "\xff", "steps": ["a"], "labels": [1]}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not UTF-8"):
        read_step_jsonl(str(p))
    p.write_text(json.dumps({"prompt": "q", "steps": ["a"], "labels": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:1: 'labels' must be a list of 0/1"):
        read_step_jsonl(str(p))
    # UTF-8 text (Math-Shepherd's step tag) reads whatever the locale
    p.write_bytes(json.dumps({"prompt": "q", "steps": ["a ки"], "labels": [1]}, ensure_ascii=False).encode() + b"\n")
    assert read_step_jsonl(str(p))[0]["steps"] == ["a ки"]


def test_empty_or_blank_steps_and_steps_judged_at_one_token_are_named(tmp_path):
    """A blank step (the policy's splitter drops those) or an empty step list was accepted: with a tokenizer that
    merges the separators, two steps were judged at one token and the later label overwrote the earlier one
    (labels [1, 0, 1] trained as [0, 1]); an empty list was counted as 'cut by max_length'."""
    from groupwise.prm_train import _encode

    p = tmp_path / "bad.jsonl"
    for steps, message in ((["a", "  ", "b"], r"bad.jsonl:1: step 1 is blank \('  '\)"),
                           ([], r"bad.jsonl:1: 'steps' is empty")):
        p.write_text(json.dumps({"prompt": "q", "steps": steps, "labels": [1] * len(steps)}) + "\n")
        with pytest.raises(ConfigError, match=message):
            read_step_jsonl(str(p))

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())  # byte-level BPE whose merges make "\n\n" one token
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["step one\n\nstep two\n\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    merging = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")
    cfg = PRMTrainConfig(model_name_or_path="unused", train_file="unused", output_dir=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"merges the separator '\\n' with the next step's text \(the token "
                                          r"'\\n\\n' judges step 0\)"):
        _encode([{"prompt": "q", "steps": ["a", "", ""], "labels": [1, 0, 1]}], merging, cfg)  # at [2, 2, 3]
    # the token judging a step holds the next steps' letters (this BPE merged 'a\nb\nc\n' whole): its label would
    # see them; the tokenizer above keeps each '\n' apart from letters, so 'a', 'b', 'c' are judged at their own '\n'
    letters = Tokenizer(models.BPE())
    letters.decoder = decoders.ByteLevel()
    letters.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    letters.train_from_iterator(["a\nb\nc\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    runs_on = PreTrainedTokenizerFast(tokenizer_object=letters, pad_token="<pad>")
    with pytest.raises(ConfigError, match=r"merges the separator '\\n' with the next step's text \(the token "
                                          r"'a\\nb\\nc\\n' judges step 0\).* Steps: \['a', 'b', 'c'\]"):
        _encode([{"prompt": "q", "steps": ["a", "b", "c"], "labels": [1, 0, 1]}], runs_on, cfg)
    ids, labels = _encode([{"prompt": "q", "steps": ["a", "b", "c"], "labels": [1, 0, 1]}], merging, cfg)[0]
    assert [merging.decode([ids[i]]) for i, y in enumerate(labels) if y != -100] == ["\n", "\n", "\n"]


def test_output_dir_must_not_be_the_base_model(tmp_path, model_dir):
    # the PRM (config, weights, tokenizer) would overwrite the base model in place
    rows = _write(tmp_path / "t.jsonl", _rows(4))
    with pytest.raises(ConfigError, match=r"output_dir .* is model_name_or_path"):
        train_prm(PRMTrainConfig(model_name_or_path=model_dir, train_file=rows, output_dir=model_dir))


def test_an_eval_split_without_steps_warns(tmp_path, model_dir):
    # every held-out step past max_length: accuracy 0/0 used to be reported as 0.000 → 0.000 silently
    short = {"prompt": "q:", "steps": ["abc"], "labels": [1]}
    long_ = {"prompt": "q" * 20, "steps": ["abc"], "labels": [1]}
    with pytest.warns(UserWarning, match=r"no step of the held-out examples fits in max_length=12"):
        m = train_prm(PRMTrainConfig(model_name_or_path=model_dir, output_dir=str(tmp_path / "prm"), max_length=12,
                                     train_file=_write(tmp_path / "t.jsonl", [short] * 2),
                                     eval_file=_write(tmp_path / "e.jsonl", [long_])))
    assert m["eval/steps"] == 0


def test_a_split_that_would_hold_out_nothing_or_too_much_is_said():
    # one example: nothing can be held out (it trained with an empty evaluation, accuracy 0); 99 solutions of one
    # problem + 1 of another, eval_fraction 0.1 (10 rows): whichever prompt is held out, the share is far off
    with pytest.raises(ConfigError, match=r"t.jsonl has 1 example\(s\): too few to hold out any"):
        split_by_prompt([{"prompt": "a", "steps": ["s"], "labels": [1]}], 0.1, 42, "t.jsonl")
    rows = [{"prompt": "big", "steps": [f"s{i}"], "labels": [1]} for i in range(99)]
    rows.append({"prompt": "small", "steps": ["t"], "labels": [1]})
    seeds = {}
    for seed in range(6):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train, held = split_by_prompt(rows, 0.1, seed, "t.jsonl")
        seeds[len(held)] = [str(w.message) for w in caught]
    assert set(seeds) == {1, 99}  # seeds 0 and 5 take the big prompt first, 1-4 the small one
    assert any("99 of 100 examples are held out (eval_fraction asks for 10)" in m for m in seeds[99])


def test_step_files_are_read_as_grpo_gives_steps_and_other_formats_are_named(tmp_path):
    """Steps are stripped of the whitespace around them, as GRPO's splitter hands a PRM the policy's steps (a step
    ' x = 1 ' was judged at ' \\n' in training but at '\\n' in GRPO); a line with both 'steps' and TRL's
    'completions' is refused (prm train used 'steps' silently); a parquet file (TRL's hub format) is named as not
    JSONL, with the conversion (it read 'not UTF-8 … save the file as UTF-8')."""
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"prompt": "q", "steps": [" x = 1 ", "\ty = 2\n"], "labels": [1, 0]}) + "\n")
    assert read_step_jsonl(str(p))[0]["steps"] == ["x = 1", "y = 2"]
    p.write_text(json.dumps({"prompt": "q", "steps": ["a"], "completions": ["a"], "labels": [1]}) + "\n")
    with pytest.raises(ConfigError, match=r"s.jsonl:1: both 'steps' and 'completions' \(TRL's name for them\): keep one"):
        read_step_jsonl(str(p))
    parquet = tmp_path / "steps.parquet"
    parquet.write_bytes(b"PAR1\x15\x04\x15\xff")
    with pytest.raises(ConfigError, match=r"steps.parquet is not a JSONL file: .* Dataset.to_json\(path\)"):
        read_step_jsonl(str(parquet))


def test_trl_prm_config_fields_groupwise_does_not_take_are_named(tmp_path, capsys):
    """TRL's PRMConfig fields: train_on_last_step_only was 'unknown field', max_prompt_length 'did you mean
    max_length?' (another meaning: TRL cuts the prompt from the left and keeps the steps). Now each is named as not
    supported, with what to do; TRL's default for train_on_last_step_only (False) is accepted."""
    from groupwise.cli import main

    for field, value, reason in (("train_on_last_step_only", True, "every step's label trains: drop the field"),
                                 ("max_prompt_length", 512, "prm train cuts the text .* at max_length from the right"),
                                 ("max_completion_length", 256, "prm train cuts the text .* at max_length from the right")):
        with pytest.raises(ConfigError, match=rf"^PRMTrainConfig: TRL field {field}={value} is not supported by "
                                              rf"groupwise: {reason}.*\(docs/trl_compat.md\)$"):
            PRMTrainConfig(model_name_or_path="m", train_file="f", **{field: value})
    PRMTrainConfig(model_name_or_path="m", train_file="f", train_on_last_step_only=False)
    assert main(["prm", "train", "--model_name_or_path", "m", "--train_file", "f", "--max_prompt_length", "64"]) == 2
    assert "TRL field max_prompt_length=64 is not supported" in capsys.readouterr().err
