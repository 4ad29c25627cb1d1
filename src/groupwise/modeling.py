"""Model-facing helpers: per-token log-probs of completions (compiled with torch_compile), eval mode, dropout."""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings

import torch

from groupwise.core.logprobs import entropy_from_logits, logps_from_hidden, selective_log_softmax

log = logging.getLogger(__name__)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:  # (N, L) → (N, L)
    """Positions count real tokens only, as in generate(): left padding must not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def accepts_kwarg(model, name: str) -> bool:
    """Does model.forward take `name`? (position_ids / logits_to_keep are not universal.) A PEFT wrapper (and
    torch.compile's) forwards its keyword arguments to the base model, so the base model's signature decides."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    fwd = getattr(model, "forward", model)
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def cache_keyword(model) -> str:
    """The keyword forward takes its KV cache by: `cache` from transformers 5.24 (where `past_key_values` is a
    deprecated alias, to be removed in 5.40), `past_key_values` before it and for models written without `cache`."""
    return "cache" if accepts_kwarg(model, "cache") else "past_key_values"


def completion_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (N, P + T)
    attention_mask: torch.Tensor,  # (N, P + T)
    num_completion_tokens: int,  # T
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_rows: int = 4,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (N, T) log-probs, (N, T) entropies or None
    """log π(o_t | q, o_<t) of each completion token, at the sampling temperature (logits / T, as in sampling).
    Logits are kept for the T+1 last positions only; log-softmax runs in row chunks."""
    T = num_completion_tokens
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's wrapper: the signature is the model's
    if accepts_kwarg(inner, "position_ids"):
        kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    if accepts_kwarg(inner, "logits_to_keep"):
        kwargs["logits_to_keep"] = T + 1
    logits = model(**kwargs).logits  # (N, ≤ L, V)
    logits = logits[:, -(T + 1):-1, :]  # position p predicts token p + 1 → (N, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -T:]
    logps = selective_log_softmax(logits, targets, chunk_rows=chunk_rows)
    entropies = None
    if compute_entropy and entropy_grad:
        entropies = entropy_from_logits(logits, chunk_rows=chunk_rows)
    elif compute_entropy:
        with torch.no_grad():
            entropies = entropy_from_logits(logits.detach(), chunk_rows=chunk_rows)
    return logps, entropies


class Float32Head(torch.nn.Linear):
    """An output head whose matmul runs in float32 outside autocast, whatever the hidden states' dtype. Called with
    `targets`, it returns the chunked log-probs (logps_from_hidden) instead of the logits: PolicyForLogps calls it
    so, through the module, so that under FSDP2 the head can be its own unit, gathered in float32 while the rest of
    the model is gathered in bfloat16 (groupwise.sharding.shard)."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None, **logps_kwargs):
        if targets is not None:
            return logps_from_hidden(hidden, self.weight, targets, bias=self.bias, head_fp32=True, **logps_kwargs)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), self.weight.float(),
                                              None if self.bias is None else self.bias.float())


def check_compile_backend(backend: str) -> None:
    """torch_compile_backend names one of torch.compile's registered backends (a ConfigError otherwise)."""
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        from groupwise.config_base import ConfigError

        raise ConfigError(f"torch_compile_backend={backend!r} is not a torch.compile backend: use one of "
                          f"{torch._dynamo.list_backends()}")


# what a model's forward does to lm_head's output before returning it, by the text config's model_type (prefix): the
# factor the logits are multiplied by (then Gemma-style softcapping, final_logit_softcapping, where the config has it)
LOGIT_SCALES = {
    "cohere": lambda cfg: cfg.logit_scale,  # Cohere, Cohere 2 (MoE), Command-R
    "granite": lambda cfg: 1.0 / cfg.logits_scaling,  # Granite 3 / 4, MoE, hybrid: logits / logits_scaling
    "minicpm3": lambda cfg: 1.0 / cfg.logits_scaling,  # the hidden states / logits_scaling, then a head without bias
    "hyperclovax": lambda cfg: cfg.logits_scaling,  # multiplies where Granite divides
    "falcon_h1": lambda cfg: cfg.lm_head_multiplier,
}


def logit_transform(model: torch.nn.Module) -> tuple[float, float | None]:
    """(scale, softcap): the model's logits are tanh(scale · lm_head(h) / softcap) · softcap (softcap None: no tanh).
    Read from the text config, where a multimodal model keeps them (Gemma 3 / 4: text_config)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    model_type = getattr(cfg, "model_type", "") or ""
    rule = next((f for prefix, f in LOGIT_SCALES.items() if model_type.startswith(prefix)), None)
    scale = rule(cfg) if rule is not None else None
    return float(1.0 if scale is None else scale), getattr(cfg, "final_logit_softcapping", None)


@torch.no_grad()
def head_reproduces_logits(model: torch.nn.Module, decoder, head, scale: float, softcap: float | None) -> bool:
    """Does the model's forward return transform(head(decoder's last hidden states)), as PolicyForLogps computes
    it? One forward of 8 tokens, the hidden states taken from inside it (a hook on the decoder), so the head sees the
    very tensor the model's own head saw: what remains is what the model does after lm_head (a scale, a softcap, a
    slice of the vocabulary …), compared at a relative 1e-2 (bfloat16's rounding of one operation is 4e-3; NaN
    where the model's logits are NaN counts as equal: weights gone bad are not a head mismatch). No random stream
    moves (eval mode, forked RNG)."""
    device = next(model.parameters()).device
    captured = []
    handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output[0] if isinstance(
        output, tuple) else output.last_hidden_state))
    vocab = head.weight.shape[0]
    ids = (torch.arange(1, 9, device=device) % vocab).unsqueeze(0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), eval_mode(model):
        try:
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
        finally:
            handle.remove()
        mine = head(captured[-1]).float() * scale
    if softcap is not None:
        mine = torch.tanh(mine / softcap) * softcap
    return mine.shape == logits.shape and bool(torch.allclose(mine, logits, rtol=1e-2, atol=1e-3, equal_nan=True))


def routed_head(head):
    """The module a PEFT ModulesToSaveWrapper (lm_head in `modules_to_save`) sends its forward through: the active
    adapter's trained copy, or the original head with adapters off (the reference) — as the wrapper's forward picks
    it, so that the chunked log-probs read that module's weight. Any other head is itself."""
    if not (hasattr(head, "modules_to_save") and hasattr(head, "original_module")):
        return head
    active = list(head.active_adapters)
    if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
        return head.original_module
    return head.modules_to_save[active[0]]


class PolicyForLogps(torch.nn.Module):
    """Wraps a causal LM so that one forward returns per-token log-probs of the completion, computed from the
    final hidden states with the output head applied in checkpointed chunks: the (N, T, V) logits never exist.
    Distributed wrappers (DDP) wrap this module, so gradient synchronisation still sees a single forward.
    Models whose head cannot be separated fall back to full logits (logged once). With `compile_kwargs`
    (GRPOConfig.torch_compile) the decoder (or, without a separable head, the whole model) runs through
    torch.compile; the compiled wrapper is not a submodule, so state_dict keys and checkpoints are unchanged."""

    def __init__(self, model: torch.nn.Module, chunk_tokens: int = 1024, compile_kwargs: dict | None = None):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.compile_kwargs = compile_kwargs
        self.__dict__["_compiled"] = {}  # id(module) → its torch.compile wrapper (kept out of the module tree)
        self.scale, self.softcap = logit_transform(model)
        head = routed_head(model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        # a head whose weight is the (V, H) matrix: a quantized one (bitsandbytes' Linear4bit / Linear8bitLt subclass
        # nn.Linear) keeps it packed — integers, or 4-bit pairs in a float storage — which the chunked matmul cannot read
        plain = isinstance(head, torch.nn.Linear) and head.weight.is_floating_point() and \
            tuple(head.weight.shape) == (head.out_features, head.in_features)
        self.chunked = plain and decoder is not None and decoder is not model
        if not self.chunked:
            if not model.__dict__.get("_groupwise_full_logits_said"):  # once per model (the reference is rewrapped)
                model.__dict__["_groupwise_full_logits_said"] = True
                warnings.warn(f"{type(model).__name__}: its output head ({type(head).__module__}."
                              f"{type(head).__name__}) cannot be applied in chunks (a LoRA-adapted lm_head: lm_head "
                              "in lora_target_modules; a quantized head; a weight stored transposed; no decoder "
                              "apart from the head): log-probs use the model's full (N, T, V) logits and "
                              "logprob_chunk_tokens has no effect (correct; more memory)", RuntimeWarning, stacklevel=3)
        else:
            self.chunked = self._head_checked(decoder, head)

    def _head_checked(self, decoder, head) -> bool:
        """head_reproduces_logits, once per model object (the reference model is wrapped at every batched_logps);
        a model whose logits it does not reproduce is warned about then, and uses the full logits."""
        key = (self.scale, self.softcap, id(head))  # (a PEFT-wrapped head: its trained copy, or the original)
        checked = self.model.__dict__.setdefault("_groupwise_head_checks", {})
        if key not in checked:
            checked[key] = head_reproduces_logits(self.model, decoder, head, self.scale, self.softcap)
            if not checked[key]:
                warnings.warn(f"{type(self.model).__name__}: its forward changes lm_head's output in a way groupwise "
                              "does not reproduce (modeling.LOGIT_SCALES): log-probs use the model's full logits "
                              "(correct; more memory than the chunked head)", RuntimeWarning, stacklevel=4)
        return checked[key]

    def forward(self, input_ids, attention_mask, num_completion_tokens: int, temperature: float = 1.0,
                compute_entropy: bool = False, entropy_grad: bool = False, aux_loss: bool = False):
        """(log-probs (N, T), entropies (N, T) or None), and with `aux_loss` a third item: the router
        load-balancing loss of a Mixture-of-Experts model, as its own forward computes it (differentiable)."""
        if not self.chunked:
            if aux_loss:
                raise ValueError(f"{type(self.model).__name__}: the router auxiliary loss needs a model whose output "
                                 "head is separable; set router_aux_loss_coef=0.0")
            return completion_logps(self._run(self.model), input_ids, attention_mask, num_completion_tokens,
                                    temperature=temperature, compute_entropy=compute_entropy,
                                    entropy_grad=entropy_grad)
        T = num_completion_tokens
        decoder, head = self.model.get_decoder(), routed_head(self.model.get_output_embeddings())  # adapters on/off
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": position_ids_from_mask(attention_mask), "use_cache": False}
        if aux_loss:
            hidden, aux = self._hidden_and_router_loss(decoder, inputs)
        else:
            hidden = self._run(decoder)(**inputs).last_hidden_state
        hidden = hidden[:, -(T + 1):-1, :]  # (N, T, H): position p predicts token p + 1
        kwargs = dict(temperature=temperature, softcap=self.softcap, scale=self.scale, chunk_tokens=self.chunk_tokens,
                      compute_entropy=compute_entropy, entropy_grad=entropy_grad)
        if isinstance(head, Float32Head):  # through the module (its own FSDP2 unit, when sharded)
            out = head(hidden, input_ids[:, -T:], **kwargs)
        else:
            out = logps_from_hidden(hidden, head.weight, input_ids[:, -T:], bias=head.bias, **kwargs)
        return (*out, aux) if aux_loss else out

    def _run(self, module: torch.nn.Module):
        """`module`, or its torch.compile wrapper (built once) when compiling."""
        if self.compile_kwargs is None:
            return module
        if id(module) not in self._compiled:
            self._compiled[id(module)] = torch.compile(module, **self.compile_kwargs)
        return self._compiled[id(module)]

    def _hidden_and_router_loss(self, decoder, inputs: dict):
        """The decoder's last hidden states and the model's own `aux_loss` (output_router_logits=True): the causal
        LM's forward runs, its logits kept for one position only, and a hook on the decoder takes the hidden states."""
        captured = []
        handle = decoder.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
        try:
            extra = {"logits_to_keep": 1} if accepts_kwarg(self.model, "logits_to_keep") else {}
            out = self.model(**inputs, output_router_logits=True, **extra)
        finally:
            handle.remove()
        if getattr(out, "aux_loss", None) is None:
            raise ValueError(f"{type(self.model).__name__} returned no aux_loss with output_router_logits=True: it is "
                             "not a Mixture-of-Experts model with a router loss; set router_aux_loss_coef=0.0")
        return captured[0], out.aux_loss


@torch.no_grad()
def batched_logps(model, input_ids, attention_mask, T: int, *, temperature: float, batch_size: int,
                  chunk_tokens: int = 1024) -> torch.Tensor:
    """No-grad log-probs in batches (old policy and reference model), through the same chunked head."""
    wrapped = model if isinstance(model, PolicyForLogps) else PolicyForLogps(model, chunk_tokens)
    out = [wrapped(input_ids[i:i + batch_size], attention_mask[i:i + batch_size], T, temperature=temperature)[0]
           for i in range(0, input_ids.size(0), batch_size)]
    return torch.cat(out, dim=0)


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Run a block with the model in eval mode (no dropout), restoring its train/eval state afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def embedding_rows(model) -> int:
    """How many token ids the model embeds: its input embeddings' rows (an adapter-wrapped embedding's base
    layer's; the config's vocab_size when the weight is not there to read)."""
    emb = model.get_input_embeddings()
    base = emb.get_base_layer() if hasattr(emb, "get_base_layer") else emb
    weight = getattr(base, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)
