"""use_vllm=True, vllm_mode="server" against the in-repo stand-in server (tests/vllm_standin/serve.py: the endpoints
TRL 1.16's client calls, served over real HTTP on localhost by the stand-in engine, with the weight-transfer group on
gloo instead of NCCL). vLLM itself cannot run here (no GPU): this checks the contract — requests, call sequence,
weights reaching the server after every optimizer step, errors — not vLLM."""

from __future__ import annotations

import copy
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from groupwise import GRPOConfig, GRPOTrainer
from groupwise.config_base import ConfigError
from groupwise.loading import check_combinations
from groupwise.tasks import toy
from groupwise.text import encode_prompts
from tests.conftest import small_args
from tests.launcher import free_port

STANDIN = str(Path(__file__).with_name("vllm_standin"))


def _drop_vllm_modules():
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.syspath_prepend(STANDIN)
    _drop_vllm_modules()
    import vllm as standin

    standin.ENGINES.clear()
    yield standin
    _drop_vllm_modules()


@pytest.fixture
def server(vllm, base_dir):
    from tests.vllm_standin.serve import StandinServer

    with StandinServer(base_dir) as s:
        yield s


def _server_args(tmp_path, url, **kw):
    return small_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                      vllm_group_port=free_port(), vllm_server_timeout=5.0, **kw)


def _generator(args, tokenizer):
    from groupwise.generation import build_generator

    return build_generator(args, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])


def _server_holds(server, named: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, named[n].detach().cpu()) for n, p in server.llm.hf.named_parameters())


def _length(completions, **_):
    return [float(len(c)) for c in completions]  # varied: every step moves the weights


def test_server_mode_trains_and_pushes_weights_after_every_step(tmp_path, base_dir, server):
    from groupwise.generation.vllm_server import VLLMServerGenerator

    args = _server_args(tmp_path, server.url, max_steps=2, max_completion_length=8)
    assert args.generation_backend == "vllm" and args.corrects_sampling
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
    gen = t.rollout_ctx.generator
    assert isinstance(gen, VLLMServerGenerator)
    # the weight-transfer group opens with the trainer (TRL's constructor opens it), before any push
    # (then the server's max_model_len is read, against the dataset's longest prompt)
    assert server.paths()[-2:] == ["/init_weight_transfer_engine", "/server_info"]
    assert gen.client.communicator is not None
    initial = {n: p.detach().clone() for n, p in server.llm.hf.named_parameters()}
    pushed = []
    original = gen.update_weights
    gen.update_weights = lambda m: (original(m), pushed.append(
        (_server_holds(server, dict(t.unwrapped.named_parameters())),
         any(not torch.equal(initial[n], p) for n, p in server.llm.hf.named_parameters()))))
    try:
        metrics = t.train()
    finally:
        gen.close()
    # before the first generation, then after each optimizer step, the server holds the policy's current weights;
    # the first push is the checkpoint the server loaded, after step 1 they have moved
    assert pushed == [(True, False), (True, True), (True, True)]
    assert server.updates == 3 and server.packed_in_init is True
    assert set(server.received) == {n for n, _ in t.unwrapped.named_parameters()}
    # TRL's sequence: connect, open the group once, then per push start / update / finish / reset the prefix cache
    # (groupwise reads /server_info once more, for the server's context)
    paths = server.paths()
    assert paths[:2] == ["/health", "/v1/models"]
    push = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert paths[2:10] == ["/server_info", "/get_world_size", "/init_weight_transfer_engine", "/server_info", *push]
    assert paths.count("/init_weight_transfer_engine") == 1 and paths.count("/update_weights") == 3
    init = next(body for _, p, body in server.requests if p == "/init_weight_transfer_engine")["init_info"]
    assert init == {"master_address": "127.0.0.1", "master_port": args.vllm_group_port, "rank_offset": 1,
                    "world_size": 2, "packed": True}
    # one request per round: each prompt once, n = num_generations, TRL's sampling fields
    requests = [body for _, p, body in server.requests if p == "/v1/completions"]
    assert len(requests) == 2
    for body in requests:
        assert len(body["prompt"]) == 2 and body["n"] == 4  # 8 rows = 2 prompts × 4 completions
        assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens",
                                     "logprobs", "return_token_ids", "return_tokens_as_token_ids")} == dict(
            temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=8, logprobs=0,
            return_token_ids=True, return_tokens_as_token_ids=True)
        assert body["model"] == base_dir
    # the server samples with the policy's numerics: its log-probs feed the importance weights, which are 1
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(metrics["sampling/sampling_logp_difference/max"]) < 1e-4


