"""POST /v1/embeddings: one or more inputs (text or token ids), each embedded by the
engine (its final hidden states pooled, engine/pooling.py), as floats or base64."""

from __future__ import annotations

import asyncio
import re

from fastapi import Request
from fastapi.responses import Response

from pyllm.engine.outputs import EmbeddingRequestOutput
from pyllm.engine.pooling import PoolingParams
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.request_io import cancel_on_disconnect, read_request
from pyllm.entrypoints.server_config import ServerConfig
from pyllm.entrypoints.serving import Job, OpenAIServing


class EmbeddingServing(OpenAIServing):
    def __init__(self, *shared, max_seqs: int, max_tokens: int = ServerConfig.max_embedding_tokens):
        """max_seqs: the most inputs per request; max_tokens: the most tokens, all
        inputs together."""
        super().__init__(*shared, max_seqs)
        self.max_tokens = max_tokens

    async def embeddings(self, request: Request) -> Response:
        body = await read_request(request, api.EmbeddingRequest, self.max_bytes)
        self.check_model(body.model)
        items = body.inputs(self.max_seqs)
        params = body.to_pooling_params()
        ids = await asyncio.to_thread(self._token_ids, items)
        total = sum(len(i) for i in ids)
        if total > self.max_tokens:
            raise RequestError(
                f"input holds {total} tokens; at most {self.max_tokens} per request", "input"
            )
        for prompt in ids:
            self._check(prompt, params)
        base_id = api.random_id("embd")
        jobs = [Job(f"{base_id}-{i}", p, params, group=base_id) for i, p in enumerate(ids)]
        self.metrics.prompt_tokens.inc(total)
        finals = await self._embed(request, jobs)
        data = [
            api.Embedding(
                index=i, embedding=api.encode_embedding(o.embedding, body.encoding_format)
            )
            for i, o in enumerate(finals)
        ]
        usage = api.EmbeddingUsage(prompt_tokens=total, total_tokens=total)
        response = api.EmbeddingResponse(data=data, model=self.model_name, usage=usage)
        return Response(response.model_dump_json(), media_type="application/json")

    def _token_ids(self, items: list[str | list[int]]) -> list[list[int]]:
        return [self.tokenizer.encode(i) if isinstance(i, str) else i for i in items]

    def _check(self, prompt: list[int], params: PoolingParams) -> None:
        """The engine's checks of one input, naming `dimensions` or `input`."""
        try:
            self.engine.validate(prompt, params)
        except ValueError as error:
            param = "dimensions" if getattr(error, "param", None) == "dimensions" else "input"
            code = getattr(error, "code", None)
            message = re.sub(r"^prompt(_token_ids)?", "input", str(error))
            raise RequestError(message, param, code=code) from None

    async def _embed(self, request: Request, jobs: list[Job]) -> list:
        """Each job's vector (EmbeddingOutput), in order; all aborted if the client goes."""
        finals: dict[int, EmbeddingRequestOutput] = {}
        try:
            async with cancel_on_disconnect(request):
                async for index, output in self._outputs(jobs):
                    finals[index] = output
        except ValueError as error:  # the engine refused an input
            if isinstance(error, RequestError):
                raise
            raise RequestError(str(error), "input") from None
        return [finals[i].outputs for i in range(len(jobs))]
