"""Stop conditions on a sequence after each new token, and what text may be streamed.

Stop strings are matched on the detokenized text, so a stop string split over several
tokens is still found. Text that could be the beginning of a stop string is held back
from streaming until the next tokens show whether it completes one.
"""

from __future__ import annotations

from pyllm.engine.sequence import Sequence


def check_stop(seq: Sequence, new_text: str, eos_token_ids: set[int], max_model_len: int) -> None:
    """Sets seq.finish_reason (and trims seq.output_text) when seq should stop.

    `new_text` is the text the last token added (already appended to output_text).
    """
    params = seq.sampling_params
    token = seq.token_ids[-1]
    if seq.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
            return
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        if params.stop and _trim_at_stop_string(seq, new_text):
            return
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        seq.finish_reason = "length"
    elif seq.num_tokens >= max_model_len:
        seq.finish_reason = "length"


def _trim_at_stop_string(seq: Sequence, new_text: str) -> bool:
    params = seq.sampling_params
    text = seq.output_text
    # A match must end inside the new text; it may start up to len(stop)-1 before it.
    window = len(new_text) + max(len(s) for s in params.stop) - 1
    search_from = max(0, len(text) - window)
    best = None
    for stop in params.stop:
        at = text.find(stop, search_from)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return False
    at, stop = best
    seq.output_text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True


def streamable_text(seq: Sequence) -> str:
    """output_text minus any tail that may still grow into a stop string."""
    text = seq.output_text
    stops = seq.sampling_params.stop
    if seq.finish_reason is not None or not stops:
        return text
    hold = max(_partial_match(text, stop) for stop in stops)
    return text[: len(text) - hold]


def _partial_match(text: str, stop: str) -> int:
    """Length of the longest tail of text that is a proper prefix of stop.

    Only positions holding stop's first character are tried, so a step costs about
    one scan of the last len(stop) characters instead of one comparison per length.
    """
    i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while i != -1:
        if stop.startswith(text[i:]):
            return len(text) - i
        i = text.find(stop[0], i + 1)
    return 0
