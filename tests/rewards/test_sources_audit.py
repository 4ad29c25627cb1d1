"""Reward sources as TRL 1.16 users pass them, checked against TRL's own GRPOTrainer._calculate_rewards on the same
inputs (a real TRL trainer around a tiny policy, built in a few ms): async forms, reward models (pad token, chat
template kwargs, processors), what a function may return, the keywords and their per-generation repetition, and the
one-line errors for counts that do not match. tests/test_trl_rewards.py covers TRL's built-in reward functions."""

import asyncio
import functools
import math

import pytest
import torch

from groupwise.rewards import compute_rewards, load_reward_sources
from groupwise.rewards.combine import weighted_nansum
from groupwise.rewards.calls import is_async
from groupwise.tasks import toy

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from trl.trainer.utils import get_callable_name, is_async_callable  # noqa: E402

# "zz" after the conversation when the template is given shout=True: characters of the toy vocabulary, so the
# reward model sees two more tokens
SHOUT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if shout %}zz{% endif %}")


def _trl_trainer(tmp_path, reward_funcs, reward_processing_classes=None, **config):
    """TRL's GRPOTrainer built for its reward code path only (its __init__ prepares the reward models and the async
    loop as in training; `_calculate_rewards` is then called directly)."""
    tok = toy.build_chat_tokenizer()
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, num_generations=2,
                          report_to="none", use_cpu=True, bf16=False, **config)  # float32, as here
    data = datasets.Dataset.from_list([{"prompt": "ab"}] * 4)
    return trl.GRPOTrainer(toy.build_model(tok, seed=0, hidden_size=32), list(reward_funcs), args=args,
                           train_dataset=data, processing_class=tok,
                           reward_processing_classes=reward_processing_classes)


