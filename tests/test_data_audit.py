"""Dataset formats a TRL user passes, and what happens at their edges: a dict of columns, rows with other columns,
a generator read twice, a shuffled stream (TRL shuffles an IterableDataset with its seed), signal handlers."""

from __future__ import annotations

import copy
import signal

import datasets
import pytest

from groupwise import ConfigError, GRPOTrainer
from groupwise.data import PromptData, StreamData
from groupwise.order import PromptSampler
from groupwise.tasks import toy
from tests.conftest import small_args


def test_a_dict_of_columns_is_read_as_its_rows(tmp_path, tokenizer):
    """{'prompt': [...], 'letter': [...]} (what Dataset.from_dict takes) used to be a TypeError."""
    rows = toy.dataset(8)
    columns = {"prompt": [r["prompt"] for r in rows], "letter": [r["letter"] for r in rows]}
    data = PromptData(columns, "train_dataset")
    assert len(data) == 8 and data.columns() == ["prompt", "letter"] and data[3] == rows[3]
    seen = []

    def reward(completions, letter, **_):
        seen.extend(letter)
        return toy.letter_reward(completions, letter)

    GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [reward], args=small_args(tmp_path, max_steps=1),
                train_dataset=columns, processing_class=tokenizer).train()
    assert seen and set(seen) <= set(columns["letter"])


def test_prompts_in_two_formats_are_named_before_the_model_loads():
    """Completions take the first prompt's format: rows mixing strings and chat messages gave a reward function
    chat prompts with text completions. Refused naming the first row that differs (a stream: when read)."""
    chat = [{"role": "user", "content": "repeat b:"}]
    with pytest.raises(ConfigError, match=r"train_dataset row 2 has a list of chat messages as its prompt, row 0 a "
                                          r"string: give every prompt in one format"):
        PromptData([{"prompt": "repeat a:"}, {"prompt": "x"}, {"prompt": chat}], "train_dataset")
    stream = StreamData(iter([{"prompt": chat}, {"prompt": "repeat a:"}]), "train_dataset")
    assert stream[0]["prompt"] == chat
    with pytest.raises(ConfigError, match=r"train_dataset row 1 has a string as its prompt, row 0 a list of chat"):
        stream[1]


def test_a_reward_function_editing_its_prompts_in_place_changes_neither_the_data_nor_the_other_rows(tmp_path):
    """Every row read is a copy of its own, as TRL's DataLoader hands out: a reward function that extends each
    conversation in place (building a judge's prompt) used to edit the dataset's own lists, shared by the G rows of
    a group: the next row saw 1 + 1 + 1 messages, the dataset row grew, and round 2 sampled from the edited prompts.
    2 prompts × G 2, 2 rounds: every call sees 1 message per prompt."""
    tok = toy.build_chat_tokenizer()
    data = [{"prompt": [{"role": "user", "content": "repeat a:"}]}, {"prompt": [{"role": "user", "content": "repeat b:"}]}]
    seen = []

    def judge(prompts, completions, **_):
        seen.append([len(p) for p in prompts])
        for p, c in zip(prompts, completions):
            p.extend(c)
        return [0.0] * len(prompts)

    GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), judge, processing_class=tok, train_dataset=data,
                args=small_args(tmp_path, num_generations=2, per_device_train_batch_size=4, max_steps=2)).train()
    assert seen == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert [len(r["prompt"]) for r in data] == [1, 1]
    stream = StreamData(iter(copy.deepcopy(data)), "train_dataset")
    stream[0]["prompt"].append({"role": "user", "content": "x"})
    assert len(stream[0]["prompt"]) == 1
    import threading  # a value that cannot be copied (a lock, a client) is shared as given

    lock = threading.Lock()
    assert PromptData([{"prompt": "a", "client": lock}], "train_dataset")[0]["client"] is lock


