"""`wd-engine quantize`: a Hugging Face Qwen3-MoE folder to an FP8 (Qwen's format) or int4
(compressed-tensors W4A16) one. The written tensors' layout, the engine's logits on the result
against the same model with the dequantized weights written in fp32, transformers reading the
result, sharding, and the refusals (an existing DST, a quantized SRC, sizes the block or group do
not divide), which leave everything as it was."""

import json
import os
import shutil

import pytest
import torch
from checkpoints import engine_logits, max_rel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.cli import main
from engine.loading import quantize as quantize_module

SIZE = 16  # fp8 block and int4 group: divides every projection of the tiny checkpoint (64, 96, 48)
FORMATS = ["fp8", "int4"]
FP8 = torch.float8_e4m3fn
# 3 layers' q/k/v/o, 2 MoE layers' 8 experts' gate/up/down, the dense layer's gate/up/down.
N_QUANTIZED = 3 * 4 + 2 * 8 * 3 + 3
INDEX = "model.safetensors.index.json"


def _size_flag(fmt: str) -> list[str]:
    return ["--block", str(SIZE)] if fmt == "fp8" else ["--group", str(SIZE)]


@pytest.fixture(scope="module")
def src(checkpoint_factory, tmp_path_factory):
    """A sharded fp32 checkpoint (an index, 11 files) with a dense layer (1) between MoE layers, a
    README to carry over, and a hidden cache folder and a stray .bin weight file not to."""
    folder = tmp_path_factory.mktemp("src") / "model"
    shutil.copytree(checkpoint_factory(mlp_only_layers=(1,), max_shard_size="100KB"), folder)
    (folder / "README.md").write_text("# tiny\n")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("x")
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    return folder