def test_a_completion_the_server_ends_without_eos_is_masked_to_its_length(tmp_path, base_dir, server):
    from tests.test_vllm import STOP, check_masked_to_lengths

    args = _server_args(tmp_path, server.url, max_completion_length=8, generation_kwargs={"stop_token_ids": STOP})
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8))
    try:
        comp = t._collect().round.completions
    finally:
        t.rollout_ctx.generator.close()
    check_masked_to_lengths(comp, server.llm.outputs, t.tokenizer.eos_token_id)


def test_the_server_s_log_probs_reach_the_importance_correction(tmp_path, base_dir, server):
    """`logprobs.token_logprobs` of each choice, prompt-major, is what the correction compares with the trainer's
    log-probs: were they lost (NaN) the weights would be 1 and the logged difference 0 whatever the server did."""
    args = _server_args(tmp_path, server.url, max_completion_length=6, temperature=0.7)
    t = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(8))
    try:
        comp = t._collect().round.completions
    finally:
        t.rollout_ctx.generator.close()
    body = [b for _, p, b in server.requests if p == "/v1/completions"][-1]
    assert body["temperature"] == 0.7 and body["logprobs"] == 0
    for row, mask, sampled in zip(comp.sampling_logps, comp.completion_mask.bool(), server.llm.sampled_logprobs,
                                  strict=True):
        assert torch.allclose(row[mask], torch.tensor(sampled)), (row, sampled)


@pytest.mark.parametrize("version", ["0.31.0+standin", "0.27.0"])
def test_greedy_completions_from_the_server_equal_the_policy_s(tmp_path, base_dir, server, vllm, monkeypatch,
                                                               tokenizer, version):
    """Weights pushed by either generation of vLLM's trainer API (vLLM ≥ 0.28: packed set at init; before: per
    update); the server then decodes greedily what the policy decodes greedily."""
    monkeypatch.setattr(vllm, "__version__", version)
    policy = toy.build_model(tokenizer, seed=0, hidden_size=32)
    with torch.no_grad():  # away from the checkpoint the server loaded: only a push makes them agree
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    args = _server_args(tmp_path, server.url, max_completion_length=12)
    gen = _generator(args, tokenizer)
    try:
        gen.update_weights(policy)
        assert _server_holds(server, dict(policy.named_parameters()))
        update = next(body for _, p, body in server.requests if p == "/update_weights")["update_info"]
        if version.startswith("0.27"):
            assert server.packed_in_init is None and update["packed"] is True
        else:
            assert server.packed_in_init is True and "packed" not in update
        assert update["names"] == [n for n, _ in policy.named_parameters()]
        assert update["dtype_names"] == ["float32"] * len(update["names"])
        prompts = [f"repeat {c}:" for c in "abcd"]
        ids, mask = encode_prompts(prompts, tokenizer, None)
        out = gen(policy, ids, mask, greedy=True)
    finally:
        gen.close()
    body = [b for _, p, b in server.requests if p == "/v1/completions"][-1]
    assert body["temperature"] == 0.0 and body["n"] == 1 and len(body["prompt"]) == 4
    eos = tokenizer.eos_token_id
    for i, prompt in enumerate(ids):
        ref = policy.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                              max_new_tokens=12, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        expected = ref[0, prompt.numel():].tolist()
        got = out.completion_ids[i].tolist()
        assert got[:len(expected)] == expected and all(x == tokenizer.pad_token_id for x in got[len(expected):])
    assert out.logprobs is None


