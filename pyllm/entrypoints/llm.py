"""The offline API: `LLM(...).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pyllm.engine.config import EngineConfig
from pyllm.engine.llm_engine import LLMEngine
from pyllm.engine.outputs import RequestOutput
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
        ids = []
        try:
            for i in range(count):
                request_id = str(next(self._ids))
                self.engine.add_request(
                    request_id,
                    prompts[i] if prompts is not None else None,
                    sampling_params[i],
                    prompt_token_ids[i] if prompt_token_ids is not None else None,
                    priority[i] if priority is not None else 0,
                )
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave the engine as it was
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
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
                    output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, "
                        f"output: {output_tokens / elapsed:.2f} toks/s"
                    )
        bar.close()
        return [finished[i] for i in ids]


def _split_reasoning(parser: ReasoningParser, outputs: list[RequestOutput]) -> None:
    for completion in (c for output in outputs for c in output.outputs):
        reasoning, completion.text = parser.split(completion.text)
        completion.reasoning_content = reasoning or None
