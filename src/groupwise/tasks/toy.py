"""A tiny task that a randomly initialised character-level model learns in a minute on a CPU: the prompt names a
letter ("repeat c:"), the reward is the fraction of the completion's characters equal to that letter.

It also provides the tiny, real transformers model and `tokenizers` tokenizer that tests and examples build
in-process (nothing downloaded).
"""

from __future__ import annotations

import random

import torch

LETTERS = "abcdefgh"
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*/=:?.,()\n")


def build_tokenizer(pad_is_eos: bool = False):
    """A character-level fast tokenizer (offsets work: one character per token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<eos>", "<bos>"] if pad_is_eos else ["<pad>", "<eos>", "<bos>"]
    vocab = {tok: i for i, tok in enumerate(specials + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    pad = "<eos>" if pad_is_eos else "<pad>"
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=pad, eos_token="<eos>", bos_token="<bos>")


def build_model(tokenizer, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, max_positions: int = 256):
    """A tiny Llama with random weights (float32)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def dataset(n: int = 64, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"prompt": f"repeat {c}:", "letter": c} for c in (rng.choice(LETTERS) for _ in range(n))]


def letter_reward(completions, letter, **_) -> list[float]:
    """Fraction of the completion's characters equal to the prompt's letter (0 for an empty completion)."""
    out = []
    for text, c in zip(completions, letter):
        text = text if isinstance(text, str) else text[-1]["content"]
        out.append(text.count(c) / len(text) if text else 0.0)
    return out


REWARD_FUNCS = [letter_reward]


# A chat template in the tokenizer's characters: "user: …\nassistant:" (TRL's conversational prompts render with it)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def build_chat_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(folder: str, *, seed: int = 0) -> str:
    """A tiny chat model and its tokenizer saved to `folder` (from_pretrained-loadable); returns the folder. The
    TRL examples under examples/trl/ pass it where TRL's pass a hub id."""
    tokenizer = build_chat_tokenizer()
    build_model(tokenizer, seed=seed, max_positions=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def math_dataset(n: int = 8, seed: int = 0):
    """Conversational sums with a `solution` column, the shape of TRL's math datasets (a datasets.Dataset)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": [{"role": "user", "content": f"what is {a}+{b}?"}], "solution": str(a + b)})
    return Dataset.from_list(rows)


# ---- a tool-capable tokenizer (multi-turn rollouts with tools: groupwise.agents, docs/agents.md) -------------------
# A minimal chat template that lists tools, renders assistant tool calls as `<tool_call>{json}</tool_call>` (Qwen's
# format without the newlines) and tool results as their own turn; every turn ends with <|im_end|>, the EOS. It is
# prefix-preserving, and TOOL_RESPONSE_TEMPLATE (transformers' response-template format) parses the model's turns.
TOOL_TURNS_TEMPLATE = (  # the conversation after the tool list: every turn, then the generation prompt
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ {'name': tc.function.name, 'arguments': tc.function.arguments}"
    " | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CHAT_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
                      "<|im_end|>\n{% endif %}" + TOOL_TURNS_TEMPLATE)
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def build_tool_tokenizer(chat_template: str = TOOL_CHAT_TEMPLATE, words: list[str] | tuple[str, ...] = ()):
    """A byte-level tokenizer (one token per byte, no merges: any text encodes; 259 tokens) with <|im_end|> (EOS, the
    end of every turn), <|endoftext|> (pad) and <|im_start|>, `words` as single tokens (plain added tokens: matched
    anywhere, decoded as text), `chat_template` and TOOL_RESPONSE_TEMPLATE: what tool calling needs of a tokenizer
    (TRL's contract), nothing downloaded. save_pretrained keeps all of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                  "additional_special_tokens": ["<|im_start|>"]})
    if words:
        tokenizer.add_tokens(list(words))
    tokenizer.chat_template = chat_template
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def save_tiny_tool_model(folder: str, *, seed: int = 0) -> str:
    """A tiny model with the tool-capable tokenizer saved to `folder` (from_pretrained-loadable); returns the folder.
    examples/trl/tools.py passes it where TRL's example passes a hub id."""
    tokenizer = build_tool_tokenizer()
    build_model(tokenizer, seed=seed, max_positions=2048).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
