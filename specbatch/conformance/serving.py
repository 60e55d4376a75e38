"""Conformance vectors sent to a running inference server, its answers written for `conform check`.

An engine deployed as a server is judged like any other engine: `ServerEngine(url, api)` is an
engine of the kit's protocols (`generate_fn` for greedy vectors, `sample_fn` for sampled ones), so
`specbatch.conformance.testing.check_engine(ServerEngine(url), vectors)` works, and `run_vectors` sends a
folder of vectors (greedy or sampled) concurrently, appending each answer to an outputs file as it
arrives (`--resume` sends only what is missing).

Each request carries token ids, its budget, its EOS ids and its sampling settings, with every other
processor of the engine switched off explicitly. Protocols (`PROTOCOLS`):

    openai     POST /v1/completions (vLLM, SGLang, TGI and other OpenAI-compatible servers): the
               prompt as a list of ids, `stop_token_ids`, vLLM's `return_token_ids` (ids of the
               answer) and `return_tokens_as_token_ids` (ids in logprobs)
    llama.cpp  POST /completion (llama.cpp's llama-server): the prompt as a list of ids,
               `return_tokens`, the sampler chain ordered as the reference's (temperature, top-k,
               top-p), `cache_prompt` off

What a protocol cannot express is said, not hidden (`Protocol.limits`): llama.cpp's API takes no
stop token ids, so its answers are cut after the request's first EOS id here, and its own stopping
is then not judged.

Refusals are one line (`ServerError`): a server that cannot be reached after `retries`, one that
answers text without ids, one that did not take the prompt as ids (its prompt-token count differs),
one that refuses or (where it echoes its settings) changes a parameter.
"""
from __future__ import annotations

import json
import math
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from .greedy import _is_int
from .greedy import _token_list as _ids
from ..errors import UserError
from .sampled import PROCESSOR_KEYS


class ServerError(UserError):
    """A server that cannot be used for conformance, in one line."""


@dataclass
class Ask:
    """One completion to ask a server for."""
    id: str
    token_ids: list          # the prompt, as ids
    max_new_tokens: int
    eos_token_ids: list
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    processors: dict = field(default_factory=dict)  # PROCESSOR_KEYS and stop that are set (logit_bias: {id: bias})


@dataclass
class Answer:
    token_ids: list          # new tokens, the first EOS kept
    finish_reason: str       # "eos", "length" or what the server said
    top: list | None = None  # per new token [[token, logprob], ...], most likely first (when asked for)


# ---------------------------------------------------------------- protocols

class Protocol:
    """How one HTTP API asks for a completion and where its answer keeps the ids."""
    name = ""
    path = ""
    limits: tuple = ()  # settings of the vectors this API cannot express, in words
    supports: tuple = (*PROCESSOR_KEYS, "stop")  # the processors (and stop strings) a request can set

    def body(self, ask: Ask, logprobs: int, model: str | None) -> dict:
        raise NotImplementedError

    def answer(self, ask: Ask, reply: dict, asked: dict) -> Answer:
        raise NotImplementedError


def _top_from_openai(entries) -> list:
    """OpenAI logprobs' top_logprobs ({"token_id:N": logprob, ...} per position) as [[N, logprob], ...]."""
    out = []
    for position in entries or []:
        pairs = []
        for key, value in (position or {}).items():
            if not (isinstance(key, str) and key.startswith("token_id:")):
                raise ServerError("the server's logprobs name tokens by text, not by id (vLLM: it needs "
                                  "return_tokens_as_token_ids); run without --logprobs")
            pairs.append([int(key.removeprefix("token_id:")), float(value)])
        out.append(sorted(pairs, key=lambda p: -p[1]))
    return out


