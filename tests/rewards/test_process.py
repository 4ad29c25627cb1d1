import math

import pytest
import torch

from groupwise.config_base import ConfigError
from groupwise.rewards import RewardFunctionError
from groupwise.rewards.process import compute_step_rewards, load_process_reward_sources
from groupwise.core.supervision import token_advantages


def _run(funcs, steps, weights=None, **kw):
    sources = load_process_reward_sources(funcs)
    w = torch.tensor(weights or [1.0] * len(sources))
    return compute_step_rewards(sources, w, ["p"] * len(steps), ["c"] * len(steps), steps, {}, **kw)


def test_weighted_sum_per_step_with_none():
    # f: [1, None], [2]; g (weight 0.5): [4, 6], [None] → [1 + 2, 0.5·6 = 3], [2] (None terms skipped)
    f = lambda steps, **_: [[1.0, None], [2.0]]  # noqa: E731
    g = lambda steps, **_: [[4.0, 6.0], [None]]  # noqa: E731
    rewards, errors, totals = _run([f, g], [["s1", "s2"], ["t1"]], weights=[1.0, 0.5])
    assert rewards == [[3.0, 3.0], [2.0]] and errors.tolist() == [0.0, 0.0]
    # each function's own sum and count of the steps it scored, unweighted: f 1 + 2 over 2, g 4 + 6 over 2
    assert totals.tolist() == [[3.0, 2.0], [10.0, 2.0]]
    all_none, _, _ = _run([lambda steps, **_: [[None]]], [["s"]])
    assert math.isnan(all_none[0][0])


def test_wrong_step_count_names_function_and_row():
    def miscount(steps, **_):
        return [[1.0] * len(s) for s in steps[:-1]] + [[1.0]]

    with pytest.raises(RewardFunctionError, match=r"'miscount' returned 1 rewards for row 1, which has 2 steps"):
        _run([miscount], [["a"], ["b", "c"]])
    with pytest.raises(RewardFunctionError, match=r"returned 1 entries for 2 completions"):
        _run([lambda steps, **_: [[1.0]]], [["a"], ["b"]])
    with pytest.raises(RewardFunctionError, match=r"non-numeric step reward for row 0: 'ok'"):
        _run([lambda steps, **_: [["ok"]]], [["a"]])


def test_exceptions_raise_or_count():
    def fragile(steps, **_):
        return [[1.0 / (len(s[0]) - 1)] for s in steps]

    with pytest.raises(RewardFunctionError, match=r"'fragile' raised ZeroDivisionError.* on row 1"):
        _run([fragile], [["ab"], ["c"]])
    rewards, errors, totals = _run([fragile], [["ab"], ["c"]], on_error="nan")
    assert rewards[0] == [1.0] and math.isnan(rewards[1][0]) and errors.tolist() == [1.0]
    assert totals.tolist() == [[1.0, 1.0]]  # the failed row's step is left out of process/fragile/mean


def test_supervision_both_by_hand():
    # outcome r̃ = [1, −1]; process token advantages [[0.5, 0.5, 0], [−2, 0, 0]]; w_o = 1, w_p = 0.5:
    # row 0: 1 + 0.5·[0.5, 0.5, 0] = [1.25, 1.25, 1]; row 1: −1 + 0.5·[−2, 0, 0] = [−2, −1, −1]
    outcome = torch.tensor([1.0, -1.0])
    process = torch.tensor([[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]])
    both = token_advantages("both", outcome, process, outcome_weight=1.0, process_weight=0.5)
    assert torch.equal(both, torch.tensor([[1.25, 1.25, 1.0], [-2.0, -1.0, -1.0]]))
    assert token_advantages("outcome", outcome, None) is outcome
    assert token_advantages("process", None, process) is process


def test_a_prm_folder_given_as_a_string(tmp_path, tokenizer):
    """A folder written by `groupwise prm train` (it holds groupwise_prm.json) loads as the PRM it records; any
    other folder is named with the spec to write, instead of being loaded as an outcome reward model."""
    import json

    from transformers import LlamaConfig, LlamaForTokenClassification

    from groupwise.rewards.prm import TokenClassificationPRM

    torch.manual_seed(0)
    model = LlamaForTokenClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, num_labels=2))
    for folder in (tmp_path / "prm", tmp_path / "other"):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    (tmp_path / "prm" / "groupwise_prm.json").write_text(json.dumps({"kind": "token_classification",
                                                                     "separator": "\n", "max_length": 64}))
    [source] = load_process_reward_sources([str(tmp_path / "prm")])
    assert isinstance(source.fn, TokenClassificationPRM) and source.fn.max_length == 64
    assert len(source.fn(prompts=["a"], completions=[""], steps=[["b", "c"]])[0]) == 2
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\]='.*other' is a folder without "
                                          r"groupwise_prm.json: give a PRM as \{path: .*, kind: "):
        load_process_reward_sources([str(tmp_path / "other")])