def _run(capsys, *args) -> tuple[int, str, str]:
    code = main(["quantize", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def quantized(src, tmp_path_factory):
    """fmt -> (DST folder, the command's standard output)."""
    import contextlib
    import io

    done = {}
    for fmt in FORMATS:
        dst = tmp_path_factory.mktemp(fmt) / "model"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["quantize", "--to", fmt, *_size_flag(fmt), str(src), str(dst)]) == 0
        done[fmt] = dst, out.getvalue()
    return done


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _reference_fp8(q, scale_inv, block):
    out_f, in_f = q.shape
    spread = scale_inv.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return q.float() * spread


def _reference_int4(packed, scale, shape):
    """compressed-tensors' layout spelled out: column 8k+j at bits 4j of word k, as q + 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (((packed[..., None] >> shifts) & 0xF) - 8).flatten(1)
    assert list(q.shape) == shape
    return q.float() * scale.float().repeat_interleave(q.shape[1] // scale.shape[1], 1)


def _dequantized(fmt: str, tensors: dict, name: str) -> torch.Tensor:
    if fmt == "fp8":
        return _reference_fp8(tensors[name], tensors[name + "_scale_inv"], SIZE)
    return _reference_int4(
        tensors[name + "_packed"], tensors[name + "_scale"], tensors[name + "_shape"].tolist()
    )


def _is_projection(name, t):
    return t.ndim == 2 and name.endswith("_proj.weight")


def _ids():
    return torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(5))


# --- what is written --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_tensors_and_files(src, quantized, fmt):
    dst, summary = quantized[fmt]
    before = _tensors(src)
    after = _tensors(dst)
    projections = {n for n, t in before.items() if _is_projection(n, t)}
    assert len(projections) == N_QUANTIZED
    assert any(".mlp.gate_proj." in n for n in projections)  # the dense layer's MLP
    suffixes = ("", "_scale_inv") if fmt == "fp8" else ("_packed", "_scale", "_shape")
    assert set(after) == (set(before) - projections) | {
        n + s for n in projections for s in suffixes
    }
    for name, t in before.items():
        if name not in projections:  # embedding, lm_head, routers, norms: as stored
            assert after[name].dtype == t.dtype == torch.float32 and torch.equal(after[name], t)
            continue
        out_f, in_f = t.shape
        if fmt == "fp8":
            assert after[name].dtype == FP8 and after[name].shape == t.shape, name
            scale = after[name + "_scale_inv"]
            assert scale.dtype == torch.float32, name
            assert scale.shape == (out_f // SIZE, in_f // SIZE), name
            # FP8's 3 mantissa bits: within 1/16 of the block's largest value, by the scale.
            assert (_dequantized(fmt, after, name) - t).abs().max() <= t.abs().max() / 16, name
        else:
            assert after[name + "_packed"].dtype == torch.int32, name
            assert after[name + "_packed"].shape == (out_f, in_f // 8), name
            assert after[name + "_scale"].dtype == torch.bfloat16, name
            assert after[name + "_scale"].shape == (out_f, in_f // SIZE), name
            assert after[name + "_shape"].tolist() == [out_f, in_f], name
            # Half a step of the group's grid at most, from the weight's bf16 value.
            step = after[name + "_scale"].float().repeat_interleave(SIZE, 1)
            error = (_dequantized(fmt, after, name) - t.bfloat16().float()).abs()
            assert (error <= step / 2).all(), name
    # One file under the default shard size; the source's shards and index are gone.
    assert sorted(p.name for p in dst.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in ("README.md", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    assert f"{N_QUANTIZED} of {len(before)} tensors quantized to {fmt}" in summary
    assert summary.count("\n") == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bf16_src_quantizes_to_the_same_tensors(checkpoint_factory, quantized, fmt, tmp_path):
    """The quantizers start from a weight's bf16 value: the bf16 copy of the fp32 SRC gives the same
    quantized tensors; the rest stays bf16, as stored."""
    bf16 = checkpoint_factory(mlp_only_layers=(1,), dtype=torch.bfloat16)
    dst = tmp_path / "out"
    assert main(["quantize", "--to", fmt, *_size_flag(fmt), str(bf16), str(dst)]) == 0
    got, want = _tensors(dst), _tensors(quantized[fmt][0])
    assert got.keys() == want.keys()
    for name, t in got.items():
        if want[name].dtype == torch.float32 and not name.endswith("_scale_inv"):
            assert t.dtype == torch.bfloat16 and torch.equal(t, want[name].bfloat16()), name
        else:
            assert t.dtype == want[name].dtype, name
            assert torch.equal(t.view(torch.uint8), want[name].view(torch.uint8)), name


def test_fp8_config_is_qwens_format(src, quantized):
    dst, _ = quantized["fp8"]
    config = json.loads((dst / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert config == json.loads((src / "config.json").read_text())
    assert {k: quant[k] for k in ("quant_method", "fmt", "activation_scheme")} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
    }
    assert quant["weight_block_size"] == [SIZE, SIZE]
    # The routers of the MoE layers (0 and 2; layer 1 is dense) stay unquantized.
    assert set(quant["modules_to_not_convert"]) == {
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.2.mlp.gate",
    }


def test_int4_config_is_compressed_tensors_w4a16(quantized):
    from engine.loading import int4

    dst, _ = quantized["int4"]
    config = json.loads((dst / "config.json").read_text())
    assert int4.config_group_size(config) == SIZE
    quant = config["quantization_config"]
    assert quant["format"] == "pack-quantized" and quant["quantization_status"] == "compressed"
    assert set(quant["ignore"]) == {"lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"}


def test_default_sizes_are_128(quantized):
    from engine.cli import build_parser

    args = build_parser().parse_args(["quantize", "--to", "fp8", "a", "b"])
    assert (args.block, args.group, args.max_shard_gb) == (128, 128, 5.0)


# --- the engine and transformers on the result -----------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_loads_dst_as_its_dequantized_weights(src, quantized, fmt, tmp_path):
    """The same model with every projection replaced by its dequantized value, written in fp32:
    the engine's fp32 logits on the two folders agree."""
    dst, _ = quantized[fmt]
    before, after = _tensors(src), _tensors(dst)
    plain = {
        name: _dequantized(fmt, after, name) if _is_projection(name, t) else t
        for name, t in before.items()
    }
    assert sum(not torch.equal(plain[n], before[n]) for n in before) == N_QUANTIZED
    folder = tmp_path / "plain"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, folder / name)
    save_file(plain, folder / "model.safetensors")

    ids = _ids()
    ours = engine_logits(dst, ids)
    want = engine_logits(folder, ids)
    assert want.std() > 0.1
    assert max_rel(ours, want) < 1e-6
    # And the quantized model is still the source model, roughly.
    assert max_rel(ours, engine_logits(src, ids)) < (0.15 if fmt == "fp8" else 0.4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_loads_dst_like_the_engine(quantized, fmt):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate" if fmt == "fp8" else "compressed_tensors")
    dst, _ = quantized[fmt]
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    # Dequantized int4 experts keep their scales' dtype (bf16); their values are exact in bf16, so
    # fp32 copies are the stored weights (transformers refuses .float() on a quantized model).
    for p in hf.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert theirs.std() > 0.1
    assert max_rel(engine_logits(dst, ids), theirs) < 1e-4


# --- shards ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_small_shards_get_an_index(src, quantized, fmt, tmp_path, capsys):
    limit = 40_000  # bytes: the tiny model's projections are 3-12 KB each, its embedding 77 KB
    dst = tmp_path / "sharded"
    code, out, _ = _run(
        capsys, "--to", fmt, *_size_flag(fmt), "--max-shard-gb", limit / 1e9, src, dst
    )
    assert code == 0
    files = sorted(dst.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and f"in {n} shards" in out
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((dst / INDEX).read_text())
    held = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names = list(handle.keys())
            sizes = [handle.get_tensor(k).nbytes for k in names]
        held.update(dict.fromkeys(names, f.name))
        # Within the limit, unless one tensor alone (with its scales) is larger.
        assert sum(sizes) <= limit or len({k.split("weight")[0] for k in names}) == 1, f.name
    assert index["weight_map"] == held
    whole = _tensors(quantized[fmt][0])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in whole.values())
    # A weight's scales sit in its shard.
    for name, file in held.items():
        base = name.split("_proj.weight")[0]
        if base != name:
            assert held[base + "_proj.weight" + ("" if fmt == "fp8" else "_packed")] == file
    sharded = _tensors(dst)
    assert sharded.keys() == whole.keys()
    assert all(
        torch.equal(sharded[k].view(torch.uint8), whole[k].view(torch.uint8))
        for k in whole
        if whole[k].dtype == FP8
    )
    assert all(torch.equal(sharded[k], whole[k]) for k in whole if whole[k].dtype != FP8)
    ids = _ids()
    torch.testing.assert_close(
        engine_logits(dst, ids), engine_logits(quantized[fmt][0], ids), rtol=0, atol=0
    )


# --- refusals ------------------------------------------------------------------------------------


def _listing(folder):
    return sorted(
        (str(p.relative_to(folder)), p.is_symlink(), p.read_bytes() if p.is_file() else None)
        for p in folder.rglob("*")
    )


def test_an_existing_dst_is_refused_and_left_alone(src, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "config.json").write_text("mine")
    before = _listing(tmp_path)
    code, _, err = _run(capsys, "--to", "fp8", *_size_flag("fp8"), src, dst)
    assert code == 1 and "exists" in err and "never overwrites" in err
    assert _listing(tmp_path) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "--to", "int4", *_size_flag("int4"), src, empty)
    assert code == 1 and "exists" in err
    assert not any(empty.iterdir())