class OpenAIProtocol(Protocol):
    name, path = "openai", "/v1/completions"

    def body(self, ask, logprobs, model):
        body = dict(prompt=list(ask.token_ids), max_tokens=ask.max_new_tokens, temperature=float(ask.temperature),
                    top_p=1.0 if ask.top_p is None else float(ask.top_p), n=1, stream=False,
                    stop_token_ids=list(ask.eos_token_ids), ignore_eos=False, min_tokens=0, min_p=0.0,
                    repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, skip_special_tokens=False,
                    return_token_ids=True, return_tokens_as_token_ids=True)
        if ask.top_k is not None:
            body["top_k"] = int(ask.top_k)
        if ask.seed is not None:
            body["seed"] = int(ask.seed)
        body.update({key: value for key, value in ask.processors.items() if key != "logit_bias"})
        if ask.processors.get("logit_bias"):  # OpenAI's map from token id (a string) to bias
            body["logit_bias"] = {str(int(t)): float(b) for t, b in ask.processors["logit_bias"].items()}
        if logprobs:
            body["logprobs"] = int(logprobs)
        if model:
            body["model"] = model
        return body

    def answer(self, ask, reply, asked):
        choices = reply.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise ServerError("the server's reply has no single 'choices' entry (not an OpenAI completions reply)")
        choice = choices[0]
        prompt_tokens = (reply.get("usage") or {}).get("prompt_tokens")
        if isinstance(prompt_tokens, int) and prompt_tokens != len(ask.token_ids):
            raise ServerError(f"the server did not take the prompt as token ids: it counted {prompt_tokens} prompt "
                              f"tokens for request {ask.id!r} of {len(ask.token_ids)} ids")
        tokens = choice.get("token_ids")
        logprobs = choice.get("logprobs") or {}
        if tokens is None and logprobs.get("tokens"):
            tokens = [int(t.removeprefix("token_id:")) if isinstance(t, str) and t.startswith("token_id:") else None
                      for t in logprobs["tokens"]]
            tokens = None if None in tokens else tokens
        if not _ids(tokens):
            raise ServerError("the server answered text without token ids (an OpenAI server must return them: "
                              "vLLM's return_token_ids or logprobs with return_tokens_as_token_ids)")
        tokens = [int(t) for t in tokens]
        eos = set(ask.eos_token_ids)
        finish = choice.get("finish_reason")
        stop = choice.get("stop_reason")
        if finish == "stop" and _is_int(stop) and stop in eos and (not tokens or tokens[-1] not in eos):
            tokens.append(int(stop))  # vLLM leaves out the stop token id that ended it; the oracle keeps it
        top = _top_from_openai(logprobs.get("top_logprobs")) if asked.get("logprobs") else None
        return Answer(tokens, "eos" if tokens and tokens[-1] in eos else str(finish), top)