@pytest.mark.parametrize("columns, message", [
    ({"prompt": ["a", "b"], "x": [1]}, r"train_dataset: its columns have different lengths \({'prompt': 2, 'x': 1}\)"),
    ({"prompt": "a"}, r"train_dataset is a dict, read as columns, but column 'prompt' is a str, not a list"),
])
def test_a_dict_whose_columns_do_not_line_up_is_named(columns, message):
    with pytest.raises(ConfigError, match=message):
        PromptData(columns, "train_dataset")


def test_a_data_frame_names_the_conversion():
    import pandas as pd

    with pytest.raises(TypeError, match=r"got DataFrame: pass datasets.Dataset.from_pandas\(frame\)"):
        PromptData(pd.DataFrame({"prompt": ["a"]}), "train_dataset")


def test_rows_with_other_columns_are_refused_before_the_model_loads(tmp_path, tokenizer, monkeypatch):
    """A list of dicts whose row 2 lacks the reward's column used to fail mid-training with KeyError('letter') (or
    silently pass the column to no reward, when row 0 lacked it)."""
    rows = toy.dataset(8)
    del rows[2]["letter"]
    import groupwise.trainer

    monkeypatch.setattr(groupwise.trainer, "load_policy", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=r"train_dataset row 2 lacks the column 'letter', unlike row 0 \(columns: "
                                          r"\['letter', 'prompt'\]\): give every row the same columns"):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward],
                    args=small_args(tmp_path), train_dataset=rows, processing_class=tokenizer)
    rows = toy.dataset(4)
    rows[3]["extra"] = 1
    with pytest.raises(ConfigError, match=r"train_dataset row 3 has the column 'extra', unlike row 0"):
        PromptData(rows, "train_dataset")


def test_a_stream_row_with_other_columns_is_named():
    stream = StreamData(iter([{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}, {"prompt": "c"}]), "train_dataset")
    assert stream[1]["x"] == 2
    with pytest.raises(ConfigError, match=r"train_dataset row 2 lacks the column 'x', unlike row 0"):
        stream[2]


def test_a_generator_that_cannot_be_read_again_is_named_at_its_end():
    """A generator is read once: at the end of its first pass the run used to stop on a bare StopIteration."""
    stream = StreamData((dict(prompt=f"p{i}") for i in range(3)), "train_dataset")
    assert [stream[i]["prompt"] for i in range(3)] == ["p0", "p1", "p2"]
    with pytest.raises(ConfigError, match=r"train_dataset ended after 3 rows and gives none when read again \(a "
                                          r"generator or iterator is read only once\): pass a datasets.Iterable"):
        stream[3]


def test_a_shuffled_stream_is_read_as_trl_shuffles_it_and_replays_on_resume():
    """TRL's get_train_dataloader: `dataset.shuffle(seed=args.seed)` for an IterableDataset when shuffle_dataset;
    reshuffled each epoch (set_epoch). A resume replays the same order (seek)."""
    rows = [{"prompt": f"p{i}", "i": i} for i in range(20)]

    def stream():
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    expected = [r["i"] for r in stream().shuffle(seed=7)]
    data = StreamData(stream(), "train_dataset", shuffle_seed=7)
    first = [data[i]["i"] for i in range(20)]
    assert first == expected and first != list(range(20))
    second = [data[i]["i"] for i in range(20, 40)]
    assert sorted(second) == list(range(20)) and second != first  # epoch 2: reshuffled
    resumed = StreamData(stream(), "train_dataset", shuffle_seed=7)
    resumed.seek(25)
    assert [resumed[i]["i"] for i in range(25, 40)] == second[5:]
    assert [StreamData(stream(), "train_dataset")[i]["i"] for i in range(3)] == [0, 1, 2]  # None: in order


def test_the_sampler_resumes_mid_epoch_exactly_and_visits_every_prompt_once_per_epoch():
    a = PromptSampler(10, 4, shuffle=True, seed=3)
    rounds = [a.next_round() for _ in range(5)]  # 20 indices: epochs 0 and 1 exactly
    assert sorted(sum(rounds, [])[:10]) == list(range(10)) and sorted(sum(rounds, [])[10:]) == list(range(10))
    b = PromptSampler(10, 4, shuffle=True, seed=3)
    for _ in range(2):
        b.next_round()
    c = PromptSampler(10, 4, shuffle=True, seed=3)
    c.load_state_dict(b.state_dict())  # mid-epoch (position 8 of epoch 0)
    assert [c.next_round() for _ in range(3)] == rounds[2:]


