"""Generation with a vLLM server (TRL's `use_vllm=True, vllm_mode="server"`): a separate `vllm serve` process
samples; the trainer sends it prompts over HTTP and pushes the policy's weights to it.

It makes the calls TRL 1.16's client makes (trl/generation/vllm_client.py, VLLMClient, as GRPOTrainer drives it
through trl/generation/vllm_generation.py), with the standard library's HTTP client in place of requests:

connect    GET /health, retried every 2 s until vllm_server_timeout has passed (then a ConnectionError naming the URL
           and how to start the server); GET /v1/models: the served model's id, sent back with every request.
generate   POST /v1/completions {"model", "prompt": [[token id, …], …] (each prompt of a group once),
           "n": completions per prompt, "return_token_ids": true, "return_tokens_as_token_ids": true,
           "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens": max_completion_length,
           "logprobs": 0, **generation_kwargs} -> "choices", prompt-major: choice i·n + k is prompt i's k-th
           completion, with "token_ids" and "logprobs": {"token_logprobs": [log-prob of each sampled token]}.
weights    once, when the trainer is built (start(); a generator used alone: at its first push):
           GET /server_info?config_format=json (its vllm_config must have a weight_transfer_config),
           GET /get_world_size (W workers), then POST /init_weight_transfer_engine
           {"init_info": {"master_address": vllm's get_ip(), "master_port": vllm_group_port, "rank_offset": 1,
           "world_size": W + 1} (+ "packed": true from vLLM 0.28)} while this process joins the same group as rank 0
           (vLLM's trainer end of its NCCL weight-transfer engine). Each push: POST /start_weight_update {};
           POST /update_weights {"update_info": {"names", "dtype_names", "shapes"} (+ "packed": true before vLLM
           0.28)} while the tensors are broadcast packed over the group; POST /finish_weight_update {};
           POST /reset_prefix_cache. At exit the group is closed (its store and socket dropped, as TRL does).
context    when the trainer is built, after the group opens: GET /server_info?config_format=json once more, its
           model_config.max_model_len against the datasets' longest prompt + max_completion_length (check_context).
retries    every request but /health as TRL's session retries it (urllib3's Retry, RETRY_* below): a refused, broken
           or timed-out connection up to 6 tries, HTTP 500/502/503 up to 4 (and 413/429 with Retry-After), waiting
           Retry-After or 0, 4, 8, 16, 32 s between tries; any other answer is final. All the tries of one request
           together stay within request_timeout; then one error names the URL, the tries and the last failure.

The weights pushed are the policy's parameters under the names vLLM loads (TRL's `_iter_named_params` for an
unsharded model: a LoRA policy is merged for the push and unmerged after, adapters and `modules_to_save` copies
left out), before the first generation and after every optimizer step. With several training processes, as in TRL,
the main process alone talks to the server: it gathers every process's prompts (rank order is row order), sends one
request, and each process takes its own rows of the answer; it alone pushes the weights, which every process holds
alike; a failure on the main process stops every process.

vLLM must be installed in the training process too (the weight-transfer group is vLLM's). Nothing imports this
module until the backend is built. It is tested against the in-repo stand-in (tests/vllm_standin: serve.py serves
the stand-in engine over HTTP, its weight transfer runs a gloo group on the CPU), never against a real vLLM server.
"""

from __future__ import annotations

import atexit
import contextlib
import email.utils
import http.client
import json
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from groupwise.config_base import ConfigError
from groupwise.generation import Generated, repeats
from groupwise.generation.vllm import WeightTransfer, sampling_fields, vllm_named_weights, weight_transfer

START_SERVER = ("""VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}' """
                "--logprobs-mode processed_logprobs --max-logprobs -1")


