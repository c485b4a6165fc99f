"""pinload.lora switches are atomic: what can fail is refused before the first write (rank 0, an
alpha of several values, NaN or infinity), a failure while writing puts the previous state back
bit for bit, convolutions in channels_last are fused (not failed midway), and verify_base compares
bits. The tiny SDXL-like pipeline and the adapter writers are test_lora's."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

import pinload  # noqa: E402
import pinload.lora as pl  # noqa: E402

from test_lora import (_pipeline, _state, assert_close_to_reference, make_adapter, write_kohya,  # noqa: E402
                       write_peft)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_bits(now, before):
    assert now.keys() == before.keys()
    changed = [k for k in before if not torch.equal(bits(now[k]), bits(before[k]))]
    assert not changed, f"{len(changed)} weights changed, e.g. {changed[:3]}"


def _fused_text(pipe, tmp_path):
    """A fuser over ``pipe`` with an adapter touching the UNet and both text encoders fused: a later
    switch to a UNet-only set must restore the text encoders' weights (the writes that ran before
    the old code failed)."""
    base = _state(pipe)
    fuser = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"))
    first = write_peft(make_adapter(pipe, seed=1), tmp_path / "first.safetensors")
    fuser.switch([(first, 1.0)])
    return fuser, base, first


def _rank0(pipe, tmp_path, name, alpha):
    """A kohya adapter whose last module has rank 0 (with or without its alpha), after good ones."""
    good = make_adapter(pipe, seed=2, text=False)
    path = write_kohya(good, tmp_path / f"{name}.safetensors")
    sd = st.load_file(str(path))
    w = pipe.unet.mid_block.attentions[0].proj_out.weight
    key = "lora_unet_middle_block_1_proj_out"
    sd.update({f"{key}.lora_down.weight": torch.zeros(0, w.shape[1]),
               f"{key}.lora_up.weight": torch.zeros(w.shape[0], 0)})
    sd.pop(f"{key}.alpha", None)
    if alpha:
        sd[f"{key}.alpha"] = torch.tensor(4.0)
    st.save_file(sd, str(path))
    return path, f"{key}.lora_down.weight"


@pytest.mark.parametrize("alpha", [False, True])
def test_rank0_adapter_is_refused_before_any_write(tmp_path, alpha):
    """Old code: without alpha the switch failed in _fuse_one after it had restored the text
    encoders (neither the old state nor the base); with alpha a ZeroDivisionError."""
    pipe = _pipeline(torch.float32)
    fuser, base, first = _fused_text(pipe, tmp_path)
    before = _state(pipe)
    path, key = _rank0(pipe, tmp_path, "rank0", alpha)
    with pytest.raises(pl.LoraShapeError, match="rank 0") as e:
        fuser.switch([(path, 1.0)])
    assert e.value.file == str(path) and e.value.tensor == key and isinstance(e.value, pinload.InvalidFileError)
    assert_same_bits(_state(pipe), before)
    assert [a.path for a, _ in fuser.active] == [str(first)]
    fuser.unfuse()
    assert_same_bits(_state(pipe), base)


def test_alpha_of_two_values_and_bad_metadata_alpha_are_typed_errors(tmp_path):
    """Old code: a RuntimeError from .item(), and a ZeroDivisionError for r = 0 in the metadata."""
    pipe = _pipeline(torch.float32)
    fuser, base, _ = _fused_text(pipe, tmp_path)
    before = _state(pipe)
    path = write_kohya(make_adapter(pipe, seed=3, text=False), tmp_path / "alpha2.safetensors")
    sd = st.load_file(str(path))
    key = next(k for k in sd if k.endswith(".alpha"))
    sd[key] = torch.tensor([8.0, 8.0])
    st.save_file(sd, str(path))
    with pytest.raises(pl.LoraShapeError, match="one value") as e:
        fuser.switch([(path, 1.0)])
    assert e.value.file == str(path) and e.value.tensor == key

    adapter = make_adapter(pipe, seed=4, text=False)
    adapter["rank"] = 0  # written into the metadata as r = 0
    peft = write_peft(adapter, tmp_path / "r0.safetensors")
    with pytest.raises(pinload.InvalidFileError, match="r for this module") as e:
        fuser.switch([(peft, 1.0)])
    assert isinstance(e.value, pl.LoraValueError) and e.value.file == str(peft)
    assert e.value.tensor.endswith(".lora_A.weight")
    assert_same_bits(_state(pipe), before)


@pytest.mark.parametrize("where", ["up", "down", "alpha"])
def test_nonfinite_adapter_is_refused_unless_allowed(tmp_path, where):
    """Old code fused NaN and infinity silently."""
    pipe = _pipeline(torch.float32)
    fuser, base, first = _fused_text(pipe, tmp_path)
    before = _state(pipe)
    path = write_kohya(make_adapter(pipe, seed=5, text=False), tmp_path / "nan.safetensors")
    sd = st.load_file(str(path))
    module = "lora_unet_middle_block_1_proj_in"
    if where == "alpha":
        sd[f"{module}.alpha"] = torch.tensor(float("inf"))
    else:
        t = sd[f"{module}.lora_{where}.weight"]
        t.view(-1)[3] = float("nan") if where == "up" else float("-inf")
    st.save_file(sd, str(path))
    with pytest.raises(pinload.InvalidFileError, match="allow_nonfinite") as e:  # old code: no error
        fuser.switch([(path, 1.0)])
    assert isinstance(e.value, pl.LoraValueError) and e.value.file == str(path)
    assert e.value.tensor == f"{module}.lora_down.weight"
    named = "alpha is inf" if where == "alpha" else f"{module}.lora_{where}.weight"
    assert named in str(e.value)
    assert_same_bits(_state(pipe), before)
    with pytest.raises(pinload.InvalidArgumentError, match="not a finite number"):
        fuser.switch([(first, float("nan"))])
    assert_same_bits(_state(pipe), before)

    allowed = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"), allow_nonfinite=True)
    fuser.unfuse()
    allowed.switch([(path, 1.0)])
    w = _state(pipe)["unet/mid_block.attentions.0.proj_in.weight"]
    assert not bool(torch.isfinite(w).all())
    allowed.switch([(first, 1.0)])  # a weight holding NaN is restored from the base, bit for bit
    allowed.unfuse()
    assert_same_bits(_state(pipe), base)


def test_verify_base_compares_bits(tmp_path):
    """A weight holding NaN equal bit for bit to its base copy is accepted (old code: torch.equal,
    NaN != NaN, refused it as differing); a base one bit away (-0.0 for 0.0) is refused."""
    pipe = _pipeline(torch.float32)
    w = pipe.unet.mid_block.attentions[0].proj_in.weight.data
    w.view(-1)[0] = float("nan")
    w.view(-1)[1] = 0.0
    base = _state(pipe)
    path = write_kohya(make_adapter(pipe, seed=6, text=False), tmp_path / "a.safetensors")
    fuser = pl.LoraFuser(pipe, base, library=pl.LoraLibrary("64M"))
    fuser.switch([(path, 1.0)])
    fuser.unfuse()
    assert_same_bits(_state(pipe), base)

    off = dict(base)
    off["unet/mid_block.attentions.0.proj_in.weight"] = base["unet/mid_block.attentions.0.proj_in.weight"].clone()
    off["unet/mid_block.attentions.0.proj_in.weight"].view(-1)[1] = -0.0
    strict = pl.LoraFuser(pipe, off, library=pl.LoraLibrary("64M"))
    with pytest.raises(pinload.InvalidArgumentError, match="differs from its base copy") as e:
        strict.switch([(path, 1.0)])
    assert e.value.tensor == "unet/mid_block.attentions.0.proj_in.weight"
    assert_same_bits(_state(pipe), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_last_conv_is_fused_in_its_layout(tmp_path, dtype):
    """A conv adapter fused into a channels_last UNet (base copies channels_last too): the same bits
    as the contiguous model's fuse, within the float64 reference's bound, the weights still
    channels_last; unfuse gives the base back. Old code: a view error in _fuse_one after the
    restores had run."""
    adapters = []
    results = []
    for channels_last in (False, True):
        pipe = _pipeline(dtype)
        if channels_last:
            pipe.unet.to(memory_format=torch.channels_last)
        fuser, base, _ = _fused_text(pipe, tmp_path)
        a = make_adapter(pipe, seed=7, conv=True, dtype=dtype)
        path = write_kohya(a, tmp_path / f"conv{channels_last}.safetensors")
        fuser.switch([(path, 0.7)])
        conv = pipe.unet.down_blocks[1].resnets[0].conv1.weight
        assert conv.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert_close_to_reference(_state(pipe), base, [(a, 0.7)], dtype)
        results.append({k: v.contiguous() for k, v in _state(pipe).items()})
        adapters.append(a)
        fuser.unfuse()
        assert_same_bits(_state(pipe), base)
        assert conv.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert all(torch.equal(bits(results[0][k]), bits(results[1][k])) for k in results[0])


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("base_given", [True, False])
@pytest.mark.parametrize("also_the_undo", [False, True])
def test_a_write_failing_mid_switch_puts_the_previous_state_back(tmp_path, monkeypatch, base_given,
                                                                  also_the_undo):
    """The third weight's fuse raises: every weight is bit for bit as before the switch and the
    previous set is still active (old code: the restores and two fuses stayed). If putting back
    fails as well, the model is at its base and no adapter is active."""
    pipe = _pipeline(torch.bfloat16)
    base = _state(pipe)
    fuser = pl.LoraFuser(pipe, base if base_given else None, library=pl.LoraLibrary("64M"))
    a = write_kohya(make_adapter(pipe, seed=8, conv=True, dtype=torch.bfloat16), tmp_path / "a.safetensors")
    b = write_peft(make_adapter(pipe, rank=8, seed=9, dtype=torch.bfloat16), tmp_path / "b.safetensors")
    c = write_kohya(make_adapter(pipe, rank=6, seed=10, text=False), tmp_path / "c.safetensors")
    fuser.switch([(a, 0.8), (b, -0.5)])
    before = _state(pipe)

    real = pl.LoraFuser._fuse_one
    calls = []

    def failing(self, name, pairs, base_w):
        calls.append(name)
        if len(calls) == 3 or (also_the_undo and len(calls) > 3):
            # a partial write first, as a failure inside the product would leave it
            self._target.weights[name].view(-1)[:5] = 1.0
            raise Injected(f"injected at {name}")
        return real(self, name, pairs, base_w)

    monkeypatch.setattr(pl.LoraFuser, "_fuse_one", failing)
    with pytest.raises(Injected) as e:
        fuser.switch([(c, 1.0)])
    assert len(calls) >= 3
    if also_the_undo:
        assert_same_bits(_state(pipe), base)
        assert fuser.active == [] and fuser.touched() == []
        assert "at its base" in "".join(getattr(e.value, "__notes__", []))
    else:
        assert_same_bits(_state(pipe), before)
        assert [x.path for x, _ in fuser.active] == [str(a), str(b)]
    monkeypatch.setattr(pl.LoraFuser, "_fuse_one", real)
    fuser.switch([(c, 1.0)])  # the fuser still works, from either state
    fresh = _pipeline(torch.bfloat16)
    ref = pl.LoraFuser(fresh, base, library=pl.LoraLibrary("64M"))
    ref.switch([(c, 1.0)])
    assert_same_bits(_state(pipe), _state(fresh))
    fuser.unfuse()
    assert_same_bits(_state(pipe), base)


def test_library_sees_a_file_rewritten_with_its_mtime_set_back(tmp_path):
    """An adapter rewritten in place (same inode and size) with its mtime restored to the
    nanosecond is read again, not served from the old entry: the key has the ctime, which no
    caller can set back. Old code: the stale tensors."""
    import os

    unet = _pipeline(torch.float32).unet
    path = write_peft(make_adapter(unet, seed=20, text=False), tmp_path / "a.safetensors")
    lib = pl.LoraLibrary("64M")
    first = lib.get(path)
    key = next(iter(first.tensors))
    old = first.tensors[key].clone()
    st_before = os.stat(path)
    other = tmp_path / "b.safetensors"
    write_peft(make_adapter(unet, seed=21, text=False), other)
    data = other.read_bytes()
    assert len(data) == st_before.st_size
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st_before.st_ino, st_before.st_size,
                                                              st_before.st_mtime_ns)
    fresh = lib.get(path).tensors[key]
    want = st.load_file(str(other))[key]
    assert torch.equal(fresh, want) and not torch.equal(fresh, old)
    assert lib.stats()["invalidations"] == 1
