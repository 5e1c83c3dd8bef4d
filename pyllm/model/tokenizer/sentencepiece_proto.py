"""Piece types and the dummy-prefix flag of a SentencePiece model, read from its protobuf.

The Python API can test control/unknown/byte/unused pieces but not user-defined ones, so we read
the serialized ModelProto. sentencepiece ships generated bindings (sentencepiece_model_pb2), but
they need the protobuf runtime at least as new as the protoc that built them (7.36 for
sentencepiece 0.2.3; 6.x fails to import them): a second dependency pinned by the first. The two
fields we need are a short wire-format walk away.
"""

from __future__ import annotations

from collections.abc import Iterator

# llama.cpp's token types (tokenizer.ggml.token_type), numbered as SentencePiece numbers pieces.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_piece_types(model_proto: bytes) -> tuple[list[int], bool]:
    """(type of each piece, add_dummy_prefix) from a serialized SentencePiece ModelProto.

    ModelProto field 1 holds each piece, whose field 3 is its type (NORMAL when absent); field 3
    is the NormalizerSpec, whose field 3 is add_dummy_prefix (true when absent).
    """
    types, add_dummy_prefix = [], True
    for field, value in _protobuf_fields(model_proto):
        if field == 1:
            kind = NORMAL
            for piece_field, piece_value in _protobuf_fields(value):
                if piece_field == 3:
                    kind = piece_value
            types.append(kind)
        elif field == 3:
            for spec_field, spec_value in _protobuf_fields(value):
                if spec_field == 3:
                    add_dummy_prefix = bool(spec_value)
    return types, add_dummy_prefix


def _protobuf_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of one protobuf message: varints as int,
    length-delimited fields as bytes, fixed 32/64-bit fields as raw bytes."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    while pos < len(data):
        key = varint()
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            yield field, varint()
            continue
        size = {1: 8, 5: 4}.get(wire_type)
        if size is None and wire_type != 2:
            raise ValueError(f"unsupported protobuf wire type {wire_type} in a SentencePiece model")
        if size is None:
            size = varint()
        yield field, data[pos : pos + size]
        pos += size
