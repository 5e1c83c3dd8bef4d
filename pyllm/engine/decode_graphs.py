"""Decode steps replayed from recorded kernel graphs (model.step_graph), one graph per
step shape, as vLLM captures a CUDA graph per batch size.

A step is recorded when it holds no prompt tokens: decodes, decodes verifying drafted
tokens (speculative decoding: 1 + k tokens, each attending as a decode token), a
draft model's catch-up over the tokens just accepted. Its shape is its token count and
its prefill part's tokens, sequences and longest query: what the kernels take as sizes
rather than tensors. The first step of a shape runs for real while it records; later
steps of that shape write their inputs into the tensors the recording read and replay
it: the embeddings into one [tokens, hidden] tensor, the positions, and each tensor of
the attention metadata (block tables into a copy wide enough for MAX_GRAPH_SEQ_LEN
tokens; the metadata's max_decode_seq_len is that length, so decode attention takes
the path it takes for every shorter context). A step whose contexts are longer runs op
by op, as does every step of a model whose recording was refused.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pyllm.attention.metadata import AttentionMetadata
from pyllm.attention.paged import V2_MIN_SEQ_LEN
from pyllm.model.step_graph import record

# Longest context a recorded decode step covers: up to it the CPU's paged decode
# attention keeps to paged_attention_v1, so one recording serves every length.
MAX_GRAPH_SEQ_LEN = V2_MIN_SEQ_LEN
# Tokens of a step recorded: above this the step's kernels dwarf the ~1 ms of Python a
# replay saves. Each recording keeps its step's activations (a 7B model in float32:
# ~200 KB a token), so only the MAX_GRAPHS used last are kept; recording again costs
# one step run op by op.
MAX_GRAPH_BATCH = 64
MAX_GRAPHS = 16


@dataclass
class _Graph:
    hidden: torch.Tensor  # [tokens, hidden_size], the embeddings the layers read
    positions: torch.Tensor  # [tokens] int64
    meta: AttentionMetadata  # its tensors, written each step
    graph: object  # _C.KernelGraph
    out: torch.Tensor  # the final hidden states the replay writes


# (tokens, prefill tokens, prefill sequences, longest prefill query): a step's shape.
StepShape = tuple[int, int, int, int]


def step_shape(meta: AttentionMetadata) -> StepShape:
    """The sizes a recording fixes; a step of decodes only is (batch, 0, 0, 0)."""
    lens = meta.prefill_seq_lens
    prefills = 0 if lens is None or not meta.num_prefill_tokens else lens.shape[0]
    return meta.num_tokens, meta.num_prefill_tokens, prefills, meta.max_query_len


class DecodeGraphs:
    """The recorded decode steps of one model and KV cache."""

    def __init__(self, model, kv_cache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_seq_len = min(MAX_GRAPH_SEQ_LEN, model.max_model_len)
        self.table_width = -(-self.max_seq_len // block_size)
        # Step shape -> its recording (None: refused), the last used last.
        self.graphs: OrderedDict[StepShape, _Graph | None] = OrderedDict()
        self.refused: dict[StepShape, str] = {}  # shape -> the op that refused its recording

    @staticmethod
    def supports(model, device: torch.device) -> bool:
        """Whether this model's decode steps may be recorded (CPU, one process)."""
        return device.type == "cpu" and hasattr(model, "run_layers") and model.tp is None

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states of a step of decodes (some perhaps verifying drafts,
        no prompt tokens), replayed or recorded; None where it must run op by op."""
        shape = step_shape(meta)
        if (
            meta.num_prompt_tokens
            or meta.max_decode_seq_len > self.max_seq_len
            or shape[0] > MAX_GRAPH_BATCH
        ):
            return None
        self.model.ensure_rotary(positions)
        if shape not in self.graphs:
            if _widest(meta) > self.table_width:  # a replay's _refill checks this itself
                return None
            return self._record(shape, input_ids, positions, meta)
        self.graphs.move_to_end(shape)
        graph = self.graphs[shape]
        if graph is None:
            return None
        if not _refill(graph.meta, meta):
            return None
        graph.positions.copy_(positions)
        graph.hidden.copy_(self.model.embed(input_ids))
        graph.graph.replay()
        return graph.out

    def _record(self, shape: StepShape, input_ids, positions, meta) -> torch.Tensor:
        kept = _kept(meta, self.table_width, self.max_seq_len)
        hidden, positions = self.model.embed(input_ids), positions.clone()
        out, graph, refused = record(self.model.run_layers, hidden, positions, kept, self.kv_cache)
        self.graphs[shape] = None if graph is None else _Graph(hidden, positions, kept, graph, out)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        if refused:
            self.refused[shape] = refused
        return out


def _widest(meta: AttentionMetadata) -> int:
    """The most columns of meta's 2-D tensors (block tables), its groups' included."""
    widest = 0
    for field in dataclasses.fields(meta):
        value = getattr(meta, field.name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            widest = max(widest, value.shape[1])
        elif field.name == "groups" and value:
            widest = max(widest, *(_widest(g) for g in value))
    return widest


def _kept(meta: AttentionMetadata, width: int, max_seq_len: int) -> AttentionMetadata:
    """A copy of meta with tensors of its own: 2-D ones (block tables) width columns wide."""
    changes = {"max_decode_seq_len": max_seq_len}
    for field in dataclasses.fields(meta):
        value = getattr(meta, field.name)
        if isinstance(value, torch.Tensor):
            if value.dim() == 2:
                wide = value.new_zeros(value.shape[0], width)
                wide[:, : value.shape[1]] = value
                value = wide
            changes[field.name] = value.clone()
        elif field.name == "groups" and value:
            changes[field.name] = [_kept(g, width, max_seq_len) for g in value]
    return dataclasses.replace(meta, **changes)


def _refill(kept: AttentionMetadata, meta: AttentionMetadata) -> bool:
    """Writes meta's tensors into kept's; False (nothing meant) where meta's other
    fields differ from the recorded step's or a tensor does not fit."""
    for field in dataclasses.fields(meta):
        name, value, dst = field.name, getattr(meta, field.name), getattr(kept, field.name)
        if isinstance(value, torch.Tensor):
            if value.dim() == 2:
                if value.shape[0] != dst.shape[0] or value.shape[1] > dst.shape[1]:
                    return False
                dst = dst[:, : value.shape[1]]
            elif value.shape != dst.shape:
                return False
            dst.copy_(value)
        elif name == "groups" and value:
            if not all(_refill(k, g) for k, g in zip(dst, value, strict=True)):
                return False
        elif name != "max_decode_seq_len" and value != dst:
            return False
    return True
