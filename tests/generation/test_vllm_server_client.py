"""VLLMServerGenerator against a recording client (no HTTP, no vLLM): what it asks the server and how it reads the
answer. The HTTP contract itself is tested against the stand-in server (tests/test_vllm_server.py)."""

import warnings

import pytest
import torch

from groupwise import GRPOConfig
from groupwise.generation.vllm_server import VLLMServerGenerator


class Client:
    base_url = "http://gen-node:8000"

    def __init__(self, logprobs_mode):
        self.logprobs_mode, self.info_calls = logprobs_mode, 0

    def get_server_info(self):
        self.info_calls += 1
        return {"model_config": {"model": "m", "logprobs_mode": self.logprobs_mode}}

    def generate(self, prompts, *, n, logprobs, generation_kwargs, **fields):
        rows = [[7, 8, 1] for _ in prompts for _ in range(n)]
        return {"prompt_ids": prompts, "completion_ids": rows, "logprobs": [[-0.5, -0.25, -1.0] for _ in rows]}


def _generator(mode):
    args = GRPOConfig(use_vllm=True, vllm_mode="server", num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=3)
    gen = VLLMServerGenerator(args, Client(mode), pad_token_id=0)
    gen.synced = True  # weights already pushed
    return gen


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logits"])
def test_server_log_probs_before_the_temperature_are_flagged_as_trl_does(mode):
    """vLLM's default `--logprobs-mode raw_logprobs` reports log-probs before the temperature (and the processors):
    compared with the trainer's log-probs at GRPOConfig.temperature they bias the importance correction. TRL 1.16
    warns, naming the flag; groupwise said nothing. Read once, and only when the log-probs are asked for."""
    gen = _generator(mode)
    ids, mask = torch.tensor([[5, 6], [5, 6]]), torch.ones(2, 2, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(None, ids, mask)  # no log-probs asked (no correction): nothing read, nothing said
    assert gen.client.info_calls == 0
    with pytest.warns(UserWarning, match=rf"The vLLM server at http://gen-node:8000 runs with `--logprobs-mode {mode}`"
                                         r", which biases the importance sampling correction\. Restart it with "
                                         r"`--logprobs-mode processed_logprobs`"):
        out = gen(None, ids, mask, logprobs=True)
    assert out.logprobs.tolist() == [[-0.5, -0.25, -1.0]] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(None, ids, mask, logprobs=True)
    assert gen.client.info_calls == 1


def test_a_server_with_processed_log_probs_passes_quietly():
    gen = _generator("processed_logprobs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen(None, torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), logprobs=True)
    assert gen.client.info_calls == 1


def test_completions_are_read_in_the_order_of_their_index():
    """The OpenAI completions answer numbers its choices (index = prompt · n + j); a server listing them in another
    order (they finish at different times) gave prompts other prompts' completions. Read by index; without indices,
    as listed (TRL)."""
    from groupwise.generation.vllm_server import VLLMServerClient

    client = VLLMServerClient.__new__(VLLMServerClient)
    client.model = "m"
    choices = [{"index": i, "token_ids": [10 + i], "prompt_token_ids": [i // 2]} for i in range(4)]
    client._post = lambda path, payload: {"choices": [choices[k] for k in (3, 0, 2, 1)]}
    out = client.generate([[0], [1]], n=2)
    assert out["completion_ids"] == [[10], [11], [12], [13]] and out["prompt_ids"] == [[0], [1]]
    client._post = lambda path, payload: {"choices": [{k: v for k, v in c.items() if k != "index"} for c in choices]}
    assert client.generate([[0], [1]], n=2)["completion_ids"] == [[10], [11], [12], [13]]
