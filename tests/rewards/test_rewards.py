import math

import pytest
import torch

from groupwise import ConfigError, GRPOConfig
from groupwise.core.advantages import outcome_advantages
from groupwise.rewards import RewardFunctionError, combine_rewards, compute_rewards, load_reward_sources


def _score(funcs, prompts=("p1", "p2"), completions=("a", "bb"), columns=None, **kw):
    sources = load_reward_sources(funcs)
    return compute_rewards(sources, list(prompts), list(completions), [[1], [2, 2]], columns or {}, **kw)


def test_callable_protocol_columns_and_none():
    seen = {}

    def length(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer)
        return [None if c == "a" else float(len(c)) for c in completions]

    with pytest.warns(UserWarning, match="every reward function returned None for row 0"):
        rewards, errors = _score([length], columns={"answer": ["x", "y"]})
    assert seen == {"prompts": ["p1", "p2"], "ids": [[1], [2, 2]], "answer": ["x", "y"]}
    assert math.isnan(rewards[0, 0]) and rewards[1, 0] == 2.0 and errors.tolist() == [0.0]


def test_wrong_length_names_the_function():
    def short(completions, **_):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 values for 2 completions"):
        _score([short])


def test_non_numeric_names_function_and_row():
    def texty(completions, **_):
        return [1.0, "good"]

    with pytest.raises(RewardFunctionError, match=r"'texty' returned a non-numeric value for row 1: 'good'"):
        _score([texty])


def test_exception_stops_with_function_and_row_by_default():
    def fragile(completions, **_):
        return [1.0 / (len(c) - 2) for c in completions]  # "bb" divides by zero

    with pytest.raises(RewardFunctionError, match=r"'fragile' raised ZeroDivisionError.* on row 1"):
        _score([fragile])


def test_exception_becomes_nan_and_is_counted_when_configured():
    def fragile(completions, **_):
        return [1.0 / (len(c) - 2) for c in completions]

    with pytest.warns(UserWarning) as caught:  # the only function failed on row 1: nothing scored it
        rewards, errors = _score([fragile], on_error="nan")
    assert rewards[0, 0] == -1.0 and math.isnan(rewards[1, 0]) and errors.tolist() == [1.0]
    said = [str(w.message) for w in caught]
    # the exception is shown, and the unscored row's warning says why (it said "returned None", the function raised)
    assert any("'fragile' raised ZeroDivisionError: float division by zero (on_reward_error='nan': the rows it raises "
               "on are scored NaN" in m for m in said), said
    assert any(m.startswith("no reward function scored row 1 ('fragile' raised ZeroDivisionError: float division "
                            "by zero)") for m in said), said
    assert not any("returned None" in m for m in said), said


def test_an_unscored_row_names_each_functions_reason():
    """Two functions: one raises on row 0, the other returns None there; a third times out on the whole batch."""
    import time

    def fragile(completions, **_):
        if "a" in completions:
            raise KeyError("no answer")
        return [1.0] * len(completions)

    def sometimes(completions, **_):
        return [None if c == "a" else 2.0 for c in completions]

    with pytest.warns(UserWarning) as caught:
        rewards, errors = _score([fragile, sometimes], on_error="nan")
    assert errors.tolist() == [1.0, 0.0] and torch.isnan(rewards[0]).all() and rewards[1].tolist() == [1.0, 2.0]
    said = [str(w.message) for w in caught]
    assert any(m.startswith("no reward function scored row 0 ('fragile' raised KeyError: 'no answer'; 1 other(s) "
                            "returned None or NaN)") for m in said), said

    def slow(completions, **_):
        time.sleep(2)
        return [1.0] * len(completions)

    with pytest.warns(UserWarning) as caught:
        rewards, errors = _score([slow], on_error="nan", timeout=0.2)
    said = [str(w.message) for w in caught]
    assert errors.tolist() == [2.0] and torch.isnan(rewards).all()
    assert any(m.startswith("no reward function scored row 0 ('slow' timed out)") for m in said), said