def test_step_rewards_given_as_tensors_or_arrays():
    # a PRM wrapper's natural output: one 1-d tensor / array of step rewards per completion, or one (N, K) tensor
    # when every completion has K steps; read as lists, as an outcome function's tensor is (was: "returned tensor(…)
    # rewards for row 0")
    import numpy as np

    per_row = lambda steps, **_: [torch.tensor([0.25, 0.5]), np.array([1.0])]  # noqa: E731
    rewards, _, _ = _run([per_row], [["s1", "s2"], ["t1"]])
    assert rewards == [[0.25, 0.5], [1.0]]
    rewards, _, _ = _run([lambda steps, **_: torch.tensor([[0.25], [0.75]])], [["s"], ["t"]])
    assert rewards == [[0.25], [0.75]]
    with pytest.raises(RewardFunctionError, match=r"returned 1 rewards for row 0, which has 2 steps"):
        _run([lambda steps, **_: [torch.tensor([1.0])]], [["a", "b"]])


def test_a_prm_hub_id_given_as_a_string_is_named_before_anything_loads(tmp_path):
    # "org/name" was resolved as an outcome reward model: AutoModelForSequenceClassification downloaded and loaded
    # it (gigabytes for a 7B PRM), and only then a TypeError said it was a bare model
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\]='some-org/some-prm' is not a step-reward "
                                          r"function: give a function as 'module:function' \(or "
                                          r"'package.module.function'\), or a PRM as \{path: some-org/some-prm, kind: "):
        load_process_reward_sources(["some-org/some-prm"])
    file = tmp_path / "prm.bin"
    file.write_text("")
    with pytest.raises(ConfigError, match="is not a step-reward function"):
        load_process_reward_sources([str(file)])


def test_a_prm_spec_key_no_prm_takes_is_named_before_the_model_loads(tmp_path):
    """A misspelt option (tokenisation) or one of another kind (positive_label for a step-tag PRM) was a TypeError
    from the PRM class after the weights had loaded; the folder here holds no model at all, so only the spec is
    read."""
    (tmp_path / "prm").mkdir()
    with pytest.raises(ConfigError, match=r"process_reward_funcs\[0\] \(a PRM spec of a token_classification PRM, "
                                          r"whose options are \[.*'tokenization'.*\]\): unknown field "
                                          r"'tokenisation'; did you mean 'tokenization'\?"):
        load_process_reward_sources([{"path": str(tmp_path / "prm"), "kind": "token_classification",
                                      "tokenisation": "per_step"}])
    with pytest.raises(ConfigError, match=r"\(a PRM spec of a step_tag PRM, whose options are \[.*\]\): unknown "
                                          r"field 'positive_label'"):
        load_process_reward_sources([{"path": str(tmp_path / "prm"), "kind": "step_tag", "positive_label": 1}])
    with pytest.raises(ConfigError, match=r"\(a PRM spec of any PRM, whose options are \[.*\]\): unknown field "
                                          r"'weight'"):
        load_process_reward_sources([{"path": str(tmp_path / "prm"), "weight": 2.0}])
    # a `prm train` folder without kind: its recorded kind's options only (was: step_tag accepted as some kind's
    # option, then a TypeError from the token-classification PRM after the policy had loaded)
    (tmp_path / "prm" / "groupwise_prm.json").write_text('{"kind": "token_classification", "separator": "\\n"}')
    with pytest.raises(ConfigError, match=r"\(a PRM spec of a token_classification PRM, as its groupwise_prm.json "
                                          r"records, whose options are \[.*\]\): unknown field 'step_tag'"):
        load_process_reward_sources([{"path": str(tmp_path / "prm"), "step_tag": "A"}])
    # the same folder as an outcome reward model: named before it loads (was: transformers' head-size traceback)
    from groupwise.rewards.sources import load_reward_sources

    with pytest.raises(ConfigError, match=r"reward_funcs\[0\]=.* is a process reward model \(trained by `groupwise prm "
                                          r"train`\).*list it under process_reward_funcs"):
        load_reward_sources([str(tmp_path / "prm")])


def test_takes_keyword_reads_the_signature_the_call_meets():
    """dropped_last goes to a step-reward function that names it or takes **kwargs; a decorator's wrapper is what
    the call meets (its wrapped function's signature is not), and a partial that binds it keeps its value."""
    import functools

    from groupwise.rewards.process import takes_keyword

    def named(steps, dropped_last, **_):
        return steps

    def plain(prompts, completions, steps, trainer_state, log_metric, log_extra):
        return steps

    @functools.wraps(named)
    def wrapper(prompts, completions, steps, trainer_state, log_metric, log_extra):
        return named(steps, [False] * len(steps))

    assert takes_keyword(named, "dropped_last") and takes_keyword(lambda **kw: kw, "dropped_last")
    assert not takes_keyword(plain, "dropped_last")
    assert not takes_keyword(wrapper, "dropped_last")  # inspect.signature alone follows __wrapped__ to `named`
    assert not takes_keyword(functools.partial(named, dropped_last=[True]), "dropped_last")