def test_a_seed_in_generation_kwargs_samples_a_group_alike_in_both_modes(tmp_path, base_dir, server, vllm,
                                                                           tokenizer):
    """generation_kwargs={"seed": s} (TRL's example of a generation kwarg): server mode sends each group as one
    request with n = G, whose j-th sample vLLM seeds with s + j. Colocate mode sends one request per row; it seeds
    row j of each group s + j too, so a group's completions differ (were: G copies of one completion, every group's
    reward std 0) and equal server mode's, token for token."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(base_dir)  # the weights the server and the engine load
    ids, mask = encode_prompts([f"repeat {c}:" for c in "ab" for _ in range(4)], tokenizer, None)
    outs = []
    for mode in ("colocate", "server"):
        extra = dict(vllm_mode="server", vllm_server_base_url=server.url, vllm_group_port=free_port(),
                     vllm_server_timeout=5.0) if mode == "server" else {}
        args = small_args(tmp_path, use_vllm=True, generation_kwargs={"seed": 11}, max_completion_length=6, **extra)
        gen = _generator(args, tokenizer)
        try:
            outs.append(gen(policy, ids, mask).completion_ids)
            if mode == "server":  # a later tool turn's limit: the request's max_tokens
                assert gen(policy, ids[:4], mask[:4], max_new_tokens=2).completion_ids.size(1) <= 2
        finally:
            getattr(gen, "close", lambda: None)()  # the server's client holds a connection
    colocate, served = outs
    assert torch.equal(colocate, served)
    for group in colocate.view(2, 4, -1):
        assert len({tuple(row.tolist()) for row in group}) > 1  # not one completion four times
    body = [b for _, p, b in server.requests if p == "/v1/completions"][-1]
    assert body["n"] == 4 and body["seed"] == 11 and body["max_tokens"] == 2


def test_a_seed_shared_by_rows_of_one_prompt_sent_alone_is_warned_about(tmp_path, base_dir, server, tokenizer):
    """A request carries one seed: rows of one prompt that are not a whole group (a group split over processes, sent
    by each on its own) go with n = 1 and sample one completion: warned, once."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(base_dir)
    ids, mask = encode_prompts(["repeat b:"] * 2 + ["repeat c:"] * 4, tokenizer, None)
    gen = _generator(_server_args(tmp_path, server.url, generation_kwargs={"seed": 11}), tokenizer)
    try:
        with pytest.warns(UserWarning, match="generation_kwargs seed=11: rows of one prompt that are not whole groups"):
            gen(policy, ids, mask)
        gen(policy, ids, mask)  # once
    finally:
        gen.close()