def test_all_none_row_warns_with_the_row():
    with pytest.warns(UserWarning, match=r"every reward function returned None for row 0"):
        _score([lambda completions, **_: [None, 1.0]])


def test_module_path_and_duplicate_names():
    sources = load_reward_sources(["groupwise.tasks.toy:letter_reward", "groupwise.tasks.toy:letter_reward"])
    assert [s.name for s in sources] == ["letter_reward", "letter_reward_1"]


def test_sequence_classification_reward_model(tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(cfg).eval()
    sources = load_reward_sources([rm], [tokenizer])
    rewards, _ = compute_rewards(sources, ["ab", "c"], ["cd", "efg"], [[0], [0]], {})
    # the score of a text is logits[:, 0] of prompt + completion, whatever the padding around it
    for i, text in enumerate(["abcd", "cefg"]):
        enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        assert rewards[i, 0].item() == pytest.approx(rm(**enc).logits[0, 0].item(), abs=1e-5)
    with pytest.raises(ValueError, match=r"pass its tokenizer in reward_processing_classes\[0\]"):
        load_reward_sources([rm])


def test_combine_sum_then_normalize_by_hand():
    # 1 prompt, G = 2, two functions with weights [1, 0.5]:
    # row 0: 1 + 0.5·2 = 2; row 1: 0 + 0.5·NaN(skipped) = 0 → rewards [2, 0]; mean 1, population std 1 → [1, −1]
    per_func = torch.tensor([[[1.0, 2.0], [0.0, float("nan")]]])
    rewards = combine_rewards(per_func, torch.tensor([1.0, 0.5]), aggregation="sum_then_normalize",
                              std="population", eps=0.0)
    adv = outcome_advantages(rewards, scale="group", std="population", eps=0.0)
    assert rewards.tolist() == [[2.0, 0.0]] and adv.tolist() == [[1.0, -1.0]]


def test_combine_normalize_then_sum_by_hand():
    # group 0, function 0: [1, 0, 0, 1] → z = [1, −1, −1, 1]; function 1: [10, 10, 30, 30] → z = [−1, −1, 1, 1]
    #   weights [1, 1]: sums [0, −2, 0, 2]
    # group 1, function 0: [1, 1, 1, 0]: mean 0.75, population std √(0.75 / 4) = 0.433013 → z = [0.57735 ×3, −1.73205];
    #   function 1: [5, 5, 5, 5] → z = 0; sums [0.57735 ×3, −1.73205]
    # then over the batch (TRL): mean 0, population std √((4 + 4 + 3 · 1/3 + 3) / 8) = √1.5 = 1.224745 →
    #   [0, −1.632993, 0, 1.632993], [0.471405 ×3, −1.414214] (a group scale would give [0, −1.414214, 0, 1.414214])
    per_func = torch.tensor([[[1.0, 10.0], [0.0, 10.0], [0.0, 30.0], [1.0, 30.0]],
                             [[1.0, 5.0], [1.0, 5.0], [1.0, 5.0], [0.0, 5.0]]])
    rewards = combine_rewards(per_func, torch.tensor([1.0, 1.0]), aggregation="normalize_then_sum",
                              std="population", eps=0.0)
    assert torch.allclose(rewards, torch.tensor([[0.0, -2.0, 0.0, 2.0], [0.57735, 0.57735, 0.57735, -1.73205]]),
                          atol=1e-5)
    options = GRPOConfig(multi_objective_aggregation="normalize_then_sum", advantage_eps=0.0).estimator_options(
        outcome=True)
    assert options["scale"] == "batch"
    adv = outcome_advantages(rewards, **options)
    assert torch.allclose(adv, torch.tensor([[0.0, -1.632993, 0.0, 1.632993], [0.471405] * 3 + [-1.414214]]),
                          atol=1e-5)


def _trl_normalize_then_sum(per_func, weights):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions for multi_objective_aggregation="normalize_then_sum",
    as plain loops: each function z-scored in its group (nanmean, unbiased nanstd, + 1e-4), weighted nansum, NaN
    where no function scored the row, then (r − nanmean over the batch) / (unbiased nanstd over the batch + 1e-4),
    and NaN advantages → 0."""
    def mean_sd(vals):
        m = sum(vals) / len(vals)
        return m, (math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else float("nan"))

    B, G, F = per_func.shape
    rewards = []
    for b in range(B):
        for g in range(G):
            total, scored = 0.0, False
            for f in range(F):
                v = per_func[b, g, f].item()
                if math.isnan(v):
                    continue
                m, sd = mean_sd([x for x in per_func[b, :, f].tolist() if not math.isnan(x)])
                total, scored = total + weights[f] * (v - m) / (sd + 1e-4), True
            rewards.append(total if scored else float("nan"))
    m, sd = mean_sd([r for r in rewards if not math.isnan(r)])
    return torch.tensor([0.0 if math.isnan(r) else (r - m) / (sd + 1e-4) for r in rewards]).view(B, G)


def test_normalize_then_sum_advantages_equal_trl():
    g = torch.Generator().manual_seed(4)
    per_func = torch.randn(5, 4, 3, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1],
                                                                                         dtype=torch.float64)
    per_func[2, 1] = float("nan")  # a completion no function scored
    per_func[3, :, 2] = 0.5  # a function that cannot tell group 3's completions apart
    weights = [1.0, 0.5, 2.0]
    args = GRPOConfig(multi_objective_aggregation="normalize_then_sum", reward_std="unbiased", reward_weights=weights)
    rewards = combine_rewards(per_func, torch.tensor(weights, dtype=torch.float64),
                              aggregation=args.multi_objective_aggregation, std=args.reward_std, eps=args.advantage_eps)
    adv = outcome_advantages(rewards, **args.estimator_options(outcome=True))
    assert torch.allclose(adv, _trl_normalize_then_sum(per_func, weights), atol=1e-5)



def test_a_causal_lm_given_as_a_reward_model_is_refused(model_dir, tmp_path, tokenizer):
    """AutoModelForSequenceClassification loads a causal LM's folder with a score head initialised at random
    (transformers logs its load report; TRL trains on that noise). A checkpoint that holds a score head loads."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]='.*tiny-model' has no trained score head: its checkpoint "
                                        r"lacks score\.weight, which AutoModelForSequenceClassification would "
                                        r"initialise at random"):
        load_reward_sources([model_dir])
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    assert [s.name for s in load_reward_sources([str(tmp_path / "rm")])] == ["rm"]