# ---- retries: TRL 1.16's VLLMClient mounts urllib3's Retry(total=5, connect=5, read=5, status=3,
# status_forcelist=[500, 502, 503], backoff_factor=2, allowed_methods=["POST", "GET"]) on its requests session
# (trl/generation/vllm_client.py:224-237), so every request but GET /health (check_server's own loop) is retried.
RETRY_TOTAL = 5  # retries of any kind: at most 6 tries (connect=5 and read=5 never bind before it)
RETRY_STATUS = 3  # retries on an answer in STATUS_FORCELIST: at most 4 tries
STATUS_FORCELIST = frozenset({500, 502, 503})
RETRY_AFTER_STATUS_CODES = frozenset({413, 429, 503})  # urllib3: retried too when the answer carries Retry-After
BACKOFF_FACTOR = 2.0
BACKOFF_MAX = 120.0  # urllib3's Retry.DEFAULT_BACKOFF_MAX
RETRY_AFTER_MAX = 21600.0  # urllib3's Retry.DEFAULT_RETRY_AFTER_MAX
sleep = time.sleep  # the wait between tries (tests patch it)


def backoff(failures: int) -> float:
    """urllib3's Retry.get_backoff_time after `failures` consecutive failed tries: none after the first, then
    backoff_factor * 2 ** (failures - 1), at most BACKOFF_MAX: 0, 4, 8, 16, 32 s."""
    return 0.0 if failures <= 1 else min(BACKOFF_MAX, BACKOFF_FACTOR * 2 ** (failures - 1))


def retry_after(value: str | None) -> float | None:
    """urllib3's Retry.parse_retry_after: seconds, or an HTTP date; never negative, at most RETRY_AFTER_MAX. None when
    absent or unreadable (urllib3 raises InvalidHeader there; groupwise falls back to the backoff)."""
    if not value:
        return None
    if re.fullmatch(r"\s*[0-9]+\s*", value):
        seconds = float(int(value))
    else:
        date = email.utils.parsedate_tz(value)
        if date is None:
            return None
        seconds = email.utils.mktime_tz(date) - time.time()
    return min(max(seconds, 0.0), RETRY_AFTER_MAX)


def server_url(args) -> str:
    """TRL's rule: vllm_server_base_url when given, else http://{vllm_server_host}:{vllm_server_port}."""
    if args.vllm_server_base_url is not None:
        url = urllib.parse.urlparse(args.vllm_server_base_url)
        return f"{url.scheme or 'http'}://{url.netloc}{url.path}".rstrip("/")
    host = args.vllm_server_host
    return f"http://{f'[{host}]' if ':' in host else host}:{args.vllm_server_port}"


# ---- the client ---------------------------------------------------------------------------------------------------
class VLLMServerError(RuntimeError):
    """The server answered a request with an error status (one it is not retried on, or after the retries)."""


