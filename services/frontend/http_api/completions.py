"""POST /v1/completions: OpenAI's (legacy) text completions, plain or streamed.

    {"id": "cmpl-<request id>", "object": "text_completion", "created", "model",
     "choices": [{"index", "text", "logprobs", "finish_reason", "prompt_logprobs"}], "usage"}

A batch of prompts x n choices: choice `prompt * n + i`. `echo` puts the prompt's text before
each choice's (its ids' text for a prompt of ids); `logprobs` k gives each token's and the k
most likely (openai_logprobs.py), `text_offset` counting from the start of the choice's text;
with both, the prompt's tokens come first with the logprobs prefill computed for them (the
first one null; once per prompt, by its first choice: streamed, the other choices' chunks wait
for its first). `max_tokens: 0` with `echo` returns the prompt alone (finish_reason "length",
no completion tokens): the token prefill samples to get there is left out. vLLM's
`prompt_logprobs` k (or echo with logprobs) fills each choice's `prompt_logprobs` with its
prompt's (openai_logprobs.vllm_prompt_logprobs) in a whole response, null otherwise (as vLLM
writes it; vLLM streams none).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from mili.engine.stop import FinishReason
from mili.errors import Unavailable
from services.frontend.generations import Generations
from services.frontend.http_api.choices import Choice, Usage, chunk_tail
from services.frontend.http_api.errors import response_of
from services.frontend.http_api.openai_call import Head, OpenAICall, open_call, respond
from services.frontend.http_api.openai_logprobs import (
    TextOffsets,
    TokenPieces,
    completion_logprobs,
    prompt_completion_logprobs,
    prompt_logprobs_of,
)
from services.frontend.http_api.openai_request import OpenAIRequest, completion_request
from services.frontend.pipeline import Delta
from services.frontend.text import LocalDetokenizer


def detokenizer_of(generations: Generations) -> LocalDetokenizer:
    """The frontend's copy of the tokenizer (for token strings and echoed ids)."""
    tokenizer = generations.backends.tokenizer
    if tokenizer.detokenizer is None:
        raise Unavailable(f"{tokenizer.who}: its tokenizer file is not loaded yet")
    return tokenizer.detokenizer


async def create_completion(request: web.Request, generations: Generations) -> web.StreamResponse:
    call = await open_call(request, generations, completion_request)
    if isinstance(call, web.Response):
        return call
    try:
        echoes, pieces = _prompt_texts(call), _pieces(call)
    except Unavailable as exc:
        return response_of(exc)
    chunks = CompletionJson(call.request, call.choices, call.head, echoes, pieces)
    return await respond(request, call, chunks)


def _prompt_texts(call: OpenAICall) -> list[str]:
    """Each prompt's text for `echo` ([] without it)."""
    if not call.request.echo:
        return []
    texts = []
    for prompt in call.request.inputs:
        if prompt.token_ids:
            texts.append(detokenizer_of(call.generations).decode(prompt.token_ids))
        else:
            texts.append(prompt.prompt)
    return texts


def _pieces(call: OpenAICall) -> TokenPieces | None:
    """Token strings, where logprobs or prompt logprobs are asked for."""
    if call.request.inputs[0].sampling.logprobs is None and call.request.prompt_logprobs is None:
        return None
    return TokenPieces(detokenizer_of(call.generations))


