"""vLLM's POST /tokenize and POST /detokenize: the served model's tokenizer over HTTP."""

from __future__ import annotations

import asyncio

from fastapi import Request

from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.request_io import read_request
from pyllm.entrypoints.serving import OpenAIServing


class TokenizeServing(OpenAIServing):
    async def tokenize(self, request: Request) -> api.TokenizeResponse:
        body = await read_request(request, api.TokenizeRequest, self.max_bytes)
        body.check()
        self.check_model(body.model)
        if body.messages is not None:
            messages = body.template_messages()
            try:
                text = await asyncio.to_thread(
                    self.tokenizer.apply_chat_template,
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}),
                )
            except Exception as error:  # the template refused these messages
                raise RequestError(f"messages could not be rendered: {error}", "messages") from None
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = await asyncio.to_thread(self.tokenizer.encode, text, special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return api.TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: Request) -> api.DetokenizeResponse:
        body = await read_request(request, api.DetokenizeRequest, self.max_bytes)
        self.check_model(body.model)
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, body.tokens)
        except ValueError as error:  # an id outside the vocabulary
            raise RequestError(str(error), "tokens") from None
        return api.DetokenizeResponse(prompt=text)