class VLLMServerClient:
    """TRL 1.16's VLLMClient calls, over urllib. `request_timeout`: seconds any one request may wait for its answer,
    its retries included (generation and weight pushes too); None waits as long as the server takes."""

    def __init__(self, base_url: str, *, group_port: int = 51216, connection_timeout: float = 0.0,
                 request_timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.group_port = group_port
        self.request_timeout = request_timeout
        self.communicator = None
        self.transfer: WeightTransfer | None = None
        self.check_server(connection_timeout)
        self.model = self._get("/v1/models")["data"][0]["id"]

    # -- HTTP
    def _request(self, method: str, path: str, payload: dict | None = None, *, timeout: float | None = None,
                 retry: bool = True) -> dict:
        """One request, retried as TRL's session retries it (RETRY_*, above): a connection refused, broken or timed out
        up to 6 tries, HTTP 500/502/503 (413/429 with Retry-After) up to 4, waiting Retry-After or the backoff
        between tries. Any other answer is final. All the tries together wait at most `timeout` (request_timeout).
        `retry=False`: one try, its failure final (a request that starts a collective: see _post_alongside)."""
        url = self.base_url + path
        data = None if payload is None else json.dumps(payload).encode()
        if method == "POST" and data is None:
            data = b""
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        timeout = timeout if timeout is not None else self.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        total, status, tries = (RETRY_TOTAL, RETRY_STATUS, 0) if retry else (0, 0, 0)

        def failed(last: str, stop: str = "") -> str:
            return f"vLLM server: {method} {url} failed after {tries} {'try' if tries == 1 else 'tries'}{stop}: {last}"

        while True:
            tries += 1
            left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
            request = urllib.request.Request(url, data=data, method=method, headers=headers)
            wait = None
            try:
                response = urllib.request.urlopen(request, timeout=left)
            except urllib.error.HTTPError as e:
                last, error, cause = f"HTTP {e.code}: {e.read().decode(errors='replace')[:2000]}", VLLMServerError, None
                after = (e.headers or {}).get("Retry-After")
                if not (e.code in STATUS_FORCELIST or (total and after and e.code in RETRY_AFTER_STATUS_CODES)):
                    raise VLLMServerError(failed(last)) from None  # the request itself is refused: not retried
                status -= 1
                wait = retry_after(after)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                # HTTPException: something answered that does not speak HTTP (a wrong port), or the connection broke
                last, error, cause = str(getattr(e, "reason", None) or f"{type(e).__name__}: {e}"), ConnectionError, e
            else:
                break
            total -= 1
            if total < 0 or status < 0:
                raise error(failed(last) + (" (is the vLLM server still running there?)" if cause else "")) from cause
            wait = wait or backoff(tries)
            if deadline is not None and time.monotonic() + wait >= deadline:
                raise error(failed(last, f" (retries stop at the request timeout, {timeout:g} s)")) from cause
            if wait > 0:  # urllib3 does not sleep a zero backoff
                sleep(wait)
        try:  # the body is read after the retries, as requests reads it after urllib3's
            with response:
                body = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise ConnectionError(failed(f"{type(e).__name__}: {e} (reading the answer)")) from e
        try:
            return json.loads(body) if body.strip() else {}
        except ValueError:
            raise VLLMServerError(f"vLLM server: {method} {url} answered something that is not JSON: "
                                  f"{body[:200]!r}") from None

    def _get(self, path: str, **kw) -> dict:
        return self._request("GET", path, **kw)

    def _post(self, path: str, payload: dict | None = None, **kw) -> dict:
        return self._request("POST", path, payload, **kw)

    def _post_alongside(self, path: str, payload: dict, work: Callable[[], None], grace: float = 0.0) -> dict:
        """POST while `work()` runs here: the server blocks in the collective the request starts until this process
        joins it (TRL sends the request from a thread the same way). The thread is a daemon: a request the server
        never answers cannot hold the process at exit. Sent once: a retry would start a second collective that this
        process, done with `work()`, never joins, and wait out the timeout instead of reporting the server's error
        (TRL's session retries it, then waits forever). `grace`: seconds to wait for an error answer before joining:
        a request the server refuses at once (a 404, a 422 for fields of another vLLM version) is then its error,
        where `work()` would wait for a peer that never comes (at the group's rendezvous: its store timeout)."""
        box: dict[str, Any] = {}

        def post():
            try:
                box["result"] = self._request("POST", path, payload, retry=False)
            except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
                box["error"] = e

        thread = threading.Thread(target=post, name=f"groupwise-vllm-server{path}", daemon=True)
        thread.start()
        thread.join(grace)
        if "error" in box:
            raise box["error"]
        work()
        thread.join(self.request_timeout)
        if "error" in box:
            raise box["error"]
        if thread.is_alive():
            raise TimeoutError(f"vLLM server: POST {self.base_url}{path} got no answer in {self.request_timeout} s")
        return box["result"]

    # -- connection
    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        """GET /health until it answers 200, for at most `total_timeout` seconds (one try when 0)."""
        url = f"{self.base_url}/health"
        deadline = time.monotonic() + total_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                request = urllib.request.Request(url, method="GET")
                with urllib.request.urlopen(request, timeout=max(1.0, min(remaining, 10.0))) as response:
                    if response.status == 200:
                        return
                    last = f"HTTP {response.status}"
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                last = str(getattr(e, "reason", None) or f"{type(e).__name__}: {e}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectionError(
                    f"The vLLM server can't be reached at {self.base_url} after {total_timeout:g} s "
                    f"(vllm_server_timeout; GET /health: {last}). Start it (on the GPUs that serve generation) with "
                    f"`{START_SERVER}` (or `trl vllm-serve --model <model>`), point vllm_server_base_url (or "
                    "vllm_server_host / vllm_server_port) at it, and raise vllm_server_timeout if it needs longer "
                    "to start.")
            time.sleep(min(retry_interval, remaining))

    def get_server_info(self) -> dict:
        try:
            return self._get("/server_info?config_format=json")["vllm_config"]
        except VLLMServerError as e:
            if "HTTP 404" in str(e):
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} does not expose its development endpoints, which weight "
                    "updates use. Restart it with VLLM_SERVER_DEV_MODE=1 in its environment.") from None
            raise

    def get_world_size(self) -> int:
        return int(self._get("/get_world_size")["world_size"])

    # -- generation
    def generate(self, prompts: list[list[int]], *, n: int = 1, repetition_penalty: float = 1.0,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 max_tokens: int = 16, logprobs: int | None = 0, generation_kwargs: dict | None = None) -> dict:
        """TRL's VLLMClient.generate for token-id prompts: {"prompt_ids", "completion_ids", "logprobs"} with n
        completions per prompt, prompt-major; logprobs[i][t] is the log-prob of completion i's t-th token (None
        when the server gave none)."""
        payload = {"model": self.model, "prompt": prompts, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, "n": n, "repetition_penalty": repetition_penalty,
                   "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                   "max_tokens": max_tokens, "logprobs": logprobs, **(generation_kwargs or {})}
        choices = self._post("/v1/completions", payload)["choices"]
        if len(choices) != len(prompts) * n:
            raise VLLMServerError(f"vLLM server: {len(choices)} completions for {len(prompts)} prompts × n={n}")
        if all(isinstance(c.get("index"), int) for c in choices):  # OpenAI's index: prompt · n + j (TRL: as listed)
            choices = sorted(choices, key=lambda c: c["index"])
        lps = []
        for choice in choices:
            values = (choice.get("logprobs") or {}).get("token_logprobs")
            lps.append(None if values is None else
                       [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values])
        return {"prompt_ids": [c.get("prompt_token_ids") for c in choices[::n]],
                "completion_ids": [list(c["token_ids"]) for c in choices], "logprobs": lps}

    # -- weights
    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """Open the weight-transfer group: the server's workers join it as ranks 1… while this process hosts it."""
        if self.get_server_info().get("weight_transfer_config") is None:
            raise VLLMServerError(f"The vLLM server at {self.base_url} has no weight-transfer engine. Restart it "
                                  """with `--weight-transfer-config '{"backend": "nccl"}'`.""")
        transfer = weight_transfer()
        from vllm.utils.network_utils import get_ip

        world_size = self.get_world_size() + 1  # the trainer joins the workers as an extra rank, rank 0
        init_info = {"master_address": get_ip(), "master_port": self.group_port, "rank_offset": 1,
                     "world_size": world_size}
        if transfer.packed_in_init:
            init_info["packed"] = True
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cuda":
            if device.index is not None:
                torch.cuda.set_device(device)  # vLLM builds the trainer's end on the current device
        elif not transfer.cpu:
            raise ConfigError(f"vllm_mode='server' pushes the weights over vLLM's NCCL weight-transfer engine, which "
                              f"needs a CUDA device; this process trains on {device}. Train on a GPU, or use "
                              "vllm_mode='colocate' / generation_backend 'fast'.")
        box: dict[str, Any] = {}
        self._post_alongside("/init_weight_transfer_engine", {"init_info": init_info},  # once: 2 s to refuse
                             lambda: box.setdefault("communicator", transfer.open(init_info)), grace=2.0)
        self.communicator, self.transfer = box["communicator"], transfer
        atexit.register(self.close_communicator)

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        """One weight update: the tensors are announced ((name, dtype, shape), in order), then broadcast."""
        names, dtype_names, shapes = (list(column) for column in zip(*metadata))
        update_info: dict[str, Any] = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
        if not self.transfer.packed_in_init:
            update_info["packed"] = True
        self._post("/start_weight_update", {})
        try:
            self._post_alongside("/update_weights", {"update_info": update_info},
                                 lambda: self.transfer.send(self.communicator, named_params))
        except VLLMServerError as e:  # most often a server started on another model than the policy
            raise VLLMServerError(f"{e} (the server serves {self.model!r}: it must be the policy's model, as "
                                  "`vllm serve` was started with it)") from None
        self._post("/finish_weight_update", {})

    def update_model_params(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.update_named_params([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named],
                                 iter(named))

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def close_communicator(self) -> None:
        """Drop the group: it holds a socket the server would keep waiting on (TRL's close_communicator)."""
        if self.communicator is not None:
            group = getattr(self.communicator, "group", None)
            if group is not None:
                group.store = None
                group.socket = None
            self.communicator = None


# ---- the backend ------------------------------------------------------------------------------------------------
class VLLMServerGenerator:
    @classmethod
    def from_config(cls, args, *, pad_token_id: int, eos_token_ids: list[int], dist=None) -> VLLMServerGenerator:
        """The main process's client (connected now); with several training processes the others have none: they
        send their prompts to the main process, which alone talks to the server (TRL's layout)."""
        from groupwise.generation.vllm import _vllm

        _vllm()  # the weight-transfer group is vLLM's: it must be installed here as well as on the server

        def connect():
            return None if dist is not None and not dist.is_main else cls.connect(args)

        client = connect() if dist is None else dist.run_together(connect, "connecting to the vLLM server")
        return cls(args, client, pad_token_id=pad_token_id, dist=dist)

    @staticmethod
    def connect(args) -> VLLMServerClient:
        return VLLMServerClient(server_url(args), group_port=args.vllm_group_port,
                                connection_timeout=args.vllm_server_timeout, request_timeout=args.ddp_timeout)

    def __init__(self, args, client: VLLMServerClient | None, *, pad_token_id: int, dist=None):
        self.args, self.client, self.pad_token_id, self.dist = args, client, pad_token_id, dist
        self.synced = False  # the server holds the policy's current weights
        self.logprobs_checked = False  # the server's logprobs mode was read (on the first call asking for log-probs)
        self.seed_warned = False  # the warning on a seed shared by rows of one prompt (__call__) was given
        self.alone = False  # within independently(): each process sends its own rows (evaluation)
        self.own: VLLMServerClient | None = None  # a non-main process's client, opened for independently()

    @contextlib.contextmanager
    def independently(self, model):
        """Each process sends its own rows to the server, without collectives: evaluation and the tool loop, whose
        processes make different numbers of calls (a process other than the main one then opens its own
        connection). Every process enters together: the server gets `model`'s weights first if it has not yet."""
        if not self.synced:
            self.update_weights(model)
        self.alone = True
        try:
            yield
        finally:
            self.alone = False

    def start(self, model) -> None:
        """Open the weight-transfer group with the trainer, as TRL's constructor does: a server that cannot take
        weights, or a process that cannot send them, is named before training rather than at the first push."""
        if self.client is not None and self.client.communicator is None:
            device = self.dist.device if self.dist is not None else next(model.parameters()).device
            self.client.init_communicator(device)

    def context_limit(self) -> int | None:
        """The server's max_model_len (`vllm serve --max-model-len`), read by the main process (None elsewhere): a
        prompt + max_tokens beyond it is refused with a 400, which would stop the run at that prompt."""
        if self.client is None:
            return None
        limit = (self.client.get_server_info().get("model_config") or {}).get("max_model_len")
        return None if limit is None else int(limit)

    def _client(self) -> VLLMServerClient | None:
        """Who sends this process's requests: the main process's client, or within independently() its own."""
        if self.client is not None or not self.alone:
            return self.client
        if self.own is None:
            self.own = self.connect(self.args)
        return self.own

    def update_weights(self, model) -> None:
        """Push the policy's current weights to the server (full tensors; a LoRA policy merged), from the main
        process: every process holds the same weights (data parallelism, or fsdp's gathered replica)."""
        def push():
            if self.client is None:
                return
            with vllm_named_weights(model) as named:
                if self.client.communicator is None:
                    self.client.init_communicator(named[0][1].device)
                self.client.update_model_params(named)
            self.client.reset_prefix_cache()

        if self.dist is not None and self.dist.world_size > 1:  # a failed push stops every process
            self.dist.run_together(push, "pushing the weights to the vLLM server")
        else:
            push()
        self.synced = True

    def close(self) -> None:
        if self.client is not None:
            self.client.close_communicator()

    def _check_logprobs_mode(self) -> None:
        """The importance correction compares the trainer's log-probs with the server's, which must be taken after
        the temperature (vLLM's default, raw_logprobs, is before it): a warning otherwise, as TRL 1.16 gives."""
        mode = (self.client.get_server_info().get("model_config") or {}).get("logprobs_mode")
        if mode is not None and mode != "processed_logprobs":
            warnings.warn(f"The vLLM server at {self.client.base_url} runs with `--logprobs-mode {mode}`, which biases "
                          "the importance sampling correction. Restart it with `--logprobs-mode processed_logprobs`, "
                          "or set vllm_importance_sampling_correction=False.", stacklevel=2)

    @torch.no_grad()
    def __call__(self, model, prompt_ids, prompt_mask, *, greedy: bool = False, logprobs: bool = False,
                 max_new_tokens: int | None = None) -> Generated:
        args = self.args
        if not self.synced:  # the server loaded the checkpoint; the policy may differ (a resumed run, adapters)
            self.update_weights(model)  # (never inside independently(), which syncs on entry)
        mine = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        several = self.dist is not None and self.dist.world_size > 1 and not self.alone
        # every process's rows, in rank order (= row order: each process holds a contiguous slice of the round)
        parts = self.dist.gather_object([mine]) if several else [mine]
        prompts = [p for part in parts for p in part]
        n = 1 if greedy else repeats(prompts, (args.num_generations, args.num_generations_eval))
        extra = sampling_fields(args, greedy, max_new_tokens)  # a later tool turn's limit: its process asks alone
        if args.vllm_structured_outputs_regex is not None:  # TRL's client: generation_kwargs override it
            extra.setdefault("structured_outputs", {"regex": args.vllm_structured_outputs_regex})
        named = {k: extra.pop(k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                           "max_tokens")}
        sent = prompts[::n]
        if extra.get("seed") is not None and len({tuple(p) for p in sent}) < len(sent) \
                and not self.seed_warned:  # one seed per request: a prompt sent twice samples the same n rows twice
            self.seed_warned = True
            warnings.warn(f"generation_kwargs seed={extra['seed']}: rows of one prompt that are not whole groups "
                          "here (a group split over processes, sent by each on its own in a tool loop or an "
                          "evaluation) share the seed, so they sample the same completion; drop the seed, or keep "
                          "groups whole per process (per_device_train_batch_size a multiple of num_generations)",
                          UserWarning, stacklevel=2)

        def ask():
            client = self._client()
            if client is None:
                return None
            if logprobs and not self.logprobs_checked and client is self.client:
                self.logprobs_checked = True
                self._check_logprobs_mode()
            out = client.generate(prompts[::n], n=n, logprobs=0, generation_kwargs=extra, **named)
            return {"completion_ids": out["completion_ids"], "logprobs": out["logprobs"]}

        if several:  # the main process asks; a failure stops every process; its answer goes to all
            out = self.dist.broadcast_object(self.dist.run_together(ask, "the vLLM server's generation"))
            start = sum(len(part) for part in parts[:self.dist.rank])
            out = {k: v[start:start + len(mine)] for k, v in out.items()}
        else:
            out = ask()
        return Generated.from_rows(out["completion_ids"], out["logprobs"] if logprobs else None, self.pad_token_id,
                                   prompt_ids.device)