def _trl_rewards(trainer, prompts, completions, completion_ids, columns=None) -> torch.Tensor:
    columns = columns or {}
    inputs = [{"prompt": p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
    return trainer._calculate_rewards(inputs, list(prompts), list(completions), completion_ids)


def _reward_model(tokenizer, pad_token_id):
    """A tiny sequence-classification reward model; the same seed gives the same weights each call (TRL's trainer
    changes the config it is given, so each side gets its own copy)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    return LlamaForSequenceClassification(cfg).eval()


# ---- async reward functions ------------------------------------------------------------------------------------
class AsyncLength:
    async def __call__(self, completions, scale=1.0, **_):
        await asyncio.sleep(0)
        return [scale * len(c) for c in completions]


class SyncLength:
    def __call__(self, completions, **_):
        return [float(len(c)) for c in completions]


async def async_length(completions, scale=1.0, **_):
    return [scale * len(c) for c in completions]


def test_async_forms_are_recognised_as_trl_recognises_them(tmp_path):
    """TRL's is_async_callable unwraps functools.partial (nested too) before looking at __call__: a partial of an
    instance with `async def __call__` is async. groupwise saw it as sync and got an un-awaited coroutine back (an
    error 'got coroutine'). Values: scale 2 × lengths 1, 2 → [2, 4]."""
    forms = [async_length, functools.partial(async_length, scale=2.0),
             functools.partial(functools.partial(async_length), scale=2.0), AsyncLength(),
             functools.partial(AsyncLength(), scale=2.0), SyncLength(), functools.partial(SyncLength())]
    assert [is_async(f) for f in forms] == [is_async_callable(f) for f in forms] == [True] * 5 + [False] * 2
    fn = functools.partial(AsyncLength(), scale=2.0)
    sources = load_reward_sources([fn])
    assert sources[0].name == get_callable_name(fn) == "AsyncLength"  # metrics: rewards/AsyncLength/mean
    ours, errors = compute_rewards(sources, ["p", "q"], ["a", "bb"], [[1], [2, 2]], {})
    theirs = _trl_rewards(_trl_trainer(tmp_path, [fn]), ["p", "q"], ["a", "bb"], [[1], [2, 2]])
    assert ours[:, 0].tolist() == theirs[:, 0].tolist() == [2.0, 4.0] and errors.tolist() == [0.0]


def test_a_hung_async_function_leaves_the_other_async_functions_scores():
    """Each async function has its own reward_timeout: one that hangs is scored NaN on its rows (3 errors), the
    others keep their values. One limit around the whole gather used to score every async function NaN."""
    async def fast(completions, **_):
        return [1.0] * len(completions)

    async def hangs(completions, **_):
        await asyncio.sleep(60)

    def sync(completions, **_):
        return [2.0] * len(completions)

    sources = load_reward_sources([fast, hangs, sync])
    with pytest.warns(RuntimeWarning, match=r"'hangs' did not return within reward_timeout=0.5 s: its 3 rows"):
        rewards, errors = compute_rewards(sources, ["p"] * 3, ["c"] * 3, [[1]] * 3, {}, timeout=0.5)
    assert rewards[:, 0].tolist() == [1.0] * 3 and rewards[:, 2].tolist() == [2.0] * 3
    assert torch.isnan(rewards[:, 1]).all() and errors.tolist() == [0.0, 3.0, 0.0]


def test_only_the_kept_calls_log_extra_columns_and_metrics():
    """A batch call that logs, then raises on one row, is retried row by row: both used to log, so the log_extra
    column had 4 + 3 values for 4 rows (and was dropped from completions.jsonl) and log_metric counted the batch
    twice. Now the failed batch call's logs are dropped; the rows' calls give one value per row, None for the row
    that failed; the metric counts the 3 rows that scored. An async function that overruns logs nothing."""
    from collections import defaultdict

    columns, metrics = defaultdict(list), []
    extra = {"log_extra": lambda column, values: columns[column].extend(values),
             "log_metric": lambda name, value: metrics.append((name, value))}

    def judge(completions, log_extra, log_metric, **_):
        log_extra("reason", [f"why {c}" for c in completions])
        log_metric("judged", float(len(completions)))
        if "bad" in completions:
            raise ValueError("boom")
        return [1.0] * len(completions)

    async def slow(completions, log_extra, log_metric, **_):
        log_extra("slow_reason", ["x"] * len(completions))
        log_metric("slow", 1.0)
        await asyncio.sleep(60)

    sources = load_reward_sources([judge, slow])
    with pytest.warns(RuntimeWarning, match="'slow' did not return"):
        rewards, errors = compute_rewards(sources, ["p"] * 4, ["a", "b", "bad", "c"], [[1]] * 4, {}, on_error="nan",
                                          timeout=0.5, extra=extra)
    assert rewards[:, 0].tolist()[:2] == [1.0, 1.0] and errors.tolist() == [1.0, 4.0]
    assert dict(columns) == {"reason": ["why a", "why b", None, "why c"]}
    assert metrics == [("judged", 1.0)] * 3


# ---- what a reward function may return -------------------------------------------------------------------------
def test_none_values_and_generators_as_trl(tmp_path):
    """None → NaN per function, as TRL; a generator is read like a list (TRL iterates what comes back; groupwise
    refused it). Row 2 has None from both functions: unscorable, NaN after the weighted sum (TRL marks it NaN too).
    Weights [1, 0.5]: row 0 = 1·1 + 0.5·10 = 6; row 1 = 0.5·20 = 10 (the None term is skipped); row 2 = NaN."""
    def maybe(completions, **_):
        return (None if c != "a" else 1.0 for c in completions)  # a generator

    def other(completions, **_):
        return [{"a": 10.0, "bb": 20.0}.get(c) for c in completions]

    comps = ["a", "bb", "ccc"]
    with pytest.warns(UserWarning, match="every reward function returned None for row 2"):
        ours, _ = compute_rewards(load_reward_sources([maybe, other]), ["p"] * 3, comps, [[1], [2], [3]], {})
    theirs = _trl_rewards(_trl_trainer(tmp_path, [maybe, other]), ["p"] * 3, comps, [[1], [2], [3]])
    assert torch.allclose(ours.float(), theirs, equal_nan=True)
    assert ours[0].tolist() == [1.0, 10.0] and math.isnan(ours[1, 0]) and torch.isnan(ours[2]).all()
    total = weighted_nansum(ours, torch.tensor([1.0, 0.5], dtype=torch.float64))
    trl_total = (theirs * torch.tensor([1.0, 0.5])).nansum(dim=1)
    trl_total[torch.isnan(theirs).all(dim=1)] = torch.nan  # TRL's unscorable rows
    assert total[:2].tolist() == trl_total[:2].tolist() == [6.0, 10.0]
    assert math.isnan(total[2]) and math.isnan(trl_total[2])


# ---- reward models ---------------------------------------------------------------------------------------------
def test_reward_model_pads_with_the_tokenizers_pad_token_as_trl(tmp_path):
    """A model scores the last token that is not config.pad_token_id. TRL sets the config's pad token to the reward
    tokenizer's, whatever the config said; groupwise kept a config's own (here EOS), so the shorter text of a batch
    was scored on a padding position. Each score must equal the text scored alone (no padding)."""
    tok = toy.build_tokenizer()
    assert tok.pad_token_id != tok.eos_token_id
    ours_rm = _reward_model(tok, pad_token_id=tok.eos_token_id)
    prompts, comps = ["ab", "c"], ["cd", "efgh"]  # "abcd" (4 tokens) is padded to "cefgh"'s 5
    ours, _ = compute_rewards(load_reward_sources([ours_rm], [tok]), prompts, comps, [[0], [0]], {})
    assert ours_rm.config.pad_token_id == tok.pad_token_id
    trainer = _trl_trainer(tmp_path, [_reward_model(tok, pad_token_id=tok.eos_token_id)], [tok])
    theirs = _trl_rewards(trainer, prompts, comps, [[0], [0]])
    with torch.inference_mode():
        alone = [ours_rm(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                 for t in ("abcd", "cefgh")]
    assert ours[:, 0].tolist() == pytest.approx(alone, abs=1e-5)
    assert theirs[:, 0].tolist() == pytest.approx(alone, abs=1e-5)


def test_reward_model_renders_conversations_with_chat_template_kwargs_as_trl(tmp_path):
    """TRL renders prompt + completion messages with the reward tokenizer's chat template and
    GRPOConfig.chat_template_kwargs; groupwise ignored the kwargs. With shout=True the text ends in "zz", so the
    scores differ from those without it (checked, so the test cannot pass by accident)."""
    from groupwise import GRPOConfig, GRPOTrainer

    tok = toy.build_tokenizer()
    tok.chat_template = SHOUT_TEMPLATE
    prompts = [[{"role": "user", "content": "ab"}]] * 2
    comps = [[{"role": "assistant", "content": "cd"}], [{"role": "assistant", "content": "e"}]]
    kw = {"shout": True}
    ours, _ = compute_rewards(load_reward_sources([_reward_model(tok, tok.pad_token_id)], [tok],
                                                  chat_template_kwargs=kw), prompts, comps, [[0], [0]], {})
    plain, _ = compute_rewards(load_reward_sources([_reward_model(tok, tok.pad_token_id)], [tok]), prompts, comps,
                               [[0], [0]], {})
    theirs = _trl_rewards(_trl_trainer(tmp_path, [_reward_model(tok, tok.pad_token_id)], [tok],
                                       chat_template_kwargs=kw), prompts, comps, [[0], [0]])
    assert ours[:, 0].tolist() == pytest.approx(theirs[:, 0].tolist(), abs=1e-6)
    assert not torch.allclose(ours, plain)
    # the trainer hands GRPOConfig.chat_template_kwargs to its reward models
    args = GRPOConfig(output_dir=str(tmp_path / "gw"), num_generations=2, per_device_train_batch_size=2,
                      max_completion_length=4, chat_template_kwargs=kw, report_to="none")
    policy_tok = toy.build_tokenizer()
    trainer = GRPOTrainer(toy.build_model(policy_tok, seed=0, hidden_size=32), [_reward_model(tok, tok.pad_token_id)],
                          args=args, train_dataset=toy.dataset(4), processing_class=policy_tok,
                          reward_processing_classes=[tok])
    assert trainer.reward_sources[0].chat_template_kwargs == kw


class _Processor:
    """A multimodal processor's calling convention: `images` comes first, so the texts must be passed as text=
    (as TRL passes them); everything else is the tokenizer's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, images=None, text=None, **kwargs):
        assert images is None, "the texts were passed positionally, as images"
        return self.tokenizer(text=text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_reward_processing_class_receives_the_texts_as_text(tmp_path):
    tok = toy.build_tokenizer()
    ours, _ = compute_rewards(load_reward_sources([_reward_model(tok, tok.pad_token_id)], [_Processor(tok)]),
                              ["ab", "c"], ["cd", "efgh"], [[0], [0]], {})
    theirs = _trl_rewards(_trl_trainer(tmp_path, [_reward_model(tok, tok.pad_token_id)], [tok]), ["ab", "c"],
                          ["cd", "efgh"], [[0], [0]])
    assert ours[:, 0].tolist() == pytest.approx(theirs[:, 0].tolist(), abs=1e-6)


# ---- keywords, repeated per generation -------------------------------------------------------------------------
def test_keywords_and_per_generation_repetition_match_trl(tmp_path, tokenizer):
    """One step of 2 prompts × 4 generations: each prompt and each of its columns reaches the function 4 times in a
    row (TRL's RepeatSampler order), with TRL's keywords: prompts, completions, completion_ids, trainer_state,
    log_metric, log_extra and every dataset column."""
    from groupwise import GRPOTrainer
    from tests.conftest import small_args

    seen = []

    def record(prompts, completions, completion_ids, **kwargs):
        seen.append({"keys": set(kwargs) | {"prompts", "completions", "completion_ids"}, "prompts": prompts,
                     "letter": kwargs["letter"], "ids": completion_ids, "completions": completions})
        return [0.0] * len(completions)

    GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [record], args=small_args(tmp_path, max_steps=1),
                train_dataset=toy.dataset(8), processing_class=tokenizer).train()
    call = seen[0]
    assert len(call["prompts"]) == 8
    for g in range(2):  # the group's 4 rows carry one prompt and its letter
        assert len(set(call["prompts"][4 * g:4 * g + 4])) == 1 and len(set(call["letter"][4 * g:4 * g + 4])) == 1
        assert call["prompts"][4 * g] == f"repeat {call['letter'][4 * g]}:"
    assert all(isinstance(c, str) for c in call["completions"])  # plain prompts: plain-text completions
    assert all(isinstance(ids, list) and all(isinstance(t, int) for t in ids) for ids in call["ids"])
    theirs = []
    trainer = _trl_trainer(tmp_path, [lambda completions, **kw: theirs.append(set(kw) | {"completions"})
                                      or [0.0] * len(completions)])
    _trl_rewards(trainer, call["prompts"], call["completions"], call["ids"], {"letter": call["letter"]})
    assert call["keys"] == theirs[0] == {"prompts", "completions", "completion_ids", "trainer_state", "log_metric",
                                         "log_extra", "letter"}


# ---- errors for counts that do not match -----------------------------------------------------------------------
def test_count_mismatches_are_one_line_errors_with_the_fix(tmp_path):
    from groupwise import GRPOConfig, GRPOTrainer

    tok = toy.build_tokenizer()
    with pytest.raises(ValueError, match=r"^reward_processing_classes has 1 entries for 2 reward_funcs: give one per "
                                         r"reward function \(None for those that are not models\)"):
        load_reward_sources([toy.letter_reward, toy.letter_reward], [tok])
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                      reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"^reward_weights has 2 entries for 1 reward functions: give one weight per "
                                         r"reward function") as info:
        GRPOTrainer("no/such/model", [toy.letter_reward], args=args, train_dataset=[{"prompt": "x", "letter": "a"}])
    assert "\n" not in str(info.value)


def test_a_reward_functions_own_timeout_and_bad_logged_value_are_its_errors():
    """An async reward function whose own call times out (its TimeoutError is asyncio's) was taken for an overrun of
    reward_timeout and scored NaN even with on_reward_error='raise'; a log_metric value that is not a number failed
    when the logs were committed, outside the function ('on no single row'). Both are the function's errors now."""
    async def remote_judge(completions, **_):
        raise TimeoutError("the judge's HTTP call timed out")

    def bad_metric(completions, log_metric, **_):
        log_metric("m", "n/a")
        return [1.0] * len(completions)

    extra = {"log_metric": lambda name, value: None, "log_extra": lambda column, values: None}
    for fn in (remote_judge, bad_metric):
        with pytest.raises(Exception, match=rf"reward function '{fn.__name__}' raised (TimeoutError|ValueError)"
                                            r".* on row 0"):
            compute_rewards(load_reward_sources([fn]), ["p"], ["c"], [[1]], {}, extra=extra, timeout=5.0)
        rewards, errors = compute_rewards(load_reward_sources([fn]), ["p"], ["c"], [[1]], {}, on_error="nan",
                                          extra=extra)
        assert torch.isnan(rewards).all() and errors.tolist() == [1.0]


def test_reward_models_take_no_columns_so_a_keyword_named_column_is_fine(tmp_path):
    from groupwise.rewards.sources import check_reward_columns

    check_reward_columns(["some/reward-model", torch.nn.Linear(2, 2)], ["prompt", "completions"], False)
    with pytest.raises(Exception, match="has a column 'completions'"):
        check_reward_columns([lambda completions, **_: [0.0]], ["prompt", "completions"], False)
