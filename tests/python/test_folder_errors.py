"""load_file on a folder that exists but holds no .safetensors file says so, as a typed error
naming the folder (it said "No such file or directory", the reference's message for a path that
does not exist); a path that does not exist keeps the reference's message."""

import pytest
import torch
from safetensors.torch import save_file

import pinload
import pinload.numpy
import pinload.torch

LOADERS = {"torch": pinload.torch.load_file, "numpy": pinload.numpy.load_file}


@pytest.mark.parametrize("api", sorted(LOADERS))
def test_empty_folder_names_the_folder(tmp_path, api):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "README.md").write_text("not weights")
    with pytest.raises(pinload.NotFoundError) as e:
        LOADERS[api](folder)
    assert str(e.value) == f"{folder}: folder holds no .safetensors file"
    assert e.value.file == str(folder)
    assert "No such file" not in str(e.value)
    assert isinstance(e.value, FileNotFoundError)  # still what the reference raises for a missing file


@pytest.mark.parametrize("api", sorted(LOADERS))
def test_folder_of_another_variant_names_it(tmp_path, api):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.fp16.safetensors"))
    with pytest.raises(pinload.NotFoundError) as e:
        LOADERS[api](tmp_path)
    assert str(e.value).startswith(f"{tmp_path}: folder holds no .safetensors file")
    assert "fp16" in str(e.value)


@pytest.mark.parametrize("api", sorted(LOADERS))
def test_missing_path_keeps_the_references_message(tmp_path, api):
    path = tmp_path / "nowhere.safetensors"
    with pytest.raises(pinload.NotFoundError) as e:
        LOADERS[api](path)
    assert str(e.value) == f"No such file or directory: {path}"
    assert isinstance(e.value, FileNotFoundError)