def test_a_reward_spec_that_is_no_reward_and_positional_only_parameters_are_refused_before_the_model_loads(
        tmp_path, tokenizer, monkeypatch):
    """[good, None] failed with a TypeError after the model loaded; def f(prompts, completions, /, **kw) failed at the
    first scoring (TypeError: got some positional-only arguments passed as keyword arguments)."""
    from groupwise import GRPOTrainer
    from groupwise.tasks import toy
    from tests.conftest import small_args

    monkeypatch.setattr("groupwise.trainer.load_policy", lambda *a, **k: pytest.fail("the model loaded"))

    def positional(prompts, completions, /, **kwargs):
        return [1.0] * len(completions)

    for funcs, match in (([toy.letter_reward, None], r"^reward_funcs\[1\] is None, a NoneType: give a function, a "
                                                     r"loaded reward model, 'package.module:function'"),
                         ([positional], r"^reward_funcs\[0\] 'positional' has positional-only parameters \(prompts, "
                                        r"completions\), but reward functions are called by keyword \(as in TRL\): "
                                        r"remove the '/' from its signature$")):
        with pytest.raises(ConfigError, match=match):
            GRPOTrainer("unused", funcs, args=small_args(tmp_path), train_dataset=toy.dataset(8),
                        processing_class=tokenizer)
