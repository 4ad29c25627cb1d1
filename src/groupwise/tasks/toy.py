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
