"""A tiny Llama written as a real GGUF file, as llama.cpp's converter writes one (its q/k rows permuted, a byte-level
BPE vocabulary with merges, the chat template in the metadata), for the tests that load a policy from GGUF
(`model_init_kwargs: {gguf_file: …}`). Needs the `gguf` package (a dev dependency)."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ w", "a t", "Ġ 1", "Ġ 2"]  # each part a byte or an earlier merge
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (byte-level BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def vocabulary() -> tuple[list[str], list[str]]:
    """(tokens, merges): the special tokens, the 256 byte characters, then one token per merge."""
    tokens = SPECIALS + sorted(set(bytes_to_unicode().values()), key=lambda c: ord(c))
    return tokens + [m.replace(" ", "") for m in MERGES], list(MERGES)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (convert_hf_to_gguf's LlamaModel.permute), which transformers undoes on load."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(folder: Path, name: str = "tiny.gguf", seed: int = 0):
    """Write folder/name and return the transformers model it holds (float32, tied embeddings like SmolLM2)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, merges = vocabulary()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / name), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({
            f"blk.{i}.attn_q.weight": permute(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads),
            f"blk.{i}.attn_k.weight": permute(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
        })
    for key, value in tensors.items():
        writer.add_tensor(key, value.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