@pytest.mark.parametrize("target", ["folder", "dangling"])
def test_a_symlinked_dst_is_refused_not_followed(src, tmp_path, capsys, target):
    real = tmp_path / "real"
    if target == "folder":
        real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    before = _listing(tmp_path)
    code, _, err = _run(capsys, "--to", "fp8", *_size_flag("fp8"), src, link)
    assert code == 1 and "symbolic link" in err
    assert _listing(tmp_path) == before and os.readlink(link) == str(real)


def test_a_quantized_src_is_refused(quantized, tmp_path, capsys):
    for fmt in FORMATS:
        code, _, err = _run(
            capsys, "--to", "fp8", *_size_flag("fp8"), quantized[fmt][0], tmp_path / fmt
        )
        assert code == 1 and "already quantized" in err
    # Quantized tensors are recognised even when config.json does not say so; the error names one.
    for fmt in FORMATS:
        stripped = tmp_path / f"stripped-{fmt}"
        shutil.copytree(quantized[fmt][0], stripped)
        config = json.loads((stripped / "config.json").read_text())
        del config["quantization_config"]
        (stripped / "config.json").write_text(json.dumps(config))
        code, _, err = _run(capsys, "--to", "int4", *_size_flag("int4"), stripped, tmp_path / "x")
        assert code == 1 and "already quantized" in err and "_proj.weight" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stripped-fp8", "stripped-int4"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--to", "fp8", "--block", "32"], "block 32 does not divide"),  # the experts' 48
        (["--to", "fp8", "--block", "0"], "positive"),
        (["--to", "int4", "--group", "12"], "multiple of 8"),
        (["--to", "int4", "--group", "32"], "group 32 does not divide the 48 input columns"),
        (["--to", "int4"], "group 128 does not divide"),
    ],
)
def test_sizes_the_shapes_do_not_take_are_refused_before_writing(
    src, tmp_path, capsys, flags, message
):
    code, _, err = _run(capsys, *flags, src, tmp_path / "out")
    assert code == 1 and message in err
    assert not any(tmp_path.iterdir())