def test_lora_policy_pushes_merged_weights_under_vllm_names(tmp_path, base_dir, server, tokenizer):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(toy.build_model(tokenizer, seed=0, hidden_size=32),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # adapters that change the merged weights
    gen = _generator(_server_args(tmp_path, server.url), tokenizer)
    try:
        gen.update_weights(policy)
    finally:
        gen.close()
    merged = copy.deepcopy(policy).merge_and_unload()
    assert _server_holds(server, dict(merged.named_parameters()))
    assert not any("lora" in n or "base_layer" in n for n in server.received)
    base = toy.build_model(tokenizer, seed=0, hidden_size=32)  # the adapters moved the server off the checkpoint
    assert any(not torch.equal(p, q) for p, q in zip(server.llm.hf.parameters(), base.parameters()))
    assert not any(hasattr(m, "merged") and m.merged for m in policy.modules())  # unmerged after the push


def test_unreachable_server_fails_within_the_timeout_naming_url_and_fix(tmp_path, base_dir, vllm):
    port = free_port()  # nothing listens there
    args = small_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
                      vllm_server_port=port, vllm_server_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        GRPOTrainer(base_dir, [toy.letter_reward], args=args, train_dataset=toy.dataset(4))
    assert time.monotonic() - start < 10  # model load + 1 s of retries, never forever
    message = str(e.value)
    assert f"http://127.0.0.1:{port}" in message and "after 1 s" in message
    assert "vllm serve" in message and "vllm_server_base_url" in message and "vllm_server_timeout" in message


def test_a_port_that_does_not_speak_http_fails_naming_the_url(tmp_path, monkeypatch):
    """vllm_server_port pointing at something else (here a service that greets like SSH): http.client raises
    BadStatusLine, an HTTPException and no OSError, which escaped the retry loop and every request as a bare
    traceback. Now: retried until vllm_server_timeout, then the ConnectionError naming the URL and the fix; any
    other request is retried as a broken connection (TRL's 6 tries), then names the URL, the tries and the error."""
    from groupwise.generation import vllm_server
    from groupwise.generation.vllm_server import VLLMServerClient

    monkeypatch.setattr(vllm_server, "sleep", lambda seconds: None)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    url = "http://127.0.0.1:%d" % listener.getsockname()[1]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionError) as e:
            VLLMServerClient(url, connection_timeout=1.0)
        assert time.monotonic() - start < 10
        assert f"can't be reached at {url} after 1 s" in str(e.value) and "BadStatusLine" in str(e.value)
        client = VLLMServerClient.__new__(VLLMServerClient)  # connected earlier; the port changed hands since
        client.base_url, client.request_timeout = url, 300.0
        with pytest.raises(ConnectionError, match=rf"vLLM server: GET {url}/v1/models failed after 6 tries: "
                                                  "BadStatusLine"):
            client._get("/v1/models")
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_transient_failures_of_the_server_are_retried_as_trl_retries_them(tmp_path, base_dir, server, tokenizer,
                                                                        monkeypatch):
    """TRL's session retries every request but /health (trl/generation/vllm_client.py:224-237; the retries
    themselves: tests/test_vllm_server_retry.py): a server that fails some requests as an overloaded or restarting
    vLLM does (5xx, a connection closed unanswered) costs tries, not the run."""
    from groupwise.generation import vllm_server

    waits = []
    monkeypatch.setattr(vllm_server, "sleep", waits.append)
    server.faults.update({"/v1/models": [503], "/start_weight_update": ["drop"], "/reset_prefix_cache": [502, 500],
                          "/v1/completions": ["drop", 503]})
    policy = toy.build_model(tokenizer, seed=0, hidden_size=32)
    gen = _generator(_server_args(tmp_path, server.url, max_completion_length=4), tokenizer)
    try:
        ids, mask = encode_prompts(["repeat a:", "repeat b:"], tokenizer, None)
        out = gen(policy, ids, mask)  # the first call pushes the weights, then generates
    finally:
        gen.close()
    tries = {p: server.paths().count(p) for p in server.faults}
    assert tries == {"/v1/models": 2, "/start_weight_update": 2, "/reset_prefix_cache": 3, "/v1/completions": 3}
    assert server.updates == 1 and _server_holds(server, dict(policy.named_parameters()))
    assert out.completion_ids.shape[0] == 2 and waits == [4.0, 4.0]  # no wait after a first failure, then 4 s


def test_a_failed_weight_push_is_not_retried_and_names_the_server_s_error_and_model(tmp_path, tokenizer, vllm):
    """/update_weights starts a collective: a retry would wait for a broadcast this process already finished (until
    ddp_timeout, 30 min by default) and hide the cause. A server started on another model fails the push once, with
    its error (the shapes) and the model it serves."""
    from groupwise.generation.vllm_server import VLLMServerError
    from tests.vllm_standin.serve import StandinServer

    other = tmp_path / "other"  # hidden 64 where the policy has 32
    toy.build_model(tokenizer, seed=1, hidden_size=64).save_pretrained(other)
    tokenizer.save_pretrained(other)
    policy = toy.build_model(tokenizer, seed=0, hidden_size=32)
    with StandinServer(str(other)) as server:
        gen = _generator(_server_args(tmp_path, server.url, ddp_timeout=60), tokenizer)
        start = time.monotonic()
        try:
            with pytest.raises(VLLMServerError, match=r"update_weights failed after 1 try: HTTP 500.*has shape "
                                                      r"\(52, 32\), the engine.s \(52, 64\).*"
                                                      rf"the server serves '{other}': it must be the policy's model"):
                gen.update_weights(policy)
        finally:
            gen.close()
        assert server.paths().count("/update_weights") == 1 and time.monotonic() - start < 30


def test_a_weight_group_the_server_refuses_at_once_is_its_error_not_a_rendezvous_timeout(tmp_path, tokenizer, vllm,
                                                                                         base_dir, server):
    """/init_weight_transfer_engine answered with an error at once (a 422 for the fields of another vLLM version, a
    500): the trainer used to open its end of the group anyway and wait at the rendezvous for a server that never
    comes (vLLM's store timeout, 300 s; the stand-in's 30 s) before reporting it. Now the server's error is raised
    within the 2 s grace, and no group is left open."""
    from groupwise.generation.vllm_server import VLLMServerError

    server.faults["/init_weight_transfer_engine"] = [422]
    gen = _generator(_server_args(tmp_path, server.url), tokenizer)
    start = time.monotonic()
    try:
        with pytest.raises(VLLMServerError, match=r"init_weight_transfer_engine failed after 1 try: HTTP 422"):
            gen.update_weights(toy.build_model(tokenizer, seed=0, hidden_size=32))
    finally:
        gen.close()
    assert time.monotonic() - start < 10 and gen.client.communicator is None
    assert server.paths().count("/init_weight_transfer_engine") == 1


