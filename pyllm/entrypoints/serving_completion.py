"""POST /v1/completions: one or more prompts (text or token ids), each completed n times,
whole or streamed; echo, logprobs and vLLM's prompt_logprobs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pyllm.engine.outputs import CompletionOutput, RequestOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.serving import Job, OpenAIServing, Progress


class CompletionServing(OpenAIServing):
    async def completions(self, request: Request) -> Response:
        return await self._respond(request, api.CompletionRequest)

    def _response(
        self, body: api.CompletionRequest, jobs: list[Job], created: int, progress: Progress
    ) -> api.CompletionResponse:
        choices = []
        for index, job in enumerate(jobs):
            final = progress.finals[index]
            choices += [self._choice(body, index, job, final, c) for c in final.outputs]
        return api.CompletionResponse(
            id=_response_id(jobs),
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=self._usage(progress, jobs),
        )

    async def _prepare(self, body: api.CompletionRequest) -> list[Job]:
        body.check()
        self.check_model(body.model)
        prompts = body.prompts()
        self._check_num_seqs(body, len(prompts))
        params = body.to_sampling_params()
        base_id = api.random_id("cmpl")
        jobs = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
                text = prompt
            else:
                ids, text = prompt, ""
            await self._validate(body, ids, params, "prompt")
            if body.echo and not text:
                text = self.tokenizer.decode(ids)
            jobs.append(Job(f"{base_id}-{i}", ids, params, text, body.priority, base_id))
        return jobs

    def _choice(
        self,
        body: api.CompletionRequest,
        index: int,
        job: Job,
        final: RequestOutput,
        c: CompletionOutput,
    ) -> api.CompletionChoice:
        """Choice c of prompt `index`, finished: with echo, the prompt comes first."""
        prefix = job.prompt_text if body.echo else ""
        prompt_logprobs = None
        if body.prompt_logprobs is not None:
            prompt_logprobs = self.tokens.prompt_logprobs(
                job.prompt_token_ids, final.prompt_logprobs, body.prompt_logprobs
            )
        return api.CompletionChoice(
            index=index * body.n + c.index,
            text=prefix + c.text,
            logprobs=self._choice_logprobs(body, job, final.prompt_logprobs, c, len(prefix)),
            finish_reason=c.finish_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def _choice_logprobs(
        self,
        body: api.CompletionRequest,
        job: Job,
        prompt_logprobs: list | None,
        c: CompletionOutput,
        text_offset: int,
    ) -> api.CompletionLogprobs | None:
        """A whole choice's logprobs; with echo, the prompt's first, then the generated
        tokens' from text_offset (the echoed prompt's length)."""
        if body.echo_logprobs:
            logprobs = self.tokens.echo_logprobs(
                job.prompt_token_ids, prompt_logprobs, body.logprobs
            )
            generated = self.tokens.completion_logprobs(c.token_ids, c.logprobs or [], text_offset)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(generated, name))
            return logprobs
        if body.logprobs is not None:
            return self.tokens.completion_logprobs(c.token_ids, c.logprobs or [], 0)
        return None

    def _events(
        self, body: api.CompletionRequest, jobs: list[Job], created: int, progress: Progress
    ) -> AsyncIterator[str]:
        def choice(index: int, c: CompletionOutput, text: str, token_ids, logprobs, offset: int):
            return api.CompletionChoice(
                index=index * body.n + c.index,
                text=text,
                logprobs=self.tokens.completion_logprobs(token_ids, logprobs, offset)
                if body.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
            )

        echoes = (
            api.CompletionChoice(
                index=i * body.n + k, text=jobs[i].prompt_text, logprobs=None, finish_reason=None
            )
            for i in range(len(jobs))
            for k in range(body.n)
        )
        chunk = functools.partial(
            api.CompletionResponse,
            id=_response_id(jobs),
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
        )
        return self._stream(body, jobs, progress, chunk, echoes if body.echo else (), choice)


def _response_id(jobs: list[Job]) -> str:
    """'cmpl-<hex>': the jobs' ids without their prompt index."""
    return jobs[0].request_id.rsplit("-", 1)[0]