class LlamaCppProtocol(Protocol):
    name, path = "llama.cpp", "/completion"
    limits = ("stop token ids: llama.cpp's API takes none, so each answer is cut after the request's first EOS "
              "id here (the model's own end-of-generation tokens still stop it); tokens an engine emitted past "
              "one of the vectors' extra EOS ids are not seen",
              "end-of-generation tokens: llama.cpp stops at every token of the model's end-of-generation set, "
              "which a request cannot turn off; where that set holds ids the vectors do not count as EOS (SmolLM2: "
              "<|endoftext|>, id 0, beside <|im_end|>, id 2), make sampled vectors with --eos-ids naming them all",
              "processors: llama.cpp takes logit_bias and min_p; it has no min_tokens, its penalties count a "
              "window of recent tokens, prompt included, not OpenAI's new tokens, and its stop strings are not "
              "known to end at the token that completes them, so requests with penalties, min_tokens or stop "
              "strings are left out")
    supports = ("logit_bias", "min_p")
    # settings echoed in `generation_settings` that must come back as sent
    ECHOED = ("temperature", "top_k", "top_p", "n_predict", "seed", "min_p", "samplers")

    def body(self, ask, logprobs, model):
        body = dict(prompt=list(ask.token_ids), n_predict=ask.max_new_tokens, temperature=float(ask.temperature),
                    top_k=0 if ask.top_k is None else int(ask.top_k),
                    top_p=1.0 if ask.top_p is None else float(ask.top_p), min_p=0.0, typical_p=1.0,
                    repeat_penalty=1.0, repeat_last_n=0, presence_penalty=0.0, frequency_penalty=0.0,
                    dry_multiplier=0.0, xtc_probability=0.0, mirostat=0, dynatemp_range=0.0, ignore_eos=False,
                    samplers=["temperature", "top_k", "top_p"], return_tokens=True, cache_prompt=False,
                    stream=False, n_probs=int(logprobs or 0), post_sampling_probs=False)
        unsupported = sorted(set(ask.processors) - set(self.supports))
        if unsupported:
            raise ServerError(f"request {ask.id!r}: llama.cpp's API cannot express {', '.join(unsupported)}")
        if ask.processors.get("min_p"):  # after top-p, as the reference orders it
            body["min_p"], body["samplers"] = float(ask.processors["min_p"]), [*body["samplers"], "min_p"]
        if ask.processors.get("logit_bias"):  # applied to the raw logits, before every sampler
            body["logit_bias"] = [[int(t), float(b)] for t, b in ask.processors["logit_bias"].items()]
        if ask.seed is not None:
            body["seed"] = int(ask.seed) % 2**32  # llama.cpp's seeds are 32-bit
        if model:
            body["model"] = model
        return body

    def answer(self, ask, reply, asked):
        if not isinstance(reply, dict):
            raise ServerError("the server's reply is not a JSON object (not llama.cpp's /completion)")
        tokens = reply.get("tokens")
        if not _ids(tokens) or (not tokens and reply.get("content")):
            raise ServerError("the server answered text without token ids (llama.cpp needs return_tokens)")
        evaluated = reply.get("tokens_evaluated")
        if isinstance(evaluated, int) and evaluated != len(ask.token_ids):
            raise ServerError(f"the server did not take the prompt as token ids: it evaluated {evaluated} prompt "
                              f"tokens for request {ask.id!r} of {len(ask.token_ids)} ids")
        echoed = reply.get("generation_settings") or {}
        for key in self.ECHOED:
            if key in echoed and key in asked and not _same(echoed[key], asked[key]):
                raise ServerError(f"the server changed parameter {key!r}: sent {asked[key]!r}, it used {echoed[key]!r}")
        tokens = [int(t) for t in tokens]
        cut = next((i for i, t in enumerate(tokens) if t in set(ask.eos_token_ids)), None)
        if cut is not None:
            tokens = tokens[:cut + 1]
        top = None
        if asked.get("n_probs"):
            top = [_llama_cpp_top(p) for p in reply.get("completion_probabilities") or []][:len(tokens)]
        finish = "eos" if cut is not None or reply.get("stop_type") == "eos" else str(reply.get("stop_type"))
        return Answer(tokens, finish, top)


PROTOCOLS = {p.name: p for p in (OpenAIProtocol(), LlamaCppProtocol())}


def _llama_cpp_top(position: dict) -> list:
    """One position of llama.cpp's completion_probabilities as [[id, logprob], ...], most likely
    first, with the chosen token's own logprob added where a sampled token is not among the top n."""
    pairs = {int(c["id"]): float(c["logprob"]) for c in position.get("top_logprobs", [])}
    if _is_int(position.get("id")) and isinstance(position.get("logprob"), (int, float)):
        pairs.setdefault(int(position["id"]), float(position["logprob"]))
    return sorted(([t, v] for t, v in pairs.items()), key=lambda q: -q[1])


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    return a == b


# ---------------------------------------------------------------- the engine

