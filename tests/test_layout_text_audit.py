"""Audit of the batch arithmetic (groupwise.layout) and of prompt encoding (groupwise.text) against TRL 1.16.

Layout: TRL's GRPOConfig.__post_init__ derives steps_per_generation / generation_batch_size from
per_device_train_batch_size (completions), the number of processes (TrainingArguments.world_size, faked here by
patching that property) and gradient_accumulation_steps; its RepeatSampler + accelerate's BatchSamplerShard decide
which rows each process gets, and _prepare_inputs regenerates every steps_per_generation × num_iterations micro-steps.
Text: TRL's GRPOTrainer._tokenize_prompts (called on a stand-in `self`) is the reference for prompt token ids.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import PropertyMock, patch

import pytest
import torch

from groupwise import ConfigError, GRPOConfig
from groupwise.distributed import Distributed
from groupwise.text import encode_prompts, prompt_token_ids
from groupwise.update import windows

trl = pytest.importorskip("trl")


@contextmanager
def processes(world_size: int, monkeypatch):
    """WORLD_SIZE as torchrun exports it, for groupwise's construction-time check (removed again before TRL builds
    its config: TRL would try to start a real process group)."""
    with monkeypatch.context() as m:
        m.setenv("WORLD_SIZE", str(world_size))
        yield


def ours(world_size: int, monkeypatch, **kw):
    with processes(world_size, monkeypatch):
        args = GRPOConfig(**kw)
    return args, args.layout(world_size)


def theirs(world_size: int, **kw):
    """TRL 1.16's own GRPOConfig, its `world_size` (what __post_init__ reads as num_processes) faked."""
    import transformers

    with patch.object(transformers.TrainingArguments, "world_size", new_callable=PropertyMock,
                      return_value=world_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, bf16=False, **kw)


# (W processes, per_device B, G, gradient_accumulation_steps GA, num_iterations μ, the round field given)
#   → (steps_per_generation S, generation_batch_size, prompts per round, completions per process, optimizer steps
#      per round). Worked by hand: S = GA when neither field is given, else the given S, else gbs / (B · W);
#      gbs = B · W · S; prompts = gbs / G; per process = gbs / W = B · S; optimizer steps = S · μ / GA.
TABLE = [
    ((1, 8, 8, 1, 1, {}), (1, 8, 1, 8, 1)),  # TRL's defaults on one process: 8 · 1 · 1 = 8 = one group
    ((2, 8, 8, 1, 1, {}), (1, 16, 2, 8, 1)),  # 8 · 2 = 16 completions, 2 prompts; each process 8
    ((4, 8, 8, 1, 1, {}), (1, 32, 4, 8, 1)),  # 8 · 4 = 32, 4 prompts
    ((2, 4, 4, 2, 1, {}), (2, 16, 4, 8, 1)),  # S = GA = 2: 4 · 2 · 2 = 16, 4 prompts, 8 per process, 2·1/2 = 1
    ((4, 2, 4, 2, 2, {}), (2, 16, 4, 4, 2)),  # 2 · 4 · 2 = 16, per process 2 · 2 = 4, μ = 2: 2·2/2 = 2 steps
    ((4, 1, 2, 4, 1, {}), (4, 16, 8, 4, 1)),  # 1 · 4 · 4 = 16, 8 prompts, 4 per process, 4/4 = 1
    ((2, 3, 2, 1, 1, {}), (1, 6, 3, 3, 1)),  # 3 · 2 = 6 = 3 prompts: the middle group spans the 2 processes
    ((2, 4, 4, 1, 1, dict(steps_per_generation=3)), (3, 24, 6, 12, 3)),  # 4 · 2 · 3 = 24, 6 prompts, 3/1 = 3
    ((4, 3, 4, 1, 1, dict(steps_per_generation=4)), (4, 48, 12, 12, 4)),  # 3 · 4 · 4 = 48, 12 prompts
    ((1, 6, 3, 2, 1, dict(generation_batch_size=24)), (4, 24, 8, 24, 2)),  # S = 24 / 6 = 4; 4/2 = 2 steps
    ((2, 4, 8, 2, 1, dict(generation_batch_size=32)), (4, 32, 4, 16, 2)),  # S = 32 / (4 · 2) = 4; 4/2 = 2
    ((4, 2, 8, 1, 3, dict(generation_batch_size=16)), (2, 16, 2, 4, 6)),  # S = 16 / (2 · 4) = 2; 2·3/1 = 6
    ((4, 4, 16, 2, 1, dict(generation_batch_size=64)), (4, 64, 4, 16, 2)),  # S = 64 / 16 = 4
]