def test_the_stand_in_takes_completion_fields_as_vllm_does(base_dir, server, caplog, monkeypatch):
    """vLLM's CompletionRequest allows extra fields (OpenAIBaseModel, extra="allow"): one it does not know is logged
    and ignored, not refused. A value vLLM refuses is a 400, final for the client (TRL retries only 500/502/503);
    a field vLLM applies but the stand-in cannot passes at vLLM's default and is refused (501) otherwise."""
    from groupwise.generation import vllm_server
    from groupwise.generation.vllm_server import VLLMServerClient, VLLMServerError

    monkeypatch.setattr(vllm_server, "sleep", lambda seconds: None)
    client = VLLMServerClient(server.url, request_timeout=30.0)
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.protocol"):
        out = client.generate([[5, 6]], n=2, max_tokens=3,
                              generation_kwargs={"do_sample": True, "ignore_eos": False, "stop": []})
    assert len(out["completion_ids"]) == 2
    assert "The following fields were present in the request but ignored: {'do_sample'}" in caplog.text
    for kwargs, status in [({"n": 0}, 400), ({"temperature": -1.0}, 400), ({"top_p": "high"}, 400),
                           ({"frequency_penalty": 0.5}, 501)]:
        before = server.paths().count("/v1/completions")
        with pytest.raises(VLLMServerError, match=rf"failed after 1 try: HTTP {status}: "):
            client.generate([[5, 6]], max_tokens=3, generation_kwargs=kwargs)
        assert server.paths().count("/v1/completions") == before + 1, kwargs


@pytest.mark.parametrize("kw, match", [
    (dict(dev_mode=False), "VLLM_SERVER_DEV_MODE=1"),
    (dict(weight_transfer=False), "--weight-transfer-config"),
])
def test_a_server_that_cannot_take_weights_says_how_to_start_it(tmp_path, base_dir, vllm, tokenizer, kw, match):
    from tests.vllm_standin.serve import StandinServer

    with StandinServer(base_dir, **kw) as server:
        gen = _generator(_server_args(tmp_path, server.url), tokenizer)
        with pytest.raises(RuntimeError, match=match):
            gen.update_weights(toy.build_model(tokenizer, seed=0, hidden_size=32))
        assert gen.client.communicator is None
        # a trainer says so as it is built (it opens the weight-transfer group then, as TRL's), not at its first push
        with pytest.raises(RuntimeError, match=match):
            GRPOTrainer(base_dir, [_length], args=_server_args(tmp_path, server.url), train_dataset=toy.dataset(8))
        assert "/v1/completions" not in server.paths()