class CompletionJson:
    """The response's JSON: whole, or as stream chunks (sse.Chunks)."""

    def __init__(
        self,
        request: OpenAIRequest,
        choices: Sequence[Choice],
        head: Head,
        echoes: list[str],
        pieces: TokenPieces | None,
    ) -> None:
        self._request = request
        self._choices = choices
        self._pieces = pieces
        # logprobs k: the generated tokens' (and an echoed prompt's) top k
        self._num_top = request.inputs[0].sampling.logprobs
        # Each prompt's logprobs are shown at each of its n choices: in `logprobs` with echo,
        # and in `prompt_logprobs` (openai_call.MAX_WHOLE_LOGPROBS counts every copy).
        shown = (request.echo and self._num_top is not None) + (request.prompt_logprobs is not None)
        self.prompt_logprobs_copies = request.n * shown
        self._usage = Usage(choices)
        self._head = head.json("cmpl", "text_completion")
        # Each chunk is this head, its choices and the tail: one json.dumps per chunk.
        self._chunk_head = json.dumps(self._head)[:-1] + ', "choices": ['
        self._text_heads = {
            c.index: f'{self._chunk_head}{{"index": {c.index}, "text": ' for c in choices
        }
        self._echo = {c.index: echoes[c.prompt_index] for c in choices} if echoes else {}
        # Streamed with echo and logprobs, a prompt's first choice alone computes the prompt's
        # logprobs (choices.plan); its other choices' deltas are held here until its first
        # delta brings them, so that each choice still opens with the prompt and its logprobs.
        prompt_logprobs = request.inputs[0].sampling.prompt_logprobs
        self._is_shared = request.is_stream and request.n > 1 and prompt_logprobs is not None
        self._held: dict[int, list[tuple[int, Delta]]] = (
            {p: [] for p in range(len(request.inputs))} if self._is_shared else {}
        )
        self._prompt_deltas: dict[int, Delta] = {}  # prompt -> the delta carrying its logprobs
        self._echoed = dict(self._echo)  # kept: what the prompt's text_offset indexes
        self._offsets = {c.index: TextOffsets(len(self._echo.get(c.index, ""))) for c in choices}

    def _choice(
        self, index: int, text: str, deltas: list[Delta], prompt: Delta | None = None
    ) -> dict[str, Any]:
        """A choice's JSON from its `deltas`; with echo, `prompt` (the delta that carries the
        prompt's ids and logprobs) puts the prompt's tokens first."""
        logprobs = None
        if self._pieces is not None and self._num_top is not None:
            ids = [t for d in deltas for t in d.token_ids]
            lps = [lp for d in deltas for lp in d.logprobs]
            logprobs = completion_logprobs(self._pieces, ids, lps, self._offsets[index])
            if self._request.echo and prompt is not None and prompt.prompt_token_ids:
                # echo with logprobs: the prompt's tokens first (their logprobs from prefill,
                # which computed as many top ones as prompt_logprobs asked, if more)
                top = [
                    lp._replace(top=lp.top[: self._num_top]) for lp in prompt.prompt_logprobs or []
                ]
                echoed = prompt_completion_logprobs(
                    self._pieces, prompt.prompt_token_ids, top, self._echoed.get(index)
                )
                logprobs = {key: echoed[key] + logprobs[key] for key in echoed}
        finish = deltas[-1].finish_reason if deltas else None
        if finish is not None:
            self._usage.add(index, deltas[-1])
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": None if finish is None else str(finish),
        }

    def _prompt_logprobs(self, deltas: list[Delta]) -> list[Any] | None:
        """vLLM's prompt_logprobs of the prompt of a choice (`deltas`: its own)."""
        assert self._pieces is not None and self._request.prompt_logprobs is not None
        return prompt_logprobs_of(self._pieces, deltas, self._request.prompt_logprobs)

    def _shown(self, delta: Delta) -> Delta:
        """The part of `delta` the caller gets: with max_tokens 0, its prompt part alone, ended
        by length whatever the hidden token was (an EOS or a stop would say "stop")."""
        if not self._request.is_prompt_only:
            return delta
        finish = None if delta.finish_reason is None else FinishReason.LENGTH
        return replace(
            delta,
            token_ids=[],
            text="",
            logprobs=[],
            finish_reason=finish,
            num_completion_tokens=0,
        )

    def whole(self, deltas: dict[int, list[Delta]]) -> str:
        choices = []
        # Each prompt's vLLM prompt_logprobs, built once and shown at each of its n choices
        prompt_logprobs: dict[int, list[Any] | None] = {}
        for c in self._choices:
            ds = [self._shown(d) for d in deltas[c.index]]
            text = self._echo.get(c.index, "") + "".join(d.text for d in ds)
            # A whole response's prompt logprobs come from its prompt's first choice alone
            # (choices.plan: the others do not ask for them).
            first = deltas[c.prompt_index * self._request.n]
            choice = self._choice(c.index, text, ds, first[0] if first else None)
            if self._request.prompt_logprobs is not None and c.prompt_index not in prompt_logprobs:
                prompt_logprobs[c.prompt_index] = self._prompt_logprobs(first)
            # null when not asked: vLLM writes every field of its choice
            choice["prompt_logprobs"] = prompt_logprobs.get(c.prompt_index)
            choices.append(choice)
        return json.dumps({**self._head, "choices": choices, "usage": self._usage.as_json()})

    # ---- streamed ----

    def opening(self, first: Delta | None = None) -> list[str]:
        return []

    def of(self, index: int, delta: Delta) -> list[str]:
        delta = self._shown(delta)
        if delta.finish_reason is None and self._num_top is None and not self._echo:
            # Once per streamed delta: the plain case from a template around its text.
            text = json.dumps(delta.text)
            tail = chunk_tail(self._request, delta)
            return [
                f'{self._text_heads[index]}{text}, "logprobs": null, "finish_reason": null}}{tail}'
            ]
        prompt_index, nth = divmod(index, self._request.n)
        held = self._held.get(prompt_index)
        if held is not None and nth > 0:  # its prompt's logprobs are still to come
            held.append((index, delta))
            return []
        chunks = [self._streamed(index, delta)]
        if held is not None:  # the first choice's first delta brought them: the others go on
            del self._held[prompt_index]
            chunks += [self._streamed(i, d) for i, d in held]
        return chunks

    def _streamed(self, index: int, delta: Delta) -> str:
        prompt = None
        if index in self._echo:  # the choice's first chunk: the prompt's text first
            prompt = delta  # with its logprobs, on the generation's first delta
            if self._is_shared:  # the first choice's (whose first delta the others waited for)
                prompt = self._prompt_deltas.setdefault(index // self._request.n, delta)
        text = self._echo.pop(index, "") + delta.text
        choice = self._choice(index, text, [delta], prompt)
        return self._chunk_head + json.dumps(choice) + chunk_tail(self._request, delta)

    def closing(self) -> list[str]:
        if not self._request.include_usage:
            return []
        return [json.dumps({**self._head, "choices": [], "usage": self._usage.as_json()})]

    def failed(self, error: str) -> str:
        return error  # the error body as it is, as vLLM and OpenAI stream it