def test_signal_handlers_installed_outside_python_are_not_put_back_as_none(monkeypatch):
    """signal.signal returns None for a handler installed outside Python; restoring None raised TypeError at the end
    of every train()."""
    from groupwise.signals import stop_on_signals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    real, calls = signal.signal, []

    def installed_in_c(signum, handler):
        previous = real(signum, handler)
        calls.append(signum)
        return None if len(calls) <= 2 else previous

    monkeypatch.setattr(signal, "signal", installed_in_c)
    try:
        with stop_on_signals() as received:
            assert received == []
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for s, h in before.items():
            real(s, h)


@pytest.mark.parametrize("fmt", ["pandas", "numpy", "arrow", "torch"])
def test_a_dataset_in_another_format_is_read_as_python_values_and_a_transform_making_the_prompt_is_named(fmt):
    """with_format("pandas") passed the column checks (which read column slices) and failed at the first rollout
    (a prompt of type Series): any format is read as Python values now (a view; the caller's dataset keeps its
    format). with_transform building 'prompt' on the fly was refused for lacking a 'prompt' column that ds[0] has:
    it is named as a transform now; one over a stored prompt column trains, as before."""
    rows = datasets.Dataset.from_list([{"prompt": "repeat a:", "letter": "a"}] * 4)
    formatted = rows.with_format(fmt)
    data = PromptData(formatted, "train_dataset")
    assert data[0]["prompt"] == "repeat a:" and data[0]["letter"] == "a" and formatted.format["type"] == fmt
    questions = datasets.Dataset.from_list([{"question": "a", "letter": "a"}] * 4)
    built = questions.with_transform(lambda batch: {"prompt": [f"repeat {q}:" for q in batch["question"]], **batch})
    assert built[0]["prompt"] == "repeat a:"
    with pytest.raises(ConfigError, match=r"train_dataset has a transform .* no stored 'prompt' column.*"
                                          r"dataset.map\(transform, batched=True\)"):
        PromptData(built, "train_dataset")
    kept = rows.with_transform(lambda batch: {**batch, "letter": [x.upper() for x in batch["letter"]]})
    assert PromptData(kept, "train_dataset")[0]["letter"] == "A"


class _TwoProcesses:
    """A stand-in for Distributed on 2 processes whose other process holds `other` (what it gathers)."""

    world_size = 2

    def __init__(self, other):
        self.other = other

    def gather_object(self, mine):
        return [mine[0], self.other]


def test_check_same_everywhere_names_the_dataset_that_differs():
    """The 2-process runs (tests/test_faults.py) cover a reversed dataset; here the other shapes of a difference:
    a dataset present on one process only, a stream against a dataset, and equal datasets passing."""
    from groupwise.data_checks import check_same_everywhere

    rows = toy.dataset(8)
    train, evaluation = PromptData(rows, "train_dataset"), PromptData(rows[:4], "eval_dataset")
    same = {"train_dataset": (8, train.fingerprint()), "eval_dataset": (4, evaluation.fingerprint())}
    check_same_everywhere(_TwoProcesses(same), {"train_dataset": train, "eval_dataset": evaluation})  # no error
    with pytest.raises(ConfigError, match=r"^eval_dataset differs between processes \(process 0: 4 rows, digest "
                                          r"\w+; process 1: none\)"):
        check_same_everywhere(_TwoProcesses({"train_dataset": same["train_dataset"], "eval_dataset": None}),
                              {"train_dataset": train, "eval_dataset": evaluation})
    with pytest.raises(ConfigError, match=r"^train_dataset differs between processes \(process 0: 8 rows, digest "
                                          r"\w+; process 1: a stream\)"):
        check_same_everywhere(_TwoProcesses({"train_dataset": ("stream", None)}), {"train_dataset": train})
    with pytest.raises(ConfigError, match=r"eval_dataset\['b'\] differs between processes \(process 0: none; "
                                          r"process 1: 4 rows"):  # a name only the other process has
        check_same_everywhere(_TwoProcesses({"train_dataset": same["train_dataset"],
                                             "eval_dataset['b']": same["eval_dataset"]}), {"train_dataset": train})


