"""TRL 1.16's built-in rewards of `trl grpo` (trl/scripts/grpo.py's registry): groupwise's give TRL's own outputs."""

import importlib.util
import pickle
import subprocess
import sys

import pytest

from groupwise.rewards import (accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward,
                               think_format_reward)
from groupwise.rewards.shaping import trl_grpo_soft_overlong_punishment

trl_rewards = pytest.importorskip("trl.rewards")
pytest.importorskip("math_verify")

# what TRL's trainer passes besides the dataset's columns; every reward function must ignore what it does not use
EXTRA = {"prompts": None, "trainer_state": None, "log_metric": None}


def _conv(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


def _both_forms(ours, theirs, texts, **kwargs):
    """ours on plain and conversational completions, TRL's on conversational ones (TRL reads completion[0]["content"]
    only): all three equal, log_extra columns included when the function has them. Returns the rewards."""
    logs = {"plain": {}, "conv": {}, "trl": {}}
    extra = lambda key: ({"log_extra": lambda name, col: logs[key].__setitem__(name, col)}  # noqa: E731
                         if "solution" in kwargs else {})
    expected = theirs(_conv(texts), **kwargs, **extra("trl"), **EXTRA)
    assert ours(list(texts), **kwargs, **extra("plain"), **EXTRA) == expected
    assert ours(_conv(texts), **kwargs, **extra("conv"), **EXTRA) == expected
    assert logs["plain"] == logs["conv"] == logs["trl"]
    return expected


THIRD = r"\frac{1}{3}"
# (completion, solution): correct, wrong, answer only inside the reasoning, no answer, unparseable answer, several
# </think>, no </think> at all, and an unparseable solution with and without a finished reasoning
MATH_ROWS = [
    (r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{3}}", THIRD),
    (r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}", THIRD),
    (r"<think> partial answer \boxed{\frac{1}{3}} </think> and then nothing", THIRD),
    (r"<think> partial answer \boxed{\frac{1}{3}} but no final answer", THIRD),
    (r"<think>hmm</think> the answer is banana", "42"),
    (r"<think>a</think> \boxed{2} </think> so \boxed{3}", "3"),
    (r"<think>a</think> \boxed{2} </think> so \boxed{3}", "2"),
    (r"The answer is $\boxed{0.5}$", r"\frac{1}{2}"),
    (r"</think>$x = 5$ cm", "5"),
    (r"<think>x</think> \boxed{7}", "not a math answer"),
    (r"no reasoning \boxed{7}", "not a math answer"),
    ("", "1"),
]


def test_accuracy_reward_equals_trls():
    """accuracy_reward (shares its math_verify check with reasoning_accuracy_reward) gives TRL's rewards and
    log_extra columns; an unparseable solution is None, correct 1.0, wrong 0.0."""
    texts, sols = zip(*MATH_ROWS)
    got = _both_forms(accuracy_reward, trl_rewards.accuracy_reward, texts, solution=list(sols))
    assert got[0] == 1.0 and got[1] == 0.0 and got[-3] is None and got[-2] is None


def test_reasoning_accuracy_reward_equals_trls():
    """Only the text after the last </think> is graded; no </think> is 0.0 even when the solution is unparseable
    (TRL checks the reasoning before the solution); an unparseable solution after finished reasoning is None."""
    texts, sols = zip(*MATH_ROWS)
    got = _both_forms(reasoning_accuracy_reward, trl_rewards.reasoning_accuracy_reward, texts, solution=list(sols))
    assert got[:6] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert got[-3] is None and got[-2] == 0.0 and got[7] == 0.0  # no </think>: 0.0 although \boxed{0.5} is right


def test_reasoning_delimiters_first_listed_wins():
    """With several delimiters, TRL splits at the first one *in list order* that the completion contains (not the
    one that comes first in the text), after its last occurrence; a keyword, as the trainer would pass a column."""
    texts = [r"<think>x</think> \boxed{2} </reasoning> nothing", r"<think>x</think> \boxed{2}",
             r"no delimiter \boxed{2}"]
    for delimiters in (["</reasoning>", "</think>"], ["</think>", "</reasoning>"], ["</reasoning>"]):
        _both_forms(reasoning_accuracy_reward, trl_rewards.reasoning_accuracy_reward, texts, solution=["2"] * 3,
                    reasoning_delimiters=delimiters)
    assert reasoning_accuracy_reward(texts, ["2"] * 3, reasoning_delimiters=["</reasoning>", "</think>"]) == \
        [0.0, 1.0, 0.0]  # split at </reasoning> although </think> comes first in the text
    assert reasoning_accuracy_reward(texts, ["2"] * 3, reasoning_delimiters=["</think>", "</reasoning>"]) == \
        [1.0, 1.0, 0.0]


def test_think_format_reward_equals_trls():
    texts = [
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # 1.0
        "<think>\nThis is my reasoning.\nThis is my answer.",  # no </think>
        "<think></think>",  # empty reasoning still counts
        "<think>a</think>b</think>",  # a second </think> is allowed
        "<think>a<think>b</think>",  # nested <think>
        "<think>a</think>answer <think>again",  # a later <think>, even after the block
        " <think>a</think>",  # leading space
        "\n<think>a</think>",  # leading newline (MULTILINE does not let re.match skip it)
        "Reasoning</think> answer",  # no opening tag
        "<THINK>a</THINK>",  # tags are case-sensitive
        "<think>multi\nline\n\nreasoning\n</think>\n\nfinal\nanswer",
        "",
    ]
    got = _both_forms(think_format_reward, trl_rewards.think_format_reward, texts)
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_soft_overlong_punishment_equals_trls():
    # Worked example, L = max_completion_len = 100, C = soft_punish_cache = 20, so punishment starts after
    # L - C = 80 tokens: 80 tokens -> 0.0; 81 -> (80 - 81) / 20 = -0.05; 90 -> (80 - 90) / 20 = -0.5;
    # 100 -> (80 - 100) / 20 = -1.0; 101 (beyond L) -> -1.0.
    lengths = [0, 1, 79, 80, 81, 90, 95, 99, 100, 101, 500]
    ids = [[7] * n for n in lengths]
    for L, C in [(100, 20), (1280, 256), (100, 0), (100, 100), (10, 3)]:
        ours, theirs = get_soft_overlong_punishment(L, C), trl_rewards.get_soft_overlong_punishment(L, C)
        assert ours(ids, completions=None, **EXTRA) == theirs(ids, completions=None, **EXTRA)
        assert ours(completion_ids=ids) == theirs(completion_ids=ids)
    got = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)(ids)
    assert dict(zip(lengths, got)) == {0: 0.0, 1: 0.0, 79: 0.0, 80: 0.0, 81: -0.05, 90: -0.5, 95: -0.75, 99: -0.95,
                                       100: -1.0, 101: -1.0, 500: -1.0}
    # soft_punish_cache=0: no window, 0.0 up to L and -1.0 beyond (and no division by zero)
    assert get_soft_overlong_punishment(100, 0)([[1] * 100, [1] * 101]) == [0.0, -1.0]