def test_server_mode_config_is_checked_before_anything_loads(monkeypatch):
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server")
    assert cfg.generation_backend == "vllm"
    assert (cfg.vllm_server_base_url, cfg.vllm_server_host, cfg.vllm_server_port, cfg.vllm_server_timeout,
            cfg.vllm_group_port) == (None, "0.0.0.0", 8000, 240.0, 51216)  # TRL's defaults
    from groupwise.generation.vllm_server import server_url

    assert server_url(cfg) == "http://0.0.0.0:8000"
    assert server_url(GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_host="::1")) == "http://[::1]:8000"
    assert server_url(GRPOConfig(use_vllm=True, vllm_mode="server",
                                 vllm_server_base_url="http://gen-node:9000/")) == "http://gen-node:9000"
    with pytest.raises(ConfigError, match=r"vllm_server_base_url='gen-node:9000' must be an http\(s\) URL"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="gen-node:9000")
    with pytest.raises(ConfigError, match=r"vllm_server_base_url and vllm_server_port=9000 both say where the "
                                          r"server is .*: give one"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://a:9000", vllm_server_port=9000)
    with pytest.raises(ConfigError, match="vllm_server_port"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_port=70000)
    with pytest.raises(ConfigError, match="vllm_group_port"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_group_port=0)
    with pytest.raises(ConfigError, match="vllm_server_timeout"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=-1.0)
    # with several processes the others wait for the main one's connection in a collective: ddp_timeout must outlast
    # vllm_server_timeout, or they fail first without naming the server (one process: no collective, any value)
    GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=3600.0)
    with monkeypatch.context() as env:
        env.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match=r"^vllm_server_timeout=3600 s ≥ ddp_timeout=1800 s: .*raise ddp_timeout "
                                              r"above vllm_server_timeout$"):
            GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=3600.0, per_device_train_batch_size=8,
                       num_generations=8)
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_timeout=3600.0, ddp_timeout=7200.0,
                   per_device_train_batch_size=8, num_generations=8)
    # the colocated engine's settings have no effect on a server (TRL ignores them): a warning saying where they go
    with pytest.warns(UserWarning, match=r"vllm_gpu_memory_utilization=0.5 has no effect with vllm_mode='server'"
                                         r".*--gpu-memory-utilization"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_gpu_memory_utilization=0.5)
    with pytest.warns(UserWarning, match="vllm_tensor_parallel_size=2 has no effect"):
        GRPOConfig(use_vllm=True, vllm_mode="server", vllm_tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size=2 must divide the number of training processes"):
        GRPOConfig(use_vllm=True, vllm_tensor_parallel_size=2)  # colocate, 1 process
    # the server fields are read in server mode only: any value loads otherwise (TRL's dumps carry them)
    GRPOConfig(use_vllm=True, vllm_server_port=9000, vllm_server_base_url="http://a:1")
    GRPOConfig(vllm_mode="server", vllm_server_base_url="not a url")
    check_combinations(cfg, model="m", sharded=False, peft_config=None, optimizers=(None, None))


def test_each_prompt_of_a_group_is_sent_once_with_n_the_group_size():
    from groupwise.generation.vllm_server import repeats

    a, b = [5, 6], [7]
    assert repeats([a] * 4 + [b] * 4, (4, None)) == 4  # a training round: B prompts × G
    assert repeats([a] * 8, (4, None)) == 4  # the same prompt drawn twice in a round: still groups of G
    assert repeats([a, a, b, b], (4, 2)) == 2  # evaluation with num_generations_eval=2
    assert repeats([a, a, b, b], (4, None)) == 2  # runs of identical rows
    assert repeats([a, b, a], (4, None)) == 1 and repeats([a, a, b], (4, None)) == 1  # not groups: one by one


def test_import_and_config_never_import_vllm():
    code = ("import sys, groupwise; from groupwise import GRPOConfig; "
            "GRPOConfig(use_vllm=True, vllm_mode='server', vllm_server_base_url='http://x:1'); "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'vllm' or m.endswith('vllm_server')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_structured_outputs_reach_the_server_as_trl_sends_them(tmp_path, base_dir, server):
    """TRL's client sends {"structured_outputs": {"regex": …}} (generation_kwargs override it); the server's
    completions match the pattern."""
    import regex

    seen = []

    def record(completions, **_):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    args = _server_args(tmp_path, server.url, max_steps=1, vllm_structured_outputs_regex="[ab]+",
                        vllm_importance_sampling_correction=False)
    t = GRPOTrainer(base_dir, [record], args=args, train_dataset=toy.dataset(4))
    try:
        t.train()
    finally:
        t.rollout_ctx.generator.close()
    bodies = [body for _, p, body in server.requests if p == "/v1/completions"]
    assert bodies and all(b["structured_outputs"] == {"regex": "[ab]+"} for b in bodies)
    assert len(seen) == 8 and all(regex.fullmatch("[ab]+", c, partial=True) for c in seen)


@pytest.mark.slow
def test_two_training_processes_share_the_server_through_the_main_one(tmp_path, vllm):
    """TRL's multi-GPU layout: every process's prompts go to the main process, which alone sends them (one request
    per round, each prompt once with n = 4) and pushes the weights; each process trains on its own rows. The same
    server (same seed) answering the same requests, 2 processes train as 1 does. Evaluation, whose processes
    generate different numbers of batches, and the tool loop, whose processes run different numbers of turns, send
    each process's rows themselves (no collective to wait in)."""
    from tests.vllm_standin.serve import StandinServer
    from tests.vllm_worker import build_tool_model, check_two_train_as_one, launch, scripted_replies

    base_dir = tmp_path / "tool-model"
    tok = build_tool_model(base_dir)  # a tool-calling tokenizer, for the tool step
    results, requests, updates = {}, {}, {}
    for nproc in (1, 2):
        with StandinServer(str(base_dir)) as server:
            server.reply = scripted_replies(tok)
            results[nproc] = launch(tmp_path / str(nproc), nproc, {
                "VLLM_MODE": "server", "BASE_DIR": str(base_dir), "STANDIN_URL": server.url,
                "STANDIN_GROUP_PORT": str(free_port())})
            requests[nproc] = [body for _, p, body in server.requests if p == "/v1/completions"][:5]
            updates[nproc] = (server.updates - 2, server.paths().count("/init_weight_transfer_engine") - 1)
    # one request per round from the main process: 2 prompts × n = 4, the same in both runs; then the evaluation's
    assert len(requests[2]) == 2 + 3 and all(len(b["prompt"]) == 2 and b["n"] == 4 for b in requests[2][:2])
    assert [b["prompt"] for b in requests[2][:2]] == [b["prompt"] for b in requests[1][:2]]
    assert updates[1] == updates[2] == (3, 1)  # the first push, then after each step; one weight-transfer group
    # the same rows, rewards, losses, weights, evaluation metrics, failure messages and tool metrics as 1 process
    check_two_train_as_one(results, tmp_path, base_dir)
    # each process sent its own evaluation batches: 2 + 1 rows on one process and 2 on the other, 2 + 2 + 1 on one
    assert sorted(len(b["prompt"]) for b in requests[2][2:]) == sorted(len(b["prompt"]) for b in requests[1][2:]) \
        == [1, 2, 2]


@pytest.mark.slow
def test_fsdp2_pushes_the_gathered_weights_to_the_server_as_ddp_does(tmp_path, vllm):
    """vllm_mode="server" under FSDP2 (2 processes), full and LoRA: the main process pushes the unsharded replica,
    refreshed from the gathered shards (LoRA: the gathered adapters, merged for the push) after every step. Each run
    has its own server (seed 0), so DDP and FSDP2 runs get the same samples for the same weights: the server holds
    the same weights after each of the 4 pushes (the start, then each of the 3 steps) in both, those weights change
    at every step, the importance ratios are 1 (the server sampled with the policy's current weights: a stale push
    would read ≠ 1), and the trained weights are DDP's."""
    from safetensors.torch import load_file

    from tests.conftest import training_lines
    from tests.fsdp_support import runs
    from tests.vllm_standin.serve import StandinServer

    base = tmp_path / "base"  # the server's model: the workers' (toy.build_model, seed 0)
    toy.build_model(toy.build_tokenizer(), seed=0, hidden_size=32).save_pretrained(base)
    lora = dict(use_peft=True, lora_target_modules=["q_proj", "v_proj"])
    names = ("ddp", "fsdp", "ddp_lora", "fsdp_lora")
    servers = {name: StandinServer(str(base)).start() for name in names}
    pushed = {name: [] for name in names}
    for name, server in servers.items():  # the server's weights after every completed update
        def finish(server=server, log=pushed[name], done=server.finish_update):
            out = done()
            log.append({k: v.detach().clone() for k, v in server.llm.hf.state_dict().items()})
            return out
        server.finish_update = finish
    try:
        runs(*[dict(out=tmp_path / name, max_steps=3, save_steps=0, learning_rate=0.05, model_path=str(base),
                    use_vllm=True, vllm_mode="server", vllm_server_base_url=servers[name].url,
                    vllm_group_port=free_port(), **(lora if "lora" in name else {}),
                    **({"fsdp": "full_shard"} if "fsdp" in name else {})) for name in names])
    finally:
        for server in servers.values():
            server.stop()
    start = load_file(str(base / "model.safetensors"))
    for kind in ("", "_lora"):
        want, got = pushed[f"ddp{kind}"], pushed[f"fsdp{kind}"]
        assert len(want) == len(got) == 4
        assert all(torch.equal(want[0][n], start[n]) for n in start)  # the first push: the untrained policy
        for i in range(1, 4):  # each step moved the weights the server samples with
            assert any(not torch.equal(want[i][n], want[i - 1][n]) for n in start), (kind, i)
        for i in range(4):
            for n in want[i]:
                assert torch.allclose(want[i][n], got[i][n], atol=1e-5), (kind, i, n)
        for name in (f"ddp{kind}", f"fsdp{kind}"):
            lines = [json.loads(x) for x in training_lines(tmp_path / name / "metrics.jsonl")]
            ratio = [x["sampling/importance_sampling_ratio/mean"] for x in lines]
            assert ratio == pytest.approx([1.0] * 3, abs=1e-4), (name, ratio)
        trained = [load_file(str(tmp_path / f"{run}{kind}" / "weights.safetensors")) for run in ("ddp", "fsdp")]
        assert trained[0].keys() == trained[1].keys()
        for n in trained[0]:
            assert torch.allclose(trained[0][n], trained[1][n], atol=1e-5), (kind, n)


def test_the_server_s_context_limit_as_vllm_applies_it(tmp_path, vllm, base_dir, tokenizer):
    """A server started with --max-model-len 14 (the stand-in, as vLLM): 'repeat a:' is 9 tokens, so max_tokens 5
    fits and 8 is refused with vLLM's 400 (nothing is cut short), which groupwise's error shows. A trainer reads the
    server's max_model_len when it is built and refuses a dataset whose longest prompt + max_completion_length would
    meet that 400 mid-run. /server_info without config_format=json answers text (vLLM's default)."""
    import urllib.request

    import datasets
    from transformers import AutoModelForCausalLM

    from groupwise.data import StreamData
    from tests.vllm_standin.serve import StandinServer

    policy = AutoModelForCausalLM.from_pretrained(base_dir)
    ids, mask = encode_prompts(["repeat a:"], tokenizer, None)
    with StandinServer(base_dir, max_model_len=14) as server:
        server.reply = lambda prompt: [5] * 20  # never EOS: only max_tokens ends it
        for length in (5, 8):
            gen = _generator(_server_args(tmp_path, server.url, max_completion_length=length), tokenizer)
            try:
                if length == 5:
                    assert gen(policy, ids, mask).completion_ids[0].tolist() == [5] * 5
                else:
                    with pytest.raises(Exception, match=r"HTTP 400: .*You passed 9 input tokens and requested 8 "
                                                        r"output tokens\. However, the model's context length is only "
                                                        r"14 tokens"):
                        gen(policy, ids, mask)
            finally:
                gen.close()
        args = _server_args(tmp_path, server.url, max_completion_length=8)
        with pytest.raises(ConfigError, match=r"^train_dataset row 0: 9 prompt tokens \+ max_completion_length=8 "
                                              r"exceed the vLLM server's max_model_len=14 \(`vllm serve "
                                              r"--max-model-len`\); lower max_completion_length or max_prompt_length, "
                                              r"or raise the vLLM server's max_model_len$"):
            GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
        # a stream's rows, and a dataset given to evaluate(), are checked against it as they come
        args = _server_args(tmp_path, server.url, max_completion_length=5, max_steps=1)
        trainer = GRPOTrainer(base_dir, [_length], args=args, train_dataset=toy.dataset(12))
        try:
            long = [{"prompt": "repeat a: aa"}]  # 12 tokens + 5 > 14
            with pytest.raises(ConfigError, match=r"^eval_dataset row 0: 12 prompt tokens \+ max_completion_length=5 "
                                                  r"exceed the vLLM server's max_model_len=14"):
                trainer.evaluate(long)
            stream = StreamData(datasets.IterableDataset.from_generator(lambda: iter(long)), "train_dataset")
            trainer._check_lengths(stream)
            with pytest.raises(ConfigError, match=r"^train_dataset row 0: 12 prompt tokens \+ max_completion_length=5 "
                                                  r"exceed the vLLM server's max_model_len=14"):
                stream[0]
        finally:
            trainer.rollout_ctx.generator.close()
        text = json.loads(urllib.request.urlopen(server.url + "/server_info").read())["vllm_config"]
        assert isinstance(text, str) and "'max_model_len': 14" in text