def test_a_role_the_chat_template_drops_is_refused_naming_the_row_and_role(tmp_path, tokenizer):
    """Qwen's template renders system / user / assistant / tool only: a dataset whose turns say 'human' (ShareGPT's
    word) rendered as '<|assistant|>' alone, and trained on empty prompts with nothing said. A role the template
    renders (any role, here) passes; so does a stream, checked row by row."""
    qwen_like = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant', 'tool'] %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.chat_template = qwen_like
    rows = [{"prompt": [{"role": "user", "content": "repeat a:"}], "letter": "a"},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "human", "content": "repeat b:"}],
             "letter": "b"}]
    with pytest.raises(ConfigError, match=r"^train_dataset row 1 message 1 \(role 'human'\): the tokenizer's chat "
                                          r"template leaves this message out of the prompt .* rename the role \(human "
                                          r"→ user, gpt → assistant\)"):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward],
                    args=small_args(tmp_path), train_dataset=rows * 4, processing_class=tokenizer)
    stream = StreamData(datasets.IterableDataset.from_generator(lambda: iter(rows)), "train_dataset")
    stream.check_lengths(tokenizer, max_prompt_length=None, max_completion_length=4, truncate_prompt="left",
                         max_positions=1024)
    stream[0]
    with pytest.raises(ConfigError, match=r"^train_dataset row 1 message 1 \(role 'human'\)"):
        stream[1]
    tokenizer.chat_template = qwen_like.replace(" in ['system', 'user', 'assistant', 'tool']", " is defined")
    PromptData(rows * 4, "train_dataset").check_lengths(tokenizer, max_prompt_length=None, max_completion_length=4,
                                                        truncate_prompt="left", max_positions=1024)  # rendered: fine


def test_templates_that_transform_a_message_s_text_are_not_mistaken_for_dropping_it(tokenizer):
    """Llama 3.1 writes a tool message through tojson (quotes and newlines escaped), Qwen3 and DeepSeek-R1 cut an
    earlier assistant turn's <think> part, most trim: the text is not in the rendering verbatim, the message is.
    check_rendered renders markers in place of the texts; these prompts pass (they were refused by a verbatim
    search)."""
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'tool' %}{{ m['content'] | tojson }}"
        "{% elif m['role'] == 'assistant' and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] | trim }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
        "{% endif %}")
    prompt = [{"role": "system", "content": "Answer in \\boxed{}.\n"}, {"role": "user", "content": "  2+2?  "},
              {"role": "assistant", "content": "<think>\nadd\n</think>\n\n\\boxed{4}"},
              {"role": "tool", "content": 'result:\n{"value": 6}'}, {"role": "user", "content": "3+3?"}]
    PromptData([{"prompt": prompt}], "train_dataset").check_lengths(
        tokenizer, max_prompt_length=None, max_completion_length=4, truncate_prompt="left", max_positions=None)


def test_a_template_that_checks_a_message_s_form_is_not_broken_by_the_check(tokenizer):
    """A template refusing a tool message that is not JSON took the real row ('{"v": 1}'); the check's marker in its
    place made the template raise a TemplateError about text the user never wrote. The text is searched first;
    a template that refuses the marker where it took the text passes."""
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' and not m['content'].startswith('{') %}"
        "{{ raise_exception('tool output must be JSON') }}{% endif %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'tool' %}{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    prompt = [{"role": "user", "content": "2+2?"}, {"role": "tool", "content": '{"v": 1}'}]
    PromptData([{"prompt": prompt}], "train_dataset").check_lengths(
        tokenizer, max_prompt_length=None, max_completion_length=4, truncate_prompt="left", max_positions=None)
