"""Every user path hands a cached file out zero-copy when the requested dtype is the stored one
(Note [A dtype that changes nothing] in src/load/convert_on_load.cc).

The hooks pass the model's dtype to every load (Note [dtype through the conversion]); when it equals
the stored dtype nothing converts, so the load must stay on the zero-copy route, as a plain load is.
Each case runs in a fresh interpreter (a new worker: the pool has no memory to spare) and checks
what was mapped, not how long it took: every tensor's bytes must lie inside a mapping of the file
itself (/proc/self/maps), and equal safetensors' bytes. A real conversion (bf16 asked of an fp16
file) must not be handed out from the mapping.
"""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import safetensors.torch as st

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

# Run in the child: where each tensor's bytes live, as (name, in a mapping of `path`, equal bytes).
PRELUDE = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, safetensors.torch as st

sys.path.insert(0, sys.argv.pop())  # tests/python, for pl_helpers
from pl_helpers import mapped_ranges

def report(tensors, path):
    ranges = mapped_ranges(path)
    ref = st.load(open(path, "rb").read())
    rows = {}
    for name, t in tensors.items():
        p = t.data_ptr()
        inside = any(lo <= p and p + t.untyped_storage().nbytes() <= hi for lo, hi in ranges) if t.numel() else True
        same = name in ref and t.dtype == ref[name].dtype and \\
            t.contiguous().view(torch.uint8).equal(ref[name].contiguous().view(torch.uint8))
        rows[name] = [inside, same]
    print("ROWS " + json.dumps(rows))
"""


def run_fresh(code: str, *args: str) -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args, here], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ROWS "))
    return json.loads(line[5:])


def assert_all_mapped(rows: dict, what: str) -> None:
    assert rows, what
    not_mapped = [n for n, (inside, _) in rows.items() if not inside]
    differ = [n for n, (_, same) in rows.items() if not same]
    assert not differ, f"{what}: bytes differ from safetensors' for {differ[:5]}"
    assert not not_mapped, f"{what}: {len(not_mapped)}/{len(rows)} tensors copied, not mapped: {not_mapped[:5]}"


@pytest.fixture(scope="module")
def fp16_file(tmp_path_factory):
    gen = torch.Generator().manual_seed(7)
    tensors = {f"blocks.{i}.weight": (torch.randn(256, 260, generator=gen) * 0.02).half() for i in range(5)}
    tensors["norm.weight"] = torch.ones(1024, dtype=torch.float16)
    tensors["position_ids"] = torch.arange(77)
    path = tmp_path_factory.mktemp("zc") / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("call", [
    "pt.load_file(path, dtype=torch.float16)",
    "pt.load_file(path, dtype='fp16')",
    "pt.load_files([path], dtype=torch.float16)",
    "(lambda f: {k: f.get_tensor(k) for k in f.keys()})(pt.safe_open(path, 'pt', dtype=torch.float16))",
])
def test_same_dtype_is_handed_out_from_the_mapping(fp16_file, call):
    rows = run_fresh(f"""
        import pinload.torch as pt
        path = sys.argv[1]
        report({call}, path)
    """, str(fp16_file))
    assert_all_mapped(rows, call)


def test_a_real_conversion_is_not_handed_out_from_the_mapping(fp16_file):
    rows = run_fresh("""
        import pinload.torch as pt
        path = sys.argv[1]
        got = pt.load_file(path, dtype=torch.bfloat16)
        assert got["blocks.0.weight"].dtype == torch.bfloat16
        ref = st.load_file(path)
        assert torch.equal(got["blocks.0.weight"], ref["blocks.0.weight"].to(torch.bfloat16))
        report({k: v for k, v in got.items() if v.dtype != torch.bfloat16}, path)
        print("converted in", any(lo <= got["blocks.0.weight"].data_ptr() < hi for lo, hi in mapped_ranges(path)))
    """, str(fp16_file))
    # Only the integer tensor keeps its dtype; it may be mapped or copied, but its bytes are the file's.
    assert list(rows) == ["position_ids"] and rows["position_ids"][1]


def save_fp16_models(root):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(11)
    vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                        sample_size=32).half()
    vae.save_pretrained(root / "vae", safe_serialization=True)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=16)).half()
    clip.save_pretrained(root / "clip", safe_serialization=True)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_fp16_models(root)
    return root


def test_patch_diffusers_from_pretrained_in_the_stored_dtype_maps_the_file(hf_models):
    path = hf_models / "vae" / "diffusion_pytorch_model.safetensors"
    rows = run_fresh("""
        import pinload
        from diffusers import AutoencoderKL
        folder, path = sys.argv[1], sys.argv[2]
        with pinload.patch_diffusers() as patch:
            vae = AutoencoderKL.from_pretrained(folder, torch_dtype=torch.float16)
        assert patch.counts().get("files", 0) >= 1, patch.counts()
        report(dict(vae.state_dict()), path)
    """, str(hf_models / "vae"), str(path))
    assert_all_mapped(rows, "patch_diffusers AutoencoderKL fp16")


def test_patch_transformers_from_pretrained_in_the_stored_dtype_maps_the_file(hf_models):
    path = hf_models / "clip" / "model.safetensors"
    rows = run_fresh("""
        import pinload
        from transformers import CLIPTextModel
        folder, path = sys.argv[1], sys.argv[2]
        with pinload.patch_transformers() as patch:
            clip = CLIPTextModel.from_pretrained(folder, torch_dtype=torch.float16)
        assert patch.counts().get("files", 0) >= 1, patch.counts()
        # transformers may tie or rename a few buffers; every parameter that the file holds must be mapped.
        file_names = set(st.load_file(path))
        report({k: v for k, v in clip.state_dict().items() if k in file_names}, path)
    """, str(hf_models / "clip"), str(path))
    assert_all_mapped(rows, "patch_transformers CLIPTextModel fp16")
