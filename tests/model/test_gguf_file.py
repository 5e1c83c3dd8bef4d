"""pyllm.model.gguf_file against the gguf package's reader on the bundled SmolLM2 GGUF and on
small files written here; clear errors for files that are missing, not GGUF, or cut short."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from pyllm.model.default_model import default_model_path
from pyllm.model.gguf_file import GGUFFile, open_gguf


def _write(path, metadata: dict, tensors: dict) -> None:
    """metadata: key -> (value, GGUFValueType or None for a string); tensors: name -> float32
    array (stored F32) or (raw uint8 array, GGMLQuantizationType)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, value_type) in metadata.items():
        if key == "general.alignment":
            writer.add_custom_alignment(value)  # the writer pads the data to it
        elif value_type is None:
            writer.add_string(key, value)
        elif value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, value_type)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reader_metadata(reader: gguf.GGUFReader) -> dict:
    # GGUFReader lists the header's version and counts as fields "GGUF.*"; they are not metadata.
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _python(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_smollm_metadata_and_tensors_equal_gguf_reader():
    path = default_model_path()
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)

    theirs = _reader_metadata(reader)
    assert list(ours.metadata) == list(theirs)  # same keys, same order
    for key, value in theirs.items():
        assert _python(ours.metadata[key]) == value, key
        assert type(_python(ours.metadata[key])) is type(value), key
    assert isinstance(ours.metadata["tokenizer.ggml.token_type"], np.ndarray)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(ours.metadata["tokenizer.ggml.merges"]) == 48900

    assert ours.version == 3
    assert ours.alignment == reader.alignment == 32
    assert ours.data_offset == reader.data_offset
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    types = set()
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_id == int(t.tensor_type) and mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.nbytes == t.n_bytes and mine.offset == t.data_offset
        types.add(mine.type_name)
    assert types == {"Q8_0", "Q4_1", "F32"}

    # Raw bytes, for a quantized tensor of each type and an F32 one.
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        (t,) = [t for t in reader.tensors if t.name == name]
        raw = ours.tensors[name].raw
        assert raw.dtype == np.uint8 and raw.shape == t.data.shape
        np.testing.assert_array_equal(raw, t.data)
    (t,) = [t for t in reader.tensors if t.name == "output_norm.weight"]
    assert ours.tensors["output_norm.weight"].raw.tobytes() == t.data.tobytes()


def test_raw_is_rows_of_blocks_and_a_view_of_the_map():
    tensor = open_gguf(default_model_path()).tensors["blk.0.ffn_down.weight"]
    assert tensor.type_name == "Q4_1" and tensor.shape == (576, 1536)
    assert (tensor.block_size, tensor.type_size) == gguf.GGML_QUANT_SIZES[
        gguf.GGMLQuantizationType.Q4_1
    ]
    raw = tensor.raw
    assert raw.shape == (576, 1536 // 32 * 20) and raw.nbytes == tensor.nbytes
    assert type(raw) is np.ndarray and not raw.flags.writeable and not raw.flags.owndata
    with open(default_model_path(), "rb") as f:
        f.seek(tensor.offset)
        assert f.read(tensor.nbytes) == raw.tobytes()


def test_typed_views_of_unquantized_tensors(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 40)).astype(np.float32)
    f16 = rng.standard_normal((2, 8)).astype(np.float16)
    bf16_bits = (f32[0].view(np.uint32) >> 16).astype(np.uint16)
    q8 = gguf.quants.quantize(f32[:, :32], gguf.GGMLQuantizationType.Q8_0)
    _write(
        tmp_path / "t.gguf",
        {},
        {
            "f32": f32,
            "f16": (f16, gguf.GGMLQuantizationType.F16),
            "bf16": (bf16_bits.view(np.uint8), gguf.GGMLQuantizationType.BF16),
            "q8": (q8, gguf.GGMLQuantizationType.Q8_0),
        },
    )
    file = GGUFFile(tmp_path / "t.gguf")
    values = file.tensors["f32"].array()
    assert values.dtype == np.float32 and values.shape == (3, 40)
    np.testing.assert_array_equal(values, f32)
    assert not values.flags.owndata and not values.flags.writeable  # a view, not a copy
    assert file.tensors["f32"].raw.shape == (3, 160)
    np.testing.assert_array_equal(file.tensors["f16"].array(), f16)
    assert file.tensors["f16"].array().dtype == np.float16
    bf16 = file.tensors["bf16"]
    assert bf16.shape == (40,) and bf16.array().dtype == np.uint16
    np.testing.assert_array_equal(bf16.array(), bf16_bits)
    assert file.tensors["q8"].shape == (3, 32) and file.tensors["q8"].raw.shape == (3, 34)
    np.testing.assert_array_equal(file.tensors["q8"].raw, q8)
    with pytest.raises(ValueError, match=r"'q8' is quantized \(Q8_0\)"):
        file.tensors["q8"].array()