@pytest.mark.parametrize("case, expected", TABLE, ids=[f"W{c[0]}-B{c[1]}-G{c[2]}-GA{c[3]}-mu{c[4]}-{sorted(c[5])}"
                                                      for c, _ in TABLE])
def test_round_numbers_by_hand_and_as_trl_derives_them(case, expected, monkeypatch):
    W, B, G, GA, mu, given = case
    kw = dict(per_device_train_batch_size=B, num_generations=G, gradient_accumulation_steps=GA, num_iterations=mu,
              **given)
    args, lay = ours(W, monkeypatch, **kw)
    S, gbs, prompts, local, opt_steps = expected
    assert (lay.steps_per_generation, lay.generation_batch_size, lay.prompts_per_generation, lay.local_rows,
            lay.micro_batch_size, lay.world_size) == (S, gbs, prompts, local, B, W)
    assert (args.steps_per_generation, args.generation_batch_size) == (S, gbs)  # filled in, as TRL fills them
    # the optimizer steps of a round: windows() cuts this process's B · S rows into S micro-batches of B, μ times
    rows = SimpleNamespace(input_ids=torch.zeros(local, 1), rows=lambda a, b: (a, b))
    steps = windows(rows, lay.micro_batch_size, lay.steps_per_generation, mu, GA)
    assert len(steps) == opt_steps and all(len(s) == GA for s in steps)
    assert steps[0][0] == (0, B)  # the first micro-batch: rows [0, B) of this process
    t = theirs(W, **kw)
    assert (t.steps_per_generation, t.generation_batch_size, t.generation_batch_size // t.num_generations) == \
        (S, gbs, prompts)
    # TRL regenerates every S · μ micro-steps and steps the optimizer every GA: S · μ / GA optimizer steps a round
    assert t.steps_per_generation * mu / t.gradient_accumulation_steps == opt_steps


@pytest.mark.parametrize("W, B, G, S", [(2, 3, 2, 1), (4, 2, 4, 3), (2, 4, 8, 2), (4, 1, 2, 2)])
def test_each_process_gets_trls_rows(W, B, G, S, monkeypatch):
    """Which (prompt) rows each process generates for in a round: TRL's RepeatSampler (unshuffled) batched by
    per_device × steps_per_generation and split by accelerate's BatchSamplerShard, against groupwise's layout and
    Distributed.shard of the group-contiguous rows.
    E.g. W=2, B=3, G=2, S=1: 6 rows [0,0,1,1,2,2] → [0,0,1] | [1,2,2]."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler
    from trl.trainer.utils import RepeatSampler

    mu = 2
    _, lay = ours(W, monkeypatch, per_device_train_batch_size=B, num_generations=G, steps_per_generation=S,
                  gradient_accumulation_steps=1, num_iterations=mu)
    prompts = lay.prompts_per_generation
    data = list(range(prompts * 3))  # three rounds of prompts
    sampler = RepeatSampler(data, mini_repeat_count=G, batch_size=lay.generation_batch_size // G,
                            repeat_count=mu * S, shuffle=False)
    rows = [i for i in range(prompts) for _ in range(G)]  # groupwise: the round's prompts, each G times, contiguous
    for rank in range(W):
        shard = BatchSamplerShard(BatchSampler(sampler, B * S, drop_last=False), num_processes=W, process_index=rank)
        batches = list(shard)
        # TRL hands each process the same local generation batch μ · S times (one per micro-step), then the next
        assert batches[:mu * S] == [batches[0]] * (mu * S) and batches[mu * S] != batches[0]
        assert len(batches[0]) == lay.local_rows == B * S
        assert Distributed.shard(SimpleNamespace(world_size=W, rank=rank), rows) == batches[0]


# invalid combinations: TRL raises a ValueError, groupwise a one-line ConfigError naming the fields and a fix
# that works (the values in the comments are worked by hand)
INVALID = [
    # 6 · 1 · 1 = 6 completions, G = 4 → 6 % 4 ≠ 0; S = 2: 12 = 3 groups; B = 4: 4 = 1 group
    (1, dict(per_device_train_batch_size=6, num_generations=4), r"generation_batch_size=6 \(= "
     r"per_device_train_batch_size=6 × 1 process\(es\) × steps_per_generation=1\) must be divisible by "
     r"num_generations=4.*set steps_per_generation=2 \(generation_batch_size=12\), or per_device_train_batch_size to "
     r"one of \[4, 8, 12, 16\]"),
    # 2 processes: 3 · 2 · 1 = 6, G = 4 → S = 2 gives 12 = 3 groups; B ∈ {2, 4, 6, …}: 2 · 2 = 4
    (2, dict(per_device_train_batch_size=3, num_generations=4), r"generation_batch_size=6 .*3 × 2 process.*"
     r"steps_per_generation=2 \(generation_batch_size=12\), or per_device_train_batch_size to one of \[2, 4, 6"),
    # generation_batch_size 10 on 4 × 1: 10 % 4 ≠ 0 → 8 or 12
    # (TRL: "must be divisible by the global batch size (4)")
    (1, dict(per_device_train_batch_size=4, num_generations=4, generation_batch_size=10),
     r"generation_batch_size=10 must be divisible by per_device_train_batch_size × processes = 4 × 1 = 4: "
     r"set it to a multiple of 4 \(e\.g\. 8 or 12\)"),
    # the same 24 on 4 processes × 4: 24 % 16 ≠ 0 → 16 or 32
    (4, dict(per_device_train_batch_size=4, num_generations=4, generation_batch_size=24),
     r"= 4 × 4 = 16: set it to a multiple of 16 \(e\.g\. 16 or 32\)"),
    # generation_batch_size 8 = S 2 of 4 completions, G = 3: 8 % 3 ≠ 0 → 12 (S = 3), sized in the user's field
    (1, dict(per_device_train_batch_size=4, num_generations=3, generation_batch_size=8),
     r"generation_batch_size=8 .*divisible by num_generations=3.*"
     r"set generation_batch_size=12 \(steps_per_generation=3\)$"),
]


def test_the_batch_sizes_suggested_with_dynamic_sampling_pass_its_check_too(monkeypatch):
    """2 processes, B = 3, G = 4, dynamic_sampling: B ∈ {2, 6, …} makes the global batch whole groups but not each
    process's (2 completions per process); the suggestion offered 2, which the next check refused."""
    with processes(2, monkeypatch), pytest.raises(ConfigError, match=r"per_device_train_batch_size to one of "
                                                                    r"\[4, 8, 12, 16\]") as err:
        GRPOConfig(per_device_train_batch_size=3, num_generations=4, dynamic_sampling=True)
    for b in map(int, re.search(r"one of \[([\d, ]+)\]", str(err.value))[1].split(", ")):
        with processes(2, monkeypatch):
            GRPOConfig(per_device_train_batch_size=b, num_generations=4, dynamic_sampling=True)


@pytest.mark.parametrize("W, kw, match", INVALID)
def test_invalid_combinations_fail_like_trl_with_a_fix(W, kw, match, monkeypatch):
    with pytest.raises(ValueError):  # TRL refuses the same combination
        theirs(W, **kw)
    with processes(W, monkeypatch), pytest.raises(ConfigError, match=match) as err:
        GRPOConfig(**kw)
    msg = str(err.value)
    assert "\n" not in msg
    fixed = re.search(r"set (steps_per_generation|generation_batch_size)=(\d+)|set it to a multiple of \d+ \(e\.g\. "
                      r"(\d+)", msg)
    name, value = (fixed.group(1), fixed.group(2)) if fixed.group(1) else ("generation_batch_size", fixed.group(3))
    repaired = {k: v for k, v in kw.items() if k not in ("steps_per_generation", "generation_batch_size")}
    args, lay = ours(W, monkeypatch, **repaired, **{name: int(value)})
    theirs(W, **repaired, **{name: int(value)})  # and TRL takes the fix too
    assert lay.generation_batch_size % kw["num_generations"] == 0


def test_a_round_that_would_split_an_optimizer_step_is_refused_and_documented(monkeypatch):
    # 4 · 1 · S 2 = 8 completions a round, GA 4: TRL regenerates every 2 micro-steps and steps every 4, so one
    # optimizer step holds two generation rounds; groupwise refuses it (docs/trl_compat.md lists it) and proposes
    # S = 4 (generation_batch_size 16), or GA dividing 2 · 1
    kw = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=4, generation_batch_size=8)
    t = theirs(1, **kw)
    assert (t.steps_per_generation, t.generation_batch_size) == (2, 8)
    with pytest.raises(ConfigError, match=r"steps_per_generation × num_iterations = 2 × 1 must be a multiple of "
                                          r"gradient_accumulation_steps=4.*set generation_batch_size=16 "
                                          r"\(steps_per_generation=4\), or lower gradient_accumulation_steps to a "
                                          r"divisor of 2$"):
        GRPOConfig(**kw)
    # μ = 2 makes 2 · 2 = 4 micro-steps a round: whole optimizer steps again, accepted as TRL accepts it
    _, lay = ours(1, monkeypatch, **kw | dict(num_iterations=2))
    assert lay.steps_per_generation == 2
    doc = (Path(__file__).parents[1] / "docs" / "trl_compat.md").read_text()
    assert "not a multiple of `gradient_accumulation_steps`" in doc and "two generation batches" in doc