def test_soft_overlong_punishment_is_trls_named_picklable_instance():
    fn = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert fn.__name__ == trl_rewards.get_soft_overlong_punishment(100, 20).__name__ == \
        "soft_overlong_punishment_reward"
    assert pickle.loads(pickle.dumps(fn))([[1] * 90]) == [-0.5]


def test_trl_grpo_instance_uses_the_scripts_fixed_arguments():
    """`trl grpo --reward_funcs get_soft_overlong_punishment` builds it with max_completion_len=1280,
    soft_punish_cache=256 (read from TRL's script, so a change there fails here): 1024 tokens -> 0.0,
    1152 -> (1024 - 1152) / 256 = -0.5, 1281 -> -1.0."""
    script = open(importlib.util.find_spec("trl.scripts.grpo").origin).read()
    assert '"get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, ' \
           'soft_punish_cache=256)' in script
    fn = trl_grpo_soft_overlong_punishment
    assert (fn.max_completion_len, fn.soft_punish_cache) == (1280, 256)
    assert fn([[0] * 1024, [0] * 1152, [0] * 1281]) == [0.0, -0.5, -1.0]


def test_import_stays_light():
    """groupwise.rewards imports math_verify only when a math reward is called."""
    code = "import sys, groupwise.rewards; print(sorted({'math_verify', 'latex2sympy2_extended'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
