"""Decode steps replayed from recorded kernel graphs (model.step_graph), one graph per
batch size, as vLLM captures a CUDA graph per batch size.

The first decode-only step of B sequences runs for real while it records; later steps
of B sequences write their inputs into the tensors the recording read and replay it:
the embeddings into one [B, hidden] tensor, the positions, and each tensor of the
attention metadata (block tables into a copy wide enough for MAX_GRAPH_SEQ_LEN tokens;
the metadata's max_decode_seq_len is that length, so decode attention takes the path it
takes for every shorter context). A step whose contexts are longer runs op by op, as
does every step of a model whose recording was refused.
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
# Batch sizes recorded: above this the step's kernels dwarf the ~1 ms of Python a
# replay saves. Each recording keeps its step's activations (a 7B model in float32:
# ~200 KB a sequence), so only the MAX_GRAPHS used last are kept; recording again costs
# one step run op by op.
MAX_GRAPH_BATCH = 64
MAX_GRAPHS = 16


@dataclass
class _Graph:
    hidden: torch.Tensor  # [B, hidden_size], the embeddings the layers read
    positions: torch.Tensor  # [B] int64
    meta: AttentionMetadata  # its tensors, written each step
    graph: object  # _C.KernelGraph
    out: torch.Tensor  # the final hidden states the replay writes


class DecodeGraphs:
    """The recorded decode steps of one model and KV cache."""

    def __init__(self, model, kv_cache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.max_seq_len = min(MAX_GRAPH_SEQ_LEN, model.max_model_len)
        self.table_width = -(-self.max_seq_len // block_size)
        # Batch size -> its recording (None: refused), the last used last.
        self.graphs: OrderedDict[int, _Graph | None] = OrderedDict()
        self.refused: dict[int, str] = {}  # batch size -> the op that refused its recording

    @staticmethod
    def supports(model, device: torch.device) -> bool:
        """Whether this model's decode steps may be recorded (CPU, one process)."""
        return device.type == "cpu" and hasattr(model, "run_layers") and model.tp is None

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states of a step of decodes only (one token per sequence),
        replayed or recorded; None where the step must run op by op."""
        batch = input_ids.shape[0]
        if meta.max_decode_seq_len > self.max_seq_len or batch > MAX_GRAPH_BATCH:
            return None
        if batch not in self.graphs:
            return self._record(input_ids, positions, meta)
        self.graphs.move_to_end(batch)
        graph = self.graphs[batch]
        if graph is None:
            return None
        if not _refill(graph.meta, meta):
            return None
        graph.positions.copy_(positions)
        graph.hidden.copy_(self.model.embed(input_ids))
        graph.graph.replay()
        return graph.out

    def _record(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        kept = _kept(meta, self.table_width, self.max_seq_len)
        hidden, positions = self.model.embed(input_ids), positions.clone()
        out, graph, refused = record(self.model.run_layers, hidden, positions, kept, self.kv_cache)
        batch = input_ids.shape[0]
        self.graphs[batch] = None if graph is None else _Graph(hidden, positions, kept, graph, out)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        if refused:
            self.refused[batch] = refused
        return out


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