def test_both_round_fields_and_dynamic_sampling(monkeypatch):
    # TRL refuses both fields at once even when they agree; groupwise takes an agreeing pair (a TRL dump has both)
    kw = dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2, generation_batch_size=16)
    with pytest.raises(ValueError, match="can not be both configured"):
        theirs(2, **kw)
    assert ours(2, monkeypatch, **kw)[1].prompts_per_generation == 4  # 4 · 2 · 2 = 16 = 4 groups
    # dynamic sampling (groupwise's): 2 · S 2 = 4 completions per process with G = 8 → S = 4 gives 8 = one group
    with processes(2, monkeypatch), pytest.raises(ConfigError, match=r"4 completions per process "
                                                  r"\(per_device_train_batch_size=2 × steps_per_generation=2\).*"
                                                  r"set steps_per_generation=4 \(generation_batch_size=16\)$"):
        GRPOConfig(per_device_train_batch_size=2, num_generations=8, steps_per_generation=2, dynamic_sampling=True)


# ---- prompt text ---------------------------------------------------------------------------------------------------
# A template that starts with the BOS token (as Llama's do) and reads a template kwarg; the tokenizer also adds a BOS
# to plain text (a post-processor), so a doubled BOS would show.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if think is defined and think %}think\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def bos_tokenizer():
    from tokenizers import processors

    from groupwise.tasks import toy

    tok = toy.build_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tok.bos_token_id)])
    tok.chat_template = TEMPLATE
    return tok


