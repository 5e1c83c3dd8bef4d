"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `.chat(...)` and
`.embed(prompts)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pyllm.engine.config import EngineConfig
from pyllm.engine.llm_engine import LLMEngine
from pyllm.engine.outputs import EmbeddingRequestOutput, RequestOutput
from pyllm.engine.pooling import PoolingParams
from pyllm.entrypoints.reasoning import ReasoningParser
from pyllm.entrypoints.reasoning import reasoning_parser as reasoning_parser_named
from pyllm.sampling.params import SamplingParams

Message = dict[str, str]


class LLM:
    """An engine for offline batches: all prompts are submitted at once and run with
    continuous batching; outputs come back in input order."""

    def __init__(self, model: str | None = None, dtype: str = EngineConfig.dtype, **engine_options):
        """`model`, `dtype` and the other `engine_options`: EngineConfig's fields."""
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any, and writes the blocks
        queued for the prefix cache on disk (both also done at exit)."""
        self.engine.close()

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """priority: one per prompt, lower runs first (as vLLM's)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        count = len(prompts) if prompts is not None else len(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
        if priority is not None and len(priority) != count:
            raise ValueError(f"got {len(priority)} priorities for {count} prompts")
        requests = [
            (
                prompts[i] if prompts is not None else None,
                prompt_token_ids[i] if prompt_token_ids is not None else None,
                sampling_params[i],
                priority[i] if priority is not None else 0,
            )
            for i in range(count)
        ]
        return self._run(self._submit(requests), use_tqdm)

    def embed(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (a string, a list of strings, one prompt's token ids, or
        a list of those), in `.outputs.embedding`: the final hidden states pooled as the
        engine's `pooling` option says, unit length unless pooling_params.normalize is
        False. All prompts are batched together, as generate's are."""
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
        requests = [
            (p, None, params, 0) if isinstance(p, str) else (None, p, params, 0)
            for p in _embed_prompts(prompts)
        ]
        return self._run(self._submit(requests), use_tqdm)

    def _submit(self, requests: list[tuple]) -> list[str]:
        """Adds each (prompt, token ids, params, priority) to the engine; their ids. On a
        refused one, the ones added before are aborted: the engine is left as it was."""
        ids = []
        try:
            for prompt, token_ids, params, priority in requests:
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, params, token_ids, priority)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        """chat_template_kwargs: extra chat template variables ({"enable_thinking":
        False}); reasoning_parser: "deepseek_r1" or "qwen3" (as `pyllm serve`'s): each
        output's thinking goes to its `reasoning_content`, its `text` keeps the answer."""
        if not isinstance(chat_template_kwargs or {}, dict):
            raise ValueError("chat_template_kwargs must be a dict of template variables")
        parser = reasoning_parser_named(reasoning_parser)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                c, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for c in conversations
        ]
        token_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(
            None, sampling_params, prompt_token_ids=token_ids, use_tqdm=use_tqdm
        )
        if parser is not None:
            _split_reasoning(parser, outputs)
        return outputs

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(ids),
            desc="Processed prompts",
            dynamic_ncols=True,
            disable=not use_tqdm,
            postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s",
        )
        prompt_tokens = output_tokens = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    output_tokens += _num_output_tokens(output)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                        f"output: {output_tokens / elapsed:.2f} toks/s"
                    )
        bar.close()
        return [finished[i] for i in ids]


def _num_output_tokens(output: RequestOutput | EmbeddingRequestOutput) -> int:
    if isinstance(output, EmbeddingRequestOutput):
        return 0
    return sum(len(o.token_ids) for o in output.outputs)


def _embed_prompts(prompts) -> list[str | list[int]]:
    """embed's prompts as a list, each a string or a list of token ids; TypeError
    naming `prompts` for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string or a list, got {type(prompts).__name__}")
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    for i, p in enumerate(prompts):
        is_ids = isinstance(p, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p
        )
        if not isinstance(p, str) and not is_ids:
            raise TypeError(f"prompts[{i}] must be a string or a list of token ids, got {p!r:.60}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _split_reasoning(parser: ReasoningParser, outputs: list[RequestOutput]) -> None:
    for completion in (c for output in outputs for c in output.outputs):
        reasoning, completion.text = parser.split(completion.text)
        completion.reasoning_content = reasoning or None