def test_a_failure_midway_removes_only_the_temporary_folder(src, tmp_path, capsys, monkeypatch):
    written = []
    write = quantize_module._ShardWriter.write

    def failing_write(self, name, t):
        if len(written) == 40:  # a few shards in
            raise OSError("No space left on device")
        written.append(self.path)
        write(self, name, t)

    monkeypatch.setattr(quantize_module._ShardWriter, "write", failing_write)
    (tmp_path / "neighbour").write_text("keep")
    src_before = _listing(src)
    code, _, err = _run(
        capsys, "--to", "fp8", *_size_flag("fp8"), "--max-shard-gb", 4e-5, src, tmp_path / "out"
    )
    assert code == 1 and "No space left" in err
    # The partial shards were written into a hidden sibling, now gone.
    assert len(set(written)) > 1 and all(
        p.parent.name.startswith(".out.quantize-") for p in written
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["neighbour"]
    assert _listing(src) == src_before


def test_an_unknown_format_is_a_usage_error(src, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--to", "int8", str(src), str(tmp_path / "out")])
    assert exc.value.code == 2


# --- --lm-head: the model's own lm_head quantized too ------------------------------------------

# Divides the tiny checkpoint's vocabulary (300) too, as FP8 blocks must.
LM_HEAD_SIZE = {"fp8": 4, "int4": 16}


def _lm_head_flags(fmt: str) -> list[str]:
    size = ["--block" if fmt == "fp8" else "--group", str(LM_HEAD_SIZE[fmt])]
    return ["--to", fmt, *size, "--lm-head"]


@pytest.fixture(scope="module")
def with_lm_head(src, tmp_path_factory):
    """fmt -> a DST written with --lm-head."""
    done = {}
    for fmt in FORMATS:
        dst = tmp_path_factory.mktemp(f"{fmt}-head") / "model"
        assert main(["quantize", *_lm_head_flags(fmt), str(src), str(dst)]) == 0
        done[fmt] = dst
    return done


@pytest.mark.parametrize("fmt", FORMATS)
def test_lm_head_is_written_quantized_and_configured_so(src, with_lm_head, fmt):
    after = _tensors(with_lm_head[fmt])
    stored = _tensors(src)["lm_head.weight"]
    if fmt == "fp8":
        assert after["lm_head.weight"].dtype == FP8
        block = LM_HEAD_SIZE[fmt]
        assert after["lm_head.weight_scale_inv"].shape == (300 // block, 64 // block)
        plain = _reference_fp8(after["lm_head.weight"], after["lm_head.weight_scale_inv"], block)
        assert (plain - stored).abs().max() <= stored.abs().max() / 16
    else:
        assert "lm_head.weight" not in after
        assert after["lm_head.weight_packed"].shape == (300, 64 // 8)
        assert after["lm_head.weight_shape"].tolist() == [300, 64]
    # The embedding stays as stored; the head is no longer among the modules left unquantized.
    assert torch.equal(
        after["model.embed_tokens.weight"], _tensors(src)["model.embed_tokens.weight"]
    )
    quant = json.loads((with_lm_head[fmt] / "config.json").read_text())["quantization_config"]
    kept = quant["modules_to_not_convert"] if fmt == "fp8" else quant["ignore"]
    assert "lm_head" not in kept and "model.layers.0.mlp.gate" in kept


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_and_transformers_read_a_quantized_lm_head(src, with_lm_head, fmt, tmp_path):
    """The engine's logits equal those of the same model with every quantized weight (the lm_head
    among them) written dequantized in fp32, and transformers agrees."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate" if fmt == "fp8" else "compressed_tensors")
    dst = with_lm_head[fmt]
    before, after = _tensors(src), _tensors(dst)
    size = LM_HEAD_SIZE[fmt]

    def plain(name):
        if fmt == "fp8":
            return _reference_fp8(after[name], after[name + "_scale_inv"], size)
        return _reference_int4(
            after[name + "_packed"], after[name + "_scale"], after[name + "_shape"].tolist()
        )

    quantized = {n for n, t in before.items() if _is_projection(n, t)} | {"lm_head.weight"}
    folder = tmp_path / "plain"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, folder / name)
    save_file(
        {n: plain(n) if n in quantized else t for n, t in before.items()},
        folder / "model.safetensors",
    )

    ids = _ids()
    ours = engine_logits(dst, ids)
    assert max_rel(ours, engine_logits(folder, ids)) < 1e-6
    assert not torch.equal(plain("lm_head.weight"), before["lm_head.weight"])
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    for p in hf.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert max_rel(ours, theirs) < 1e-4


def test_lm_head_refusals(src, checkpoint_factory, tmp_path, capsys):
    tied = checkpoint_factory(tie=True)
    code, _, err = _run(capsys, *_lm_head_flags("int4"), tied, tmp_path / "a")
    assert code == 1 and "ties its lm_head to the embedding" in err
    # An FP8 block must divide the vocabulary too (300 is not a multiple of 16).
    code, _, err = _run(capsys, "--to", "fp8", "--block", "16", "--lm-head", src, tmp_path / "b")
    assert code == 1 and "lm_head.weight [300, 64]" in err and "vocabulary" in err
    assert not any(tmp_path.iterdir())


def test_serve_takes_quant_lm_head_only_for_random_quantized_shapes(capsys):
    assert main(["serve", "--quant-lm-head"]) == 2
    assert main(["serve", "--random-shape", "tiny", "--quant-lm-head"]) == 2
    assert "applies to --random-shape with --quant" in capsys.readouterr().err