def trl_prompt_ids(tok, prompts, chat_template_kwargs=None):
    """TRL 1.16's GRPOTrainer._tokenize_prompts (text model, no tools, no environments)."""
    me = SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=None,
                         chat_template=None, chat_template_kwargs=chat_template_kwargs or {})
    return [list(ids) for ids in trl.GRPOTrainer._tokenize_prompts(me, prompts)[0]]


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1+2?"}]
PROMPTS = {
    "plain": (["repeat a:", "what is 1+2?"], None, ["<bos>repeat a:", "<bos>what is 1+2?"]),
    "chat": ([CHAT], None, ["<bos>system: be brief\nuser: what is 1+2?\nassistant:"]),
    # TRL 1.16's text path adds the generation prompt after a final assistant message too (continue_final_message
    # only on its image path, which groupwise does not have)
    "assistant last": ([[{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]], None,
                       ["<bos>user: 1+2?\nassistant: 3\nassistant:"]),
    "chat_template_kwargs": ([CHAT], {"think": True},
                             ["<bos>system: be brief\nuser: what is 1+2?\nthink\nassistant:"]),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_prompt_ids_are_trls(name, bos_tokenizer):
    prompts, kwargs, texts = PROMPTS[name]
    ids = prompt_token_ids(prompts, bos_tokenizer, kwargs)
    assert ids == trl_prompt_ids(bos_tokenizer, prompts, kwargs)
    assert [bos_tokenizer.decode(i) for i in ids] == texts  # one BOS: the template's, or the tokenizer's for text
    assert all(i.count(bos_tokenizer.bos_token_id) == 1 for i in ids)


BLOCKS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}"
                   "{{ m['content'] }}{% elif m['content'] %}{% for b in m['content'] %}{{ b['text'] }}{% endfor %}"
                   "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_prompts_are_rendered_and_tokenized_in_one_call_as_trl(bos_tokenizer):
    """transformers' sanitize_control_tokens works only when the template call tokenizes (it raised "requires
    tokenize=True", then the dataset check refused every prompt); content blocks and an assistant turn with
    content None (a tool-call history) are rendered by the template, as TRL passes them on (they were refused)."""
    import copy

    from groupwise.data import prompt_problem

    tok = copy.deepcopy(bos_tokenizer)
    tok.chat_template = BLOCKS_TEMPLATE
    special = [{"role": "user", "content": "a<bos>b"}]  # a control token typed in the user's text
    kwargs = {"sanitize_control_tokens": True}
    ids = prompt_token_ids([special], tok, kwargs)
    assert ids == trl_prompt_ids(tok, [special], kwargs) and ids[0].count(tok.bos_token_id) == 1  # the template's
    assert prompt_token_ids([special], tok)[0].count(tok.bos_token_id) == 2  # without it: a real <bos> in the text
    blocks = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
              {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]
    assert prompt_problem(blocks) is None
    assert prompt_token_ids([blocks], tok) == trl_prompt_ids(tok, [blocks])
    # (transformers renders with trim_blocks: the newline after {% endif %} is dropped)
    assert tok.decode(prompt_token_ids([blocks], tok)[0]) == "<bos>user: hiassistant: user: goassistant:"
    assert "content None only for an assistant turn" in prompt_problem([{"role": "user", "content": None}])


def test_encode_prompts_left_pads_and_keeps_the_end(bos_tokenizer):
    from trl.trainer.utils import pad

    tok = bos_tokenizer
    prompts = ["repeat a:", CHAT]  # 1 + 9 = 10 tokens; the chat one is longer
    ref = [torch.tensor(i) for i in trl_prompt_ids(tok, [prompts[0]]) + trl_prompt_ids(tok, [prompts[1]])]
    ids, mask = encode_prompts(prompts, tok, None)
    # TRL pads on the left with the pad token, mask 0 there
    assert torch.equal(ids, pad(ref, padding_value=tok.pad_token_id, padding_side="left"))
    assert torch.equal(mask, pad([torch.ones_like(r) for r in ref], padding_value=0, padding_side="left"))
    assert mask[0].tolist() == [0] * (len(ref[1]) - 10) + [1] * 10
    # max_prompt_length 6 keeps the last 6 tokens (TRL's old truncation, `prompt_ids[:, -max_prompt_length:]`,
    # truncation_side="left"): "peat a:" loses "<bos>re" → "eat a:"; the chat one ends "?\nassistant:" → "stant:"
    ids, mask = encode_prompts(prompts, tok, 6)
    assert [tok.decode(r) for r in ids] == ["eat a:", "stant:"] and mask.all()
    # truncation happens before padding: a short prompt keeps its BOS and is left-padded to the longest kept row
    ids, mask = encode_prompts(["ab", "repeat a:"], tok, 6)
    assert tok.decode(ids[0][mask[0].bool()]) == "<bos>ab" and mask[0].tolist() == [0, 0, 0, 1, 1, 1]