@dataclass
class ServerEngine:
    """A running server as an engine of the kit: callable as `generate_fn` (greedy) and `sample_fn`.

    url: the server's base address (http://127.0.0.1:8000); api: a key of PROTOCOLS; model: the
    name some servers require; concurrency: requests in flight at once (None: the call's batch
    size); logprobs: top logprobs to ask for per new token (0: none); timeout: seconds per request;
    retries: attempts after a refused connection or a 503 (the server still loading), with backoff;
    seeds: send each row's seed (False for servers that refuse per-request seeds); extra: fields
    merged into every request body (an engine's own switches)."""
    url: str
    api: str = "openai"
    model: str | None = None
    concurrency: int | None = None
    logprobs: int = 0
    timeout: float = 300.0
    retries: int = 5
    seeds: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.api not in PROTOCOLS:
            raise ServerError(f"unknown --api {self.api!r}; known: {', '.join(PROTOCOLS)}")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ServerError(f"--server {self.url!r} is not an http:// or https:// address")
        self.url = self.url.rstrip("/")
        self.protocol = PROTOCOLS[self.api]
        # a server on this machine is reached directly, whatever proxy the environment names
        loopback = parts.hostname in ("localhost", "::1") or (parts.hostname or "").startswith("127.")
        self._open = (urllib.request.build_opener(urllib.request.ProxyHandler({})).open if loopback
                      else urllib.request.urlopen)

    @property
    def limits(self) -> tuple:
        return self.protocol.limits

    @property
    def SUPPORTS(self) -> tuple:  # noqa: N802 - the kit's name for the processors an engine can express
        return self.protocol.supports

    def ask(self, ask: Ask) -> Answer:
        """One completion; ServerError (one line) for anything that makes the answer unusable."""
        body = dict(self.protocol.body(ask, self.logprobs, self.model), **self.extra)
        return self.protocol.answer(ask, self._post(body), body)

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        address = self.url + self.protocol.path
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(address, data=data, headers={"Content-Type": "application/json"})
            try:
                with self._open(request, timeout=self.timeout) as response:
                    text = response.read().decode("utf-8", "replace")
                break
            except urllib.error.HTTPError as e:
                message = _error_message(e)
                if e.code == 503 and attempt < self.retries:
                    time.sleep(min(0.5 * 2 ** attempt, 8.0))
                    continue
                raise ServerError(f"the server refused the request (HTTP {e.code} from {address}): {message}"
                                  + _parameter_hint(message, body)) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                if attempt < self.retries and not isinstance(reason, TimeoutError) and "timed out" not in str(reason):
                    time.sleep(min(0.5 * 2 ** attempt, 8.0))
                    continue
                raise ServerError(f"cannot reach the server at {address}: {reason}"
                                  + (f" (after {attempt + 1} attempts)" if attempt else "")) from None
        try:
            reply = json.loads(text)
        except json.JSONDecodeError:
            raise ServerError(f"the server at {address} answered something that is not JSON: {text[:80]!r}") from None
        if isinstance(reply, dict) and "error" in reply and not reply.get("choices") and "tokens" not in reply:
            raise ServerError(f"the server returned an error: {_short(reply['error'])}")
        return reply

    def run(self, asks: list[Ask], concurrency: int | None = None, on_answer=None) -> dict:
        """Every ask sent with at most `concurrency` in flight, in list order; {id: Answer}.
        on_answer(ask, answer) is called as each arrives (from this thread)."""
        width = max(1, concurrency or self.concurrency or 1)
        answers: dict = {}
        if not asks:
            return answers
        with ThreadPoolExecutor(max_workers=min(width, len(asks))) as pool:
            futures = {pool.submit(self.ask, a): a for a in asks}
            try:
                for future in as_completed(futures):
                    ask = futures[future]
                    answers[ask.id] = future.result()
                    if on_answer is not None:
                        on_answer(ask, answers[ask.id])
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        return answers

    # the kit's engine protocols (specbatch.conformance.testing)
    def __call__(self, prompts, max_new_tokens, eos_token_ids, batch_size, *, temperature=0.0, top_k=None,
                 top_p=None, seeds=None, **processors) -> list:
        seeds = list(seeds) if seeds is not None and self.seeds else [None] * len(prompts)
        asks = [Ask(str(i), list(p), int(m), list(eos_token_ids), temperature, top_k, top_p, s, dict(processors))
                for i, (p, m, s) in enumerate(zip(prompts, max_new_tokens, seeds))]
        answers = self.run(asks, self.concurrency or batch_size)
        return [answers[a.id].token_ids for a in asks]

    def with_settings(self, prompts, max_new_tokens, eos_token_ids, batch_size, settings) -> list:
        """The processor protocol (specbatch.conformance.processor_vectors): greedy, one settings dict per request."""
        asks = [Ask(str(i), list(p), int(m), list(eos_token_ids), processors=dict(s))
                for i, (p, m, s) in enumerate(zip(prompts, max_new_tokens, settings))]
        answers = self.run(asks, self.concurrency or batch_size)
        return [answers[a.id].token_ids for a in asks]


