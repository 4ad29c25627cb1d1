import pytest

from groupwise.tasks import arithmetic as A
from groupwise.tasks.splits import is_held_out


def test_solution_by_hand():
    # 8-10-20+1: 8-10 = -2; -2-20 = -22; -22+1 = -21
    assert A.solution_lines("8-10-20+1") == ["8-10=-2", "-2-20=-22", "-22+1=-21", "A: -21"]
    assert A.answer("8-10-20+1") == -21
    assert A.prompt_of("3+4") == "Q: 3+4\n"


def test_accuracy_checker():
    # the last non-empty line decides; spaces and a trailing newline are tolerated
    assert A.accuracy(["3+4=7\n7-2=5\nA: 5", "3+4=7\n7-2=5\nA: 6", "A:5\n", "", "3+4=7"], ["3+4-2"] * 5) == \
        [1.0, 0.0, 1.0, 0.0, 0.0]


def test_step_checker_locates_the_slip():
    # 3+4-2: true lines 3+4=7, 7-2=5, A: 5. A slip in line 1 (=8) makes line 2 wrong too (8-2=6 is not the
    # true line 7-2=5); the final answer 6 is wrong. An extra line after the answer is wrong by definition.
    assert A.judge_steps("3+4-2", ["3+4=7", "7-2=5", "A: 5"]) == [1.0, 1.0, 1.0]
    assert A.judge_steps("3+4-2", ["3+4=8", "8-2=6", "A: 6"]) == [0.0, 0.0, 0.0]
    assert A.judge_steps("3+4-2", ["3+4=7", "7-2=6", "A: 6"]) == [1.0, 0.0, 0.0]
    assert A.judge_steps("3+4-2", ["3 + 4 = 7", "7-2=5", "A: 5", "A: 5"]) == [1.0, 1.0, 1.0, 0.0]
    assert A.step_correct(completions=[""], steps=[["3+4=7"]], problem=["3+4-2"]) == [[1.0]]


def test_held_out_split_never_overlaps_training():
    train = A.problems(3000, split="train", seed=0)
    test = A.problems(200, split="test")
    assert not set(train) & set(test)
    assert all(is_held_out(p) for p in test) and not any(is_held_out(p) for p in train)
    assert A.problems(50, seed=3) == A.problems(50, seed=3) != A.problems(50, seed=4)  # seeded
    with pytest.raises(ValueError, match="split"):
        A.problems(1, split="dev")


def test_tokenizer_round_trip():
    tok = A.build_tokenizer()
    text = "Q: 12-30+4\n12-30=-18\nA: -14"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
