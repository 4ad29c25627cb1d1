"""A stand-in for the vLLM server TRL 1.16 trains against (`VLLM_SERVER_DEV_MODE=1 vllm serve <model>
--weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs`, which `trl vllm-serve` starts):
the endpoints TRL's VLLMClient calls, served over real HTTP by the stand-in engine (tests/vllm_standin/vllm: a
transformers model on the CPU), with the weight-transfer group on gloo instead of NCCL.

    GET  /health                          200 once the engine is up
    GET  /v1/models                       {"data": [{"id": <model>}]}
    GET  /server_info?config_format=json  {"vllm_config": {..., "weight_transfer_config": {"backend": "nccl"} | null}}
                                          (without config_format=json, vLLM's default "text": the config as a string)
    GET  /get_world_size                  {"world_size": 1} (the stand-in has one worker)
    POST /v1/completions                  {"model", "prompt": [[ids]…], "n", sampling fields, "logprobs",
                                           "return_token_ids", …} -> {"choices": [{"index", "prompt_token_ids",
                                           "token_ids", "logprobs": {"tokens": ["token_id:<id>"…], "token_logprobs",
                                           "top_logprobs"}, "finish_reason"}]} (prompt-major)
    POST /init_weight_transfer_engine     {"init_info": {master_address, master_port, rank_offset, world_size,
                                           packed?}}: joins the trainer's group as rank rank_offset
    POST /start_weight_update, /update_weights {"update_info": {names, dtype_names, shapes, packed?}},
         /finish_weight_update            receive the packed broadcast into the engine's model (load_weights)
    POST /reset_prefix_cache              200 with an empty body, as vLLM

A prompt and its max_tokens must fit `max_model_len` (default: the model's max_position_embeddings, as `vllm serve
--max-model-len`): vLLM answers 400 otherwise (its serving layer's token-length check).

As vLLM: `token_ids` / `prompt_token_ids` are null unless the request sets `return_token_ids`, the tokens are
"token_id:<id>" strings only with `return_tokens_as_token_ids`, and init_info / update_info must carry exactly the
fields of vLLM's NCCLWeightTransferInitInfo / UpdateInfo for the stand-in's `vllm.__version__` ("packed" in the
init info from 0.28, in each update's info before). Completion fields as vLLM's CompletionRequest (an OpenAIBaseModel,
extra="allow"): a field vLLM does not know is logged ("The following fields were present in the request but
ignored: …") and ignored; a sampling value vLLM's SamplingParams refuses (n=0, a negative temperature, a wrong type)
is a 400; a field vLLM knows but the stand-in cannot apply passes at vLLM's default value and is a 501 otherwise.

/server_info, /get_world_size and the weight endpoints are vLLM's development endpoints: with `dev_mode=False`
they answer 404, as vLLM does without VLLM_SERVER_DEV_MODE=1. Every request is recorded in `requests` (method,
path, JSON body) so tests can check the call sequence. Completions carry no text (groupwise reads token ids).
`faults[path]`: what the next requests to `path` get instead of their answer, one item each — an HTTP status (an
error answer, as a server that is overloaded or restarting gives) or "drop" (the connection closed unanswered).

In a test: `with StandinServer(model_dir) as server: ... server.url ...` (a thread of the test process). As a
process: `python tests/vllm_standin/serve.py <model> --port 8000`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "logprobs", "seed",
            "stop_token_ids", "structured_outputs")
IGNORED = ("model", "prompt", "return_token_ids", "return_tokens_as_token_ids", "user", "request_id", "session_id",
           "cache_salt", "priority", "skip_special_tokens", "spaces_between_special_tokens", "truncation_side",
           "stream_options", "stream_interval", "return_token_offsets", "return_mm_kwargs")
# the other fields of vLLM's CompletionRequest (vllm/entrypoints/openai/completion/protocol.py, 0.22-0.31), which the
# stand-in cannot apply: the values that change nothing (vLLM's defaults) pass, any other is refused (501)
INERT = {"echo": (None, False), "stream": (None, False), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
         "stop": (None, [], ""), "ignore_eos": (False,), "min_tokens": (0,), "include_stop_str_in_output": (False,),
         "use_beam_search": (False,), "length_penalty": (1,), "logit_bias": (None, {}), "allowed_token_ids": (None,),
         "bad_words": (None, []), "prompt_logprobs": (None,), "logprob_token_ids": (None,),
         "truncate_prompt_tokens": (None,), "add_special_tokens": (True,), "suffix": (None,),
         "watermarking": (None, False), "prompt_embeds": (None,), "response_format": (None,),
         "logits_processors": (None,), "kv_transfer_params": (None,),
         "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
         "thinking_token_budget": (None, -1), "routed_experts_prompt_start": (0,)}
log = logging.getLogger("vllm.entrypoints.openai.protocol")
# NCCLWeightTransferInitInfo / UpdateInfo's fields ("packed" moved from the update to the init info in vLLM 0.28)
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size")
UPDATE_FIELDS = ("names", "dtype_names", "shapes", "packed_buffer_size_bytes", "packed_num_buffers")
OPTIONAL_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class StandinServer:
    def __init__(self, model: str, *, host: str = "127.0.0.1", port: int = 0, weight_transfer: bool = True,
                 dev_mode: bool = True, seed: int = 0, max_model_len: int | None = None):
        import vllm  # the stand-in engine (tests/vllm_standin on sys.path)

        self.vllm = vllm
        self.model_name = model
        self.llm = vllm.LLM(model=model, seed=seed, logprobs_mode="processed_logprobs")
        self.max_model_len = max_model_len or self.llm.hf.config.max_position_embeddings
        self.weight_transfer, self.dev_mode = weight_transfer, dev_mode
        self.requests: list[tuple[str, str, dict | None]] = []
        self.faults: dict[str, list[int | str]] = {}  # path -> the next requests' failures (an HTTP status, "drop")
        self.lock = threading.Lock()  # the engine: generation and weight loads do not interleave
        self.communicator = None
        self.packed_in_init: bool | None = None
        self.updating = False
        self.updates = 0  # completed weight updates (start … finish)
        self.received: list[str] = []  # tensor names received, over all updates
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def reply(self):
        """Tests may script completions: prompt ids -> completion ids, or None to sample that prompt (the engine's
        LLM.reply)."""
        return self.llm.reply

    @reply.setter
    def reply(self, script) -> None:
        self.llm.reply = script

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandinServer:
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="vllm-standin-server", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.communicator = None

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def paths(self) -> list[str]:
        return [path for _, path, _ in self.requests]

    # ---- endpoints ----------------------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, body: dict | None):
        dev = {"/server_info", "/get_world_size", "/init_weight_transfer_engine", "/start_weight_update",
               "/update_weights", "/finish_weight_update", "/reset_prefix_cache"}
        if path in dev and not self.dev_mode:
            raise HTTPError(404, "Not Found")
        routes = {
            ("GET", "/health"): lambda: None,
            ("GET", "/v1/models"): lambda: {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "owned_by": "vllm", "root": self.model_name}]},
            ("GET", "/server_info"): lambda: self.server_info(query.get("config_format", ["text"])[-1]),
            ("GET", "/get_world_size"): lambda: {"world_size": 1},
            ("POST", "/v1/completions"): lambda: self.completions(body or {}),
            ("POST", "/init_weight_transfer_engine"): lambda: self.init_weight_transfer(body or {}),
            ("POST", "/start_weight_update"): lambda: self.start_update(),
            ("POST", "/update_weights"): lambda: self.update_weights(body or {}),
            ("POST", "/finish_weight_update"): lambda: self.finish_update(),
            ("POST", "/reset_prefix_cache"): lambda: self.llm.reset_prefix_cache() and None,
        }
        if (method, path) not in routes:
            raise HTTPError(404 if path not in {p for _, p in routes} else 405, f"{method} {path}")
        return routes[method, path]()

    def server_info(self, config_format: str) -> dict:
        if config_format not in ("text", "json"):  # vLLM's Literal["text", "json"] query parameter
            raise HTTPError(422, f"config_format: Input should be 'text' or 'json', got {config_format!r}")
        config = {"model_config": {"model": self.model_name, "logprobs_mode": "processed_logprobs",
                                   "max_model_len": self.max_model_len},
                  "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
                  "weight_transfer_config": {"backend": "nccl"} if self.weight_transfer else None}
        return {"vllm_config": config if config_format == "json" else str(config)}

    def completions(self, body: dict) -> dict:
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts)):
            raise HTTPError(400, "the stand-in server takes prompts as token ids: a list of lists of ints")
        if body.get("model") != self.model_name:
            raise HTTPError(404, f"The model `{body.get('model')}` does not exist.")
        unknown = set(body) - set(SAMPLING) - set(IGNORED) - set(INERT)
        if unknown:  # vLLM's OpenAIBaseModel.__log_extra_fields__: a warning, and the request goes on
            log.warning("The following fields were present in the request but ignored: %s", unknown)
        applied = {k: v for k, v in body.items() if k in INERT and not any(v == d for d in INERT[k])}
        if applied:
            raise HTTPError(501, f"the stand-in server does not implement {applied} (vLLM applies them)")
        try:
            fields = {k: body[k] for k in SAMPLING if body.get(k) is not None}
            if "structured_outputs" in fields:  # vLLM's request model builds StructuredOutputsParams from the dict
                from vllm.sampling_params import StructuredOutputsParams

                fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
            params = self.vllm.SamplingParams(**fields)
        except (TypeError, ValueError) as e:  # vLLM: a validation error, 400
            raise HTTPError(400, f"{type(e).__name__}: {e}") from None
        except NotImplementedError as e:
            raise HTTPError(501, str(e)) from None
        longest = max(len(p) for p in prompts)
        if longest + (params.max_tokens or 1) > self.max_model_len:  # vLLM's serving layer, before any generation
            raise HTTPError(400, f"You passed {longest} input tokens and requested {params.max_tokens} output tokens. "
                                 f"However, the model's context length is only {self.max_model_len} tokens.")
        with self.lock:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params,
                                        use_tqdm=False)
        eos = self.llm.hf.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        ids = bool(body.get("return_token_ids"))  # vLLM fills token_ids / prompt_token_ids only when asked
        choices = []
        for out in outputs:
            for c in out.outputs:
                logprobs = None
                if c.logprobs is not None:
                    as_ids = body.get("return_tokens_as_token_ids")
                    tokens = [f"token_id:{t}" if as_ids else f"<{t}>" for t in c.token_ids]  # no tokenizer here
                    values = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)]
                    logprobs = {"tokens": tokens, "token_logprobs": values, "text_offset": [0] * len(tokens),
                                "top_logprobs": [{tok: v} for tok, v in zip(tokens, values)]}
                finish = "stop" if c.token_ids and c.token_ids[-1] in eos else "length"
                choices.append({"index": len(choices), "text": "", "logprobs": logprobs, "finish_reason": finish,
                                "prompt_token_ids": list(out.prompt_token_ids) if ids else None,
                                "token_ids": list(c.token_ids) if ids else None})
        return {"id": f"cmpl-standin-{len(self.requests)}", "object": "text_completion", "model": self.model_name,
                "choices": choices}

    def init_weight_transfer(self, body: dict) -> dict:
        if not self.weight_transfer:
            raise HTTPError(400, "no weight-transfer engine: start the server with --weight-transfer-config")
        info = self._parse("init_info", body, INIT_FIELDS + (("packed",) if self._stateful() else ()))
        if info["world_size"] != 2 or info["rank_offset"] != 1:  # one worker, after the trainer's rank 0
            raise HTTPError(500, f"init_info: world_size {info['world_size']} / rank_offset {info['rank_offset']} "
                                 "do not place the server's 1 worker after the trainer")
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        # one worker: rank 0 of the server's workers is rank_offset in the trainer's group
        self.communicator = stateless_init_process_group(info["master_address"], int(info["master_port"]),
                                                         int(info["rank_offset"]), int(info["world_size"]), "cpu")
        self.packed_in_init = info.get("packed")
        return {}

    def _stateful(self) -> bool:
        """vLLM ≥ 0.28: `packed` is an init-info field, no longer an update-info one."""
        from packaging.version import Version

        return Version(self.vllm.__version__) >= Version("0.28.0")

    @staticmethod
    def _parse(key: str, body: dict, fields: tuple[str, ...]) -> dict:
        """vLLM builds its engine's init / update info dataclass from the dict (parse_init_info / parse_update_info):
        a missing or unknown field is an error."""
        info = body.get(key)
        if not isinstance(info, dict):
            raise HTTPError(400, f"the request body needs {key!r}")
        required = {f for f in fields if f not in OPTIONAL_FIELDS}
        if set(info) - set(fields) or required - set(info):
            raise HTTPError(500, f"Invalid {key} for NCCLWeightTransferEngine: got {sorted(info)}, takes "
                                 f"{sorted(fields)}")
        return info

    def start_update(self) -> dict:
        self.updating = True
        return {}

    def update_weights(self, body: dict) -> dict:
        if self.communicator is None:
            raise HTTPError(400, "call /init_weight_transfer_engine first")
        if not self.updating:
            raise HTTPError(400, "call /start_weight_update first")
        info = self._parse("update_info", body, UPDATE_FIELDS + (() if self._stateful() else ("packed",)))
        if not len(info["names"]) == len(info["dtype_names"]) == len(info["shapes"]):
            raise HTTPError(500, "update_info: `dtype_names` and `shapes` should be of the same size as `names`")
        packed = info.get("packed", self.packed_in_init)
        names, shapes, dtypes = info["names"], info["shapes"], [DTYPES[d] for d in info["dtype_names"]]
        loader = self.llm.llm_engine.model_executor.driver_worker.model_runner.model

        def load(pairs):
            with self.lock:
                loader.load_weights(pairs)
            self.received.extend(name for name, _ in pairs)

        if packed:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

            packed_nccl_broadcast_consumer(iter(zip(names, zip(shapes, dtypes))), self.communicator, 0, load,
                                           device="cpu")
        else:
            for name, shape, dtype in zip(names, shapes, dtypes):
                tensor = torch.empty(shape, dtype=dtype)
                self.communicator.broadcast(tensor, src=0)
                load([(name, tensor)])
        return {}

    def finish_update(self) -> dict:
        if not self.updating:
            raise HTTPError(400, "call /start_weight_update first")
        self.updating = False
        self.updates += 1
        return {}

    # ---- HTTP -----------------------------------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, method: str):
                parsed = urllib.parse.urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                faults = server.faults.get(parsed.path)
                fault = faults.pop(0) if faults else None
                try:
                    body = json.loads(raw) if raw.strip() else None
                    server.requests.append((method, parsed.path, body))
                    if fault == "drop":
                        self.close_connection = True
                        return
                    if fault is not None:
                        raise HTTPError(fault, f"injected fault: HTTP {fault}")
                    result = server.route(method, parsed.path, urllib.parse.parse_qs(parsed.query), body)
                    status, payload = 200, b"" if result is None else json.dumps(result).encode()
                except HTTPError as e:
                    status = e.status
                    payload = json.dumps({"object": "error", "message": str(e), "code": e.status}).encode()
                except Exception as e:  # noqa: BLE001 — the server's error answer, as vLLM's
                    status = 500
                    payload = json.dumps({"object": "error", "message": f"{type(e).__name__}: {e}",
                                          "code": 500}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        return Handler


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the stand-in `vllm`
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    a = parser.parse_args(argv)
    server = StandinServer(a.model, host=a.host, port=a.port)
    print(f"stand-in vLLM server for {a.model} on {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
