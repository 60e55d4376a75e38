"""A small inference server backed by specbatch, speaking the OpenAI and llama.cpp protocols on
loopback, with switches for known bug classes: what the server adapter and the checkers are tested
against (and a way to try `conform run --server` without installing an engine).

    with StubServer(target, draft) as server:          # http://127.0.0.1:<free port>
        ServerEngine(server.url, "openai")(prompts, budgets, eos, batch_size=4)

It batches like a server: requests that arrive within `window` seconds of each other and share
their settings run as one batch of specbatch.generate (ragged, speculative with `draft`). It
listens on 127.0.0.1 only and stops by itself after `lifetime` seconds.

Bugs (`BUGS`), each a mistake a real engine made or could make:

    eos-overrun    runs every request to its budget, past its EOS (SGLang 31599, transformers 47912)
    pad-mask       pads a batch with `pad_token_id` and masks `token == pad_token_id` (a pad id inside
                   a prompt is hidden too)
    shared-seed    ignores per-request seeds: every request of a batch draws the same stream
    wrong-top-p    applies top-k and top-p to the raw logits and the temperature after
    text-only      answers text, no token ids
    text-prompt    counts the prompt as text (its prompt-token count differs from the ids sent)
    drops-top-k    ignores top_k, and says so in llama.cpp's echoed settings
    processors-ignored  accepts penalties, logit_bias, min_tokens and min_p and applies none of them
                   (sgl-project/sglang issue 28180, NVIDIA/TensorRT-LLM PR 17701)
    draft-logprobs returns the draft's logprobs instead of the target's (the class of
                   ggml-org/llama.cpp issue 27972 and vllm-project/vllm issue 29216)

Processors (OpenAI's and vLLM's fields; llama.cpp's logit_bias and min_p) apply per request, so
requests with different processors share a batch.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUGS = ("eos-overrun", "pad-mask", "shared-seed", "wrong-top-p", "text-only", "text-prompt", "drops-top-k",
        "processors-ignored", "draft-logprobs")


class StubServer:
    """specbatch behind HTTP on 127.0.0.1 (a context manager; `url` once started)."""

    def __init__(self, target, draft=None, *, bug: str | None = None, pad_token_id: int | None = None,
                 window: float = 0.05, lifetime: float = 600.0):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; known: {', '.join(BUGS)}")
        if bug == "pad-mask" and pad_token_id is None:
            raise ValueError("bug 'pad-mask' needs the pad_token_id it pads with")
        self.target, self.draft, self.bug, self.pad = target, draft, bug, pad_token_id
        self.window, self.lifetime = window, lifetime
        self.inbox: queue.Queue = queue.Queue()
        self.batches: list[int] = []  # the size of every batch run, in order
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self._threads = [threading.Thread(target=self._http.serve_forever, daemon=True),
                         threading.Thread(target=self._batcher, daemon=True)]
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def __enter__(self):
        for t in self._threads:
            t.start()
        self._timer = threading.Timer(self.lifetime, self.close)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self.inbox.put(None)
            self._http.shutdown()
            self._http.server_close()
            self._timer.cancel()

    # ------------------------------------------------------------ one completion

    def complete(self, request: dict) -> dict:
        """Queue one request (prompt ids, budget, EOS ids, settings) and wait for its batch."""
        done: Future = Future()
        self.inbox.put((request, done))
        return done.result(timeout=self.lifetime)

    def _batcher(self) -> None:
        while not self._stop.is_set():
            first = self.inbox.get()
            if first is None:
                return
            waiting = [first]
            deadline = time.monotonic() + self.window
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self.inbox.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    return
                waiting.append(item)
            groups: dict = {}
            for request, done in waiting:
                key = (request["temperature"], request["top_k"], request["top_p"], tuple(request["eos"]))
                groups.setdefault(key, []).append((request, done))
            for group in groups.values():
                self._run(group)

    def _run(self, group) -> None:
        try:
            outputs = self._generate([r for r, _ in group])
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request threads
            for _, done in group:
                done.set_exception(e)
            return
        self.batches.append(len(group))
        for (_, done), tokens in zip(group, outputs):
            done.set_result(tokens)

    def _generate(self, requests: list[dict]) -> list[list[int]]:
        import specbatch

        from ..options import defaults
        from .sampled import PROCESSOR_KEYS
        from .testing import broken_sampling_engine, padded_batch_engine
        columns = {key: [r["processors"].get(key, getattr(defaults(), key)) for r in requests]
                   for key in PROCESSOR_KEYS if any(key in r["processors"] for r in requests)}
        if self.bug == "processors-ignored":
            columns = {}
        prompts = [r["prompt"] for r in requests]
        budgets = [r["budget"] for r in requests]
        first = requests[0]
        eos = [] if self.bug == "eos-overrun" else list(first["eos"])
        if self.bug == "pad-mask":
            return padded_batch_engine(self.target, self.pad, mask_from_pad=True)(prompts, budgets, eos, len(prompts))
        if not first["temperature"]:
            return specbatch.generate(self.target, self.draft, prompts, max_new_tokens=budgets, eos_token_id=eos,
                                      batch_size=len(prompts), **columns).sequences
        seeds = [0 if self.bug == "shared-seed" else r["seed"] for r in requests]
        top_k = None if self.bug == "drops-top-k" else first["top_k"]
        if self.bug == "wrong-top-p":
            engine = broken_sampling_engine(self.target, self.draft, "temperature-after-truncation")
            return engine(prompts, budgets, eos, len(prompts), temperature=first["temperature"], top_k=top_k,
                          top_p=first["top_p"], seeds=seeds)
        return specbatch.generate(self.target, self.draft, prompts, max_new_tokens=budgets, eos_token_id=eos,
                                  batch_size=len(prompts), temperature=first["temperature"], top_k=top_k,
                                  top_p=first["top_p"], seed=seeds, **columns).sequences

    def top_logprobs(self, prompt: list[int], answer: list[int], count: int) -> list:
        """[[token, logprob] x count, and the answer token's when it ranks lower] at every answer
        position, from one unpadded forward (raw: the model's log-softmax)."""
        from .greedy import _top_logits
        model = self.draft if self.bug == "draft-logprobs" and self.draft is not None else self.target
        every = _top_logits(model, prompt, answer, top=model.get_output_embeddings().weight.shape[0], log_softmax=True)
        # as vLLM: the top `count` and the chosen token's own, wherever it ranks
        return [top[:count] + [pair for pair in top[count:] if pair[0] == token] for top, token in zip(every, answer)]


def _complete(server: StubServer, body: dict, budget_key: str, eos: list) -> tuple[dict, list[int]]:
    """(request, new tokens) for a request body; ValueError (HTTP 400) for a prompt that is not ids."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ValueError("prompt must be a list of token ids")
    top_k = body.get("top_k")
    processors = {key: body[key] for key, default in (("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                                      ("frequency_penalty", 0.0), ("min_tokens", 0), ("min_p", 0.0))
                  if body.get(key) not in (None, default)}
    bias = body.get("logit_bias")
    if bias:  # OpenAI: {"id": bias}; llama.cpp: [[id, bias], ...]
        processors["logit_bias"] = {int(t): float(b) for t, b in (bias.items() if isinstance(bias, dict) else bias)}
    request = dict(prompt=prompt, budget=int(body.get(budget_key) or 16), eos=eos,
                   temperature=float(body.get("temperature", 1.0)), top_k=int(top_k) if top_k and top_k > 0 else None,
                   top_p=None if body.get("top_p", 1.0) >= 1.0 else float(body["top_p"]),
                   seed=int(body.get("seed") or 0), processors=processors)
    return request, [int(t) for t in server.complete(request)]


def _prompt_count(server: StubServer, request: dict) -> int:
    return len(request["prompt"]) * (3 if server.bug == "text-prompt" else 1)


def openai_reply(server: StubServer, body: dict) -> dict:
    """POST /v1/completions as vLLM answers it (the stop token id left out of the output)."""
    eos = list(body.get("stop_token_ids") or [])
    request, tokens = _complete(server, body, "max_tokens", eos)
    top = server.top_logprobs(request["prompt"], tokens, int(body["logprobs"])) if body.get("logprobs") else []
    finish, stop = "length", None
    if tokens and tokens[-1] in eos and server.bug != "eos-overrun":
        stop, finish = tokens.pop(), "stop"
    choice = dict(index=0, text=" ".join(map(str, tokens)), finish_reason=finish, stop_reason=stop)
    if server.bug != "text-only":
        choice["token_ids"] = tokens
    if body.get("logprobs"):
        names = [str(t) if server.bug == "text-only" else f"token_id:{t}" for t in tokens]
        choice["logprobs"] = dict(tokens=names, top_logprobs=[{f"token_id:{t}": v for t, v in p} for p in top])
    return dict(object="text_completion", choices=[choice],
                usage=dict(prompt_tokens=_prompt_count(server, request), completion_tokens=len(tokens)))


def llama_reply(server: StubServer, body: dict) -> dict:
    """POST /completion as llama-server answers it (no stop ids: it runs to n_predict here)."""
    request, tokens = _complete(server, body, "n_predict", [])
    settings = {k: body.get(k) for k in ("temperature", "top_k", "top_p", "n_predict", "min_p", "samplers")}
    if server.bug == "drops-top-k":
        settings["top_k"] = 40
    reply = dict(content=" ".join(map(str, tokens)), tokens=[] if server.bug == "text-only" else tokens,
                 stop_type="limit", generation_settings=settings, tokens_evaluated=_prompt_count(server, request))
    if body.get("n_probs"):
        count = int(body["n_probs"])  # as llama-server: the top n, and the chosen token's own logprob beside them
        top = server.top_logprobs(request["prompt"], tokens, count)
        reply["completion_probabilities"] = [
            dict(id=t, logprob=dict(p)[t], top_logprobs=[dict(id=a, logprob=b) for a, b in p[:count]])
            for t, p in zip(tokens, top)]
    return reply


def _handler(server: StubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self._send(200, {"status": "ok"} if self.path == "/health" else {"object": "list", "data": [
                {"id": "specbatch-stub", "object": "model"}]})

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except json.JSONDecodeError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            reply = {"/v1/completions": openai_reply, "/completion": llama_reply}.get(self.path)
            if reply is None:
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            try:
                self._send(200, reply(server, body))
            except ValueError as e:
                self._send(400, {"error": {"message": str(e)}})

        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
    return Handler