def _prm_folder(folder, tokenizer, record=None):
    """A token-classification PRM saved as `groupwise prm train` leaves it (record: its groupwise_prm.json)."""
    import json

    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    LlamaForTokenClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, num_labels=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    record = {"kind": "token_classification", "separator": "\n", "max_length": 64} if record is None else record
    (folder / "groupwise_prm.json").write_text(json.dumps(record))
    return folder


def test_a_damaged_prm_folder_is_named_before_anything_loads(tmp_path, tokenizer):
    """A PRM folder missing its config, weights or tokenizer, or whose groupwise_prm.json is not a record, failed
    with a traceback (ValueError 'Unrecognized model', JSONDecodeError, AttributeError on a list, a misleading
    'install sentencepiece') once the policy had loaded; now one line naming the file, from the spec alone."""
    import os

    cases = {
        "no_config": (lambda f: os.remove(f / "config.json"), r"is a folder without config.json"),
        "no_weights": (lambda f: os.remove(f / "model.safetensors"), r"has a config but no weights \(model.safetensors"),
        "no_tokenizer": (lambda f: [os.remove(f / n) for n in ("tokenizer.json", "tokenizer_config.json")],
                         r"holds no tokenizer \(tokenizer.json / tokenizer_config.json\)"),
        "torn_record": (lambda f: (f / "groupwise_prm.json").write_text('{"kind": "tok'),
                        r"groupwise_prm.json cannot be read \(JSONDecodeError: .*train the PRM again, or restore"),
        "list_record": (lambda f: (f / "groupwise_prm.json").write_text("[]"),
                        r"groupwise_prm.json is not a PRM record \(a JSON object with kind one of .*got 'list'\)"),
        "no_kind": (lambda f: (f / "groupwise_prm.json").write_text('{"separator": "\\n"}'),
                    r"groupwise_prm.json is not a PRM record .*got None\)"),
    }
    for name, (damage, message) in cases.items():
        folder = _prm_folder(tmp_path / name, tokenizer)
        damage(folder)
        for spec in (str(folder), {"path": str(folder)}):
            with pytest.raises(ConfigError, match=r"^process_reward_funcs\[0\]" + r".*" + message):
                load_process_reward_sources([spec])
    from groupwise.rewards.prm import load_prm

    with pytest.raises(ConfigError, match=r"groupwise_prm.json is not a PRM record"):  # the Python API alike
        load_prm(str(tmp_path / "list_record"))


def test_a_prm_trained_on_another_separator_than_step_delimiter_is_warned_about(tmp_path, tokenizer):
    """A PRM trained on steps joined by '\n\n' scored the policy's '\n'-split lines rejoined with '\n\n', with
    nothing said: steps it may never have seen. The two can also differ on purpose (paragraph steps written apart by
    '\n\n', trained joined by '\n'), so it is a warning before any model loads, naming both fixes; not when the
    spec gives its separator, the strings agree, another split mode is used or the PRM is not a prm train one
    (a hand-written step_tag record's separator holds its tag). A record without kind is read when the spec gives
    one (as load_prm always read it)."""
    import warnings

    from groupwise import GRPOConfig
    from groupwise.loading import check_inputs

    folder = _prm_folder(tmp_path / "prm", tokenizer, {"kind": "token_classification", "separator": "\n\n"})

    def check(spec, **fields):
        args = GRPOConfig(output_dir=str(tmp_path / "out"), supervision="process", **fields)
        return check_inputs(args, "unused/model", [], [spec])

    with pytest.warns(UserWarning, match=r"^process_reward_funcs\[0\]: the PRM .*prm was trained on steps joined by "
                                         r"'\\n\\n' \(groupwise_prm.json\), and step_delimiter='\\n' splits .* set "
                                         r"step_delimiter: '\\n\\n'; if they are the policy's '\\n'-steps, give the "
                                         r"spec separator: '\\n\\n' to say so"):
        check(str(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(str(folder), step_delimiter="\n\n")  # the same string
        check({"path": str(folder), "separator": "\n\n"})  # chosen in the spec
        check(str(folder), step_split="regex", step_pattern=r"\n+")  # no one delimiter to compare
        tagged = _prm_folder(tmp_path / "tag", tokenizer, {"kind": "step_tag", "step_tag": "ки", "separator": " ки\n"})
        check({"path": str(tagged)})
        kindless = _prm_folder(tmp_path / "kindless", tokenizer, {"separator": "\n"})
        check({"path": str(kindless), "kind": "token_classification"})
    kindless = _prm_folder(tmp_path / "kindless2", tokenizer, {"separator": "\n\n"})  # the spec's kind counts
    with pytest.warns(UserWarning, match=r"trained on steps joined by '\\n\\n'"):
        check({"path": str(kindless), "kind": "token_classification"})
