"""A PRM read through its chat template, as Qwen2.5-Math-PRM is: system, the question as the user's turn, the steps
joined by its step token as the assistant's answer; a remote-code model (auto_map naming only AutoModel) loaded
from a local folder with trust_remote_code. Scores are checked against the model card's own procedure (render,
encode, softmax at every step token, class 1), written out here as a plain loop."""

from __future__ import annotations

import textwrap

import pytest
import torch

from groupwise.config_base import ConfigError
from groupwise.rewards.prm import TokenClassificationPRM, build_prm_input, load_prm
from groupwise.rewards.process import load_process_reward_sources
from groupwise.tasks import toy

# Qwen2.5's template: a default system turn when the conversation has none
TEMPLATE = ("{% if messages[0].role != 'system' %}<|im_start|>system\nPlease reason step by step.<|im_end|>\n"
            "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STEP = "<extra_0>"

MODELING = textwrap.dedent('''
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaModel, LlamaPreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast


    class TinyPRMConfig(LlamaConfig):
        model_type = "tiny_prm"


    class TinyProcessRewardModel(LlamaPreTrainedModel):  # Qwen2ForProcessRewardModel's shape: a 2-layer score head
        config_class = TinyPRMConfig

        def __init__(self, config):
            super().__init__(config)
            self.model = LlamaModel(config)
            self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(),
                                       nn.Linear(config.hidden_size, 2))
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return SequenceClassifierOutputWithPast(logits=self.score(hidden))
''')


def _tokenizer():
    tok = toy.build_tool_tokenizer(TEMPLATE)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", STEP]})
    return tok


@pytest.fixture
def qwen_like_prm(tmp_path):
    """A folder as Qwen2.5-Math-PRM's: config.json's auto_map names its own config and AutoModel class only."""
    import importlib.util

    folder = tmp_path / "tiny-math-prm"
    folder.mkdir()
    (folder / "modeling_tiny_prm.py").write_text(MODELING)
    spec = importlib.util.spec_from_file_location("modeling_tiny_prm_local", folder / "modeling_tiny_prm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tok = _tokenizer()
    config = module.TinyPRMConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    config.auto_map = {"AutoConfig": "modeling_tiny_prm.TinyPRMConfig",
                       "AutoModel": "modeling_tiny_prm.TinyProcessRewardModel"}
    torch.manual_seed(0)
    module.TinyProcessRewardModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _model_card_scores(model, tok, question, steps, system=None):
    """Qwen2.5-Math-PRM's model card, as a loop: the conversation rendered, encoded, softmax at each step token."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}, {"role": "assistant", "content": STEP.join(steps) + STEP}]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    step_id = tok.convert_tokens_to_ids(STEP)
    return [float(torch.softmax(logits[i], -1)[1]) for i, t in enumerate(ids) if t == step_id]


def test_a_remote_code_prm_read_through_its_chat_template_scores_as_its_model_card(qwen_like_prm):
    prm = load_prm(qwen_like_prm, "token_classification", trust_remote_code=True, chat_template=True,
                   separator=STEP, batch_size=2)
    assert type(prm.model).__name__ == "TinyProcessRewardModel"  # AutoModel: the class auto_map names
    questions = ["1+1?", "2+3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "4-1?"}]]
    steps = [["1+1=2", "so 2"], ["2+3=5", "5", "done"], ["4-1=3"]]
    got = prm(prompts=questions, completions=[""] * 3, steps=steps)  # two batches, padded rows among them
    for q, s, row in zip(questions, steps, got, strict=True):
        want = _model_card_scores(prm.model, prm.tokenizer, q if isinstance(q, str) else q[1]["content"], s,
                                  system=None if isinstance(q, str) else q[0]["content"])
        assert len(row) == len(s) and row == pytest.approx(want, abs=1e-5)
    # system_prompt: put first when the prompt has none (the card's system message); a prompt's own one wins
    with_system = load_prm(qwen_like_prm, "token_classification", trust_remote_code=True, chat_template=True,
                           separator=STEP, system_prompt="Use \\boxed{}.")
    got = with_system(prompts=questions, completions=[""] * 3, steps=steps)
    assert got[0] == pytest.approx(_model_card_scores(prm.model, prm.tokenizer, "1+1?", steps[0],
                                                      system="Use \\boxed{}."), abs=1e-5)
    assert got[2] == pytest.approx(prm(prompts=questions[2:], completions=[""], steps=steps[2:])[0], abs=1e-6)


def test_a_process_spec_sets_its_own_trust_remote_code_and_without_it_the_prm_is_named(qwen_like_prm):
    spec = {"path": qwen_like_prm, "kind": "token_classification", "chat_template": True, "separator": STEP}
    with pytest.raises(ConfigError, match="runs its own code.*trust_remote_code: true"):
        load_process_reward_sources([dict(spec)])
    (source,) = load_process_reward_sources([{**spec, "trust_remote_code": True}])
    assert source.fn(prompts=["1+1?"], completions=[""], steps=[["2"]])[0][0] is not None


def test_chat_template_positions_and_refusals(tokenizer):
    tok = _tokenizer()
    ids, pos = build_prm_input(tok, "q", ["a", "bc"], STEP, chat_template=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nPlease reason step by step.<|im_end|>\n<|im_start|>user\nq<|im_end|>")
    assert text.endswith(f"<|im_start|>assistant\na{STEP}bc{STEP}<|im_end|>\n")
    step_id = tok.convert_tokens_to_ids(STEP)
    assert [ids[p] for p in pos] == [step_id, step_id] and [i for i, t in enumerate(ids) if t == step_id] == pos
    model = torch.nn.Module()
    model.config = type("C", (), {"num_labels": 2})()
    model.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(ConfigError, match="prompt_separator=' ' is not read with chat_template"):
        TokenClassificationPRM(model, tok, chat_template=True, prompt_separator=" ")
    with pytest.raises(ConfigError, match="system_prompt='s' needs chat_template=True"):
        TokenClassificationPRM(model, tok, system_prompt="s")
    with pytest.raises(ConfigError, match="chat_template='yes' must be true or false"):
        TokenClassificationPRM(model, tok, chat_template="yes")
    with pytest.raises(ConfigError, match="has no chat template"):  # the char tokenizer has none
        build_prm_input(tokenizer, "q", ["a"], "\n", chat_template=True)
    # a template that refuses the conversation (Gemma's: no system turn) is named when the PRM is built, not at its
    # first score
    gemma = _tokenizer()
    gemma.chat_template = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}"
                           "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ConfigError, match="with chat_template=True: System role not supported"):
        TokenClassificationPRM(model, gemma, chat_template=True, system_prompt="s", separator=STEP)
    # and one that drops the separator, by its error
    gemma.chat_template = "{% for m in messages %}{{ m.content | trim }}|{% endfor %}"
    with pytest.raises(ConfigError, match="chat template changes the assistant turn's text"):
        TokenClassificationPRM(model, gemma, chat_template=True)
    tok.chat_template = "{% for m in messages %}{{ m.content | trim }}|{% endfor %}"  # strips the separator
    with pytest.raises(ValueError, match="chat template changes the assistant turn's text"):
        build_prm_input(tok, "q", ["a"], "\n", chat_template=True)
    # the steps' text also in the prompt ("1\n"): found in the user's turn by a search, it is named all the same
    with pytest.raises(ValueError, match="chat template changes the assistant turn's text"):
        build_prm_input(tok, "Check: 1\nthen 2", ["1"], "\n", chat_template=True)
    # Llama-3's and Gemma's templates trim every message: steps and a separator without outer whitespace are read
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>"
                         "{% endfor %}")
    ids, pos = build_prm_input(tok, " q ", ["1+1=2", "so 2"], STEP, chat_template=True)
    assert tok.decode(ids).endswith(f"<|im_start|>assistant\n1+1=2{STEP}so 2{STEP}<|im_end|>")
    assert [ids[p] for p in pos] == [tok.convert_tokens_to_ids(STEP)] * 2


def test_a_remote_code_prm_of_a_known_architecture_without_trust_remote_code_is_named(qwen_like_prm):
    """Qwen2.5-Math-PRM's config is model_type qwen2: transformers reads it without its code and AutoModel would give
    the plain base model (the score head unexpected keys), whose hidden states would have been read as logits."""
    import json
    from pathlib import Path

    config = Path(qwen_like_prm) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    with pytest.raises(ConfigError, match="runs its own code .*TinyProcessRewardModel.*trust_remote_code: true"):
        load_prm(qwen_like_prm, "token_classification", chat_template=True, separator=STEP)
    prm = load_prm(qwen_like_prm, "token_classification", chat_template=True, separator=STEP, trust_remote_code=True)
    from transformers import LlamaModel

    base = TokenClassificationPRM(LlamaModel(prm.model.config), prm.tokenizer, chat_template=True, separator=STEP)
    with pytest.raises(ValueError, match=r"returned \(1, \d+, 16\) where a token-classification PRM gives"):
        base(prompts=["q"], completions=[""], steps=[["a"]])
    # a transformers token classifier whose config kept such an auto_map (fine-tuned from one) loads as it is
    from transformers import LlamaForTokenClassification

    native = Path(qwen_like_prm).parent / "native"
    model = LlamaForTokenClassification(prm.model.config.__class__.__base__(**{
        k: v for k, v in prm.model.config.to_dict().items() if k not in ("auto_map", "architectures", "model_type")}))
    model.config.auto_map = {"AutoModel": "modeling_tiny_prm.TinyProcessRewardModel"}
    model.save_pretrained(native)
    prm.tokenizer.save_pretrained(native)
    loaded = load_prm(str(native), "token_classification", chat_template=True, separator=STEP)
    assert type(loaded.model).__name__ == "LlamaForTokenClassification"
    # a remote-code PRM whose config names no architectures: its auto_map's class is the model's
    unnamed = {k: v for k, v in json.loads(config.read_text()).items() if k != "architectures"}
    config.write_text(json.dumps(unnamed))
    with pytest.raises(ConfigError, match="runs its own code"):
        load_prm(qwen_like_prm, "token_classification", chat_template=True, separator=STEP)
    assert type(load_prm(qwen_like_prm, "token_classification", chat_template=True, separator=STEP,
                         trust_remote_code=True).model).__name__ == "TinyProcessRewardModel"


def test_a_prefix_classifier_reads_each_prefix_as_its_own_finished_conversation(tmp_path):
    """prefix_classification with chat_template: prefix j is the conversation whose assistant turn is steps 1..j with
    their separators, finished as the template finishes a turn (its end-of-turn token included), scored as a
    sequence classifier scores a whole conversation: checked against a loop over single forwards."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from groupwise.rewards.prm import PrefixClassificationPRM

    tok = _tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg).eval()
    prm = PrefixClassificationPRM(model, tok, chat_template=True, separator=STEP, batch_size=2)
    prompts, steps = ["1+1?", "2+3?"], [["1+1=2", "so 2"], ["2+3=5", "5", "done"]]
    got = prm(prompts=prompts, completions=["", ""], steps=steps)
    for q, own, row in zip(prompts, steps, got, strict=True):
        want = []
        for j in range(len(own)):
            text = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": STEP.join(
                own[:j + 1]) + STEP}], tokenize=False)
            assert text.endswith(f"{STEP}<|im_end|>\n")  # the finished turn
            ids = tok.encode(text, add_special_tokens=False)
            want.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
        assert row == pytest.approx(want, abs=1e-5)
    # past max_length: that prefix and the longer ones are unscored (None), as without a template
    short = PrefixClassificationPRM(model, tok, chat_template=True, separator=STEP,
                                    max_length=len(tok.encode(tok.apply_chat_template([
                                        {"role": "user", "content": "2+3?"},
                                        {"role": "assistant", "content": f"2+3=5{STEP}"}], tokenize=False),
                                        add_special_tokens=False)))
    with pytest.warns(RuntimeWarning, match="unscored"):
        row = short(prompts=prompts[1:], completions=[""], steps=steps[1:])[0]
    assert row[0] == pytest.approx(got[1][0], abs=1e-5) and row[1:] == [None, None]


def test_chat_template_is_refused_where_it_cannot_read_as_trained(tmp_path, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from groupwise.rewards.prm import PRM_CONFIG, PrefixClassificationPRM

    tok = _tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    with pytest.raises(ConfigError, match="chat_template='yes' must be true or false"):
        PrefixClassificationPRM(LlamaForSequenceClassification(cfg), tok, chat_template="yes")
    # a PRM `groupwise prm train` wrote (its recorded prompt_separator): trained on plain text, said so
    folder = tmp_path / "prm"
    LlamaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / PRM_CONFIG).write_text('{"kind": "token_classification", "separator": "\\n", "prompt_separator": "\\n"}')
    with pytest.raises(ConfigError, match="trained by `groupwise prm train` on plain text, without a chat template"):
        load_prm(str(folder), chat_template=True)