def test_metadata_value_types_and_alignment(tmp_path):
    V = gguf.GGUFValueType
    metadata = {
        "general.alignment": (64, V.UINT32),
        "a.u8": (200, V.UINT8),
        "a.i16": (-3, V.INT16),
        "a.u64": (2**40, V.UINT64),
        "a.f64": (0.1, V.FLOAT64),
        "a.bool": (True, V.BOOL),
        "a.str": ("h\u00e9llo", None),
        "a.floats": ([0.5, -1.25], V.ARRAY),
        "a.strings": (["x", "", "\u2581y"], V.ARRAY),
        "a.nested": ([[1, 2], [3]], V.ARRAY),
    }
    _write(tmp_path / "m.gguf", metadata, {"w": np.ones((2, 32), np.float32)})
    file = GGUFFile(tmp_path / "m.gguf")
    theirs = _reader_metadata(gguf.GGUFReader(tmp_path / "m.gguf"))
    assert file.alignment == 64 and file.data_offset % 64 == 0
    for key, (value, _) in metadata.items():
        if key == "a.nested":  # GGUFReader flattens nested arrays' contents
            assert [a.tolist() for a in file.metadata[key]] == value
            continue
        assert _python(file.metadata[key]) == theirs[key], key
    assert file.metadata["a.floats"].dtype == np.float32
    assert file.metadata["a.strings"] == ["x", "", "\u2581y"]
    np.testing.assert_array_equal(file.tensors["w"].array(), np.ones((2, 32), np.float32))


def test_open_gguf_reuses_the_parse_until_the_file_changes(tmp_path):
    path = tmp_path / "c.gguf"
    _write(path, {}, {"w": np.zeros((1, 32), np.float32)})
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    _write(path, {}, {"w": np.zeros((1, 64), np.float32)})
    os.utime(path, ns=(0, 0))  # a different mtime even on coarse clocks
    second = open_gguf(path)
    assert second is not first and second.tensors["w"].shape == (1, 64)


def test_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        GGUFFile(missing)
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        open_gguf(missing)

    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(ValueError, match=r"magic\.gguf is not a readable GGUF file: bad magic"):
        GGUFFile(bad_magic)
    version = tmp_path / "version.gguf"
    version.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match=r"version\.gguf .*unsupported GGUF version 7"):
        GGUFFile(version)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"tiny\.gguf .*truncated"):
        GGUFFile(tiny)

    good = tmp_path / "good.gguf"
    _write(
        good,
        {"a.strings": (["one", "two", "three"], gguf.GGUFValueType.ARRAY)},
        {"w": np.ones((4, 32), np.float32)},
    )
    whole = good.read_bytes()
    file = GGUFFile(good)
    header_end = file.data_offset
    # Cut inside the key-value section, inside the tensor table, and inside the tensor data.
    for cut in (40, header_end - 40, len(whole) - 1):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf is not a readable GGUF .*truncated"):
            GGUFFile(short)