def _error_message(e) -> str:
    try:
        body = e.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - a broken error body still gives the status line
        return str(e.reason)
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return _short(body) or str(e.reason)
    return _short(parsed.get("error", parsed.get("message", parsed)) if isinstance(parsed, dict) else parsed)


def _short(value) -> str:
    if isinstance(value, dict):
        value = value.get("message", value)
    return " ".join(str(value).split())[:300]


def _parameter_hint(message: str, body: dict) -> str:
    named = [key for key in body if re.search(rf"(?<![A-Za-z_]){re.escape(key)}(?![A-Za-z_])", message)]
    if "seed" in named or "Generator" in message:
        return " (if it refuses per-request seeds, run with --no-seeds)"
    return f" (parameter {named[0]!r})" if named else ""


# ---------------------------------------------------------------- vectors through a server

def asks_of(vectors, order: str = "shuffled") -> list[Ask]:
    """The requests of greedy vectors (in the manifest's suggested `order`), of processor vectors
    (file order, each with its settings) or of sampled vectors (each setting's rows together, in
    file order), as Asks."""
    from .processor_vectors import ProcessorVectors
    from .sampled import SampledVectors, processor_kwargs
    if isinstance(vectors, SampledVectors):
        eos = vectors.manifest["eos_token_ids"]
        return [Ask(r["id"], r["token_ids"], r["max_new_tokens"], eos, r["temperature"], r["top_k"], r["top_p"],
                    r["seed"], processor_kwargs(r)) for s in vectors.settings() for r in vectors.rows_of(s["name"])]
    if isinstance(vectors, ProcessorVectors):
        eos = vectors.manifest["eos_token_ids"]
        return [Ask(r["id"], r["token_ids"], r["max_new_tokens"], eos, processors=processor_kwargs(r["settings"]))
                for r in vectors.requests]
    orders = vectors.manifest["suggested"]["orders"]
    if order not in orders:
        raise ServerError(f"--order {order!r}: the vectors suggest {', '.join(orders)}")
    return [Ask(vectors.requests[i]["id"], vectors.requests[i]["token_ids"], vectors.requests[i]["max_new_tokens"],
                vectors.requests[i]["eos_token_ids"]) for i in orders[order]]


def record_of(answer: Answer, ident: str) -> dict:
    row = dict(id=ident, token_ids=answer.token_ids, finish_reason=answer.finish_reason)
    if answer.top is not None:
        row["top"] = answer.top
    return row


def run_vectors(engine: ServerEngine, vectors, *, concurrency: int, order: str = "shuffled", done=(),
                on_answer=None) -> dict:
    """Send the vectors' requests not in `done` to the server; {id: output record}. Sampled vectors
    go one setting at a time (a setting's rows are meant to be batched together); greedy ones all at
    once. on_answer(record) is called for each as it arrives."""
    from .sampled import SampledVectors
    asks = [a for a in asks_of(vectors, order) if a.id not in set(done)]
    if not engine.seeds:
        for a in asks:
            a.seed = None
    groups = [asks]
    if isinstance(vectors, SampledVectors):
        groups = [[a for a in asks if a.id in {r["id"] for r in vectors.rows_of(s["name"])}]
                  for s in vectors.settings()]
    records: dict = {}
    lock = threading.Lock()

    def keep(ask, answer):
        with lock:
            records[ask.id] = record_of(answer, ask.id)
            if on_answer is not None:
                on_answer(records[ask.id])
    for group in groups:
        engine.run(group, concurrency, keep)
    return records
