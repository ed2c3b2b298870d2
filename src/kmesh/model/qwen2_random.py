"""A Qwen2 of the Qwen2.5-0.5B shape with seeded random weights, built on the machine that uses it.

Nothing is stored (bf16 it is ~1 GB): the weights are a function of (config section, seed, device type).
Every parameter gets its own generator, seeded from sha256(seed, parameter name), so a weight does not
depend on construction order or on transformers' own initialisation: same seed ⇒ bit-identical weights
(on one device type; CPU and CUDA generators draw different streams). Matrices, embeddings and biases
are N(0, init_std²); RMSNorm weights are ones. `checkpoint:` loads a local folder instead; a path
that is not there is a ModelError, never a hub download.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Iterator

import torch

from kmesh.model.errors import ModelError
from kmesh.model.offline import go_offline

SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
              "tie_word_embeddings", "rms_norm_eps")


def qwen2_config(section: dict[str, Any]) -> Any:
    """transformers.Qwen2Config from the `model.qwen2_random` section."""
    go_offline()
    from transformers import Qwen2Config

    kw = {k: section[k] for k in SHAPE_KEYS if k in section}
    return Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": float(section["rope_theta"])})


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one parameter, from the run seed and the parameter's name."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _skeleton(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The module tree on `device` in `dtype`, its weights left for fill_ (transformers' init skipped)."""
    from transformers import Qwen2ForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:          # older transformers: let it initialise; fill_ overwrites every parameter anyway
        no_init_weights = contextlib.nullcontext
    # Parameters follow the default dtype; the rotary inv_freq buffer is computed in float32 regardless.
    with torch.device(device), _default_dtype(dtype), no_init_weights():
        model = Qwen2ForCausalLM(config)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def fill_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Overwrite every parameter from its own seeded generator (see module docstring)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            g = torch.Generator(device=p.device).manual_seed(param_seed(seed, name))
            p.normal_(0.0, std, generator=g)


def build(section: dict[str, Any], seed: int, device: str | torch.device = "cpu") -> Any:
    """The seeded random Qwen2ForCausalLM of the section's shape, on `device`, eval mode."""
    dtype = getattr(torch, section.get("dtype", "bfloat16"))
    model = _skeleton(qwen2_config(section), torch.device(device), dtype)
    fill_(model, seed, float(section.get("init_std", 0.02)))
    return model


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            h.update(t.contiguous().view(torch.uint8).cpu().numpy())   # buffer protocol: no extra copy
    return h.hexdigest()


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: str | None = None) -> Any:
    """A local Hugging Face Qwen2 folder (config.json + safetensors), offline. ModelError if it is not one."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(f"model.qwen2_random.checkpoint: {str(path)!r} is not a local folder "
                         f"(it must hold config.json + *.safetensors, e.g. a Qwen2.5-0.5B-Instruct download); "
                         f"KMesh never downloads from the hub")
    if not (p / "config.json").is_file():
        raise ModelError(f"model.qwen2_random.checkpoint: {p} has no config.json")
    go_offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(p, local_files_only=True)
    if config.model_type != "qwen2":
        raise ModelError(f"model.qwen2_random.checkpoint: {p} holds a {config.model_type!r} model, not qwen2")
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True,
                                                 dtype=getattr(torch, dtype) if dtype else "auto")
    return model.to(device).eval()


def load(section: dict[str, Any], seed: int, device: str | torch.device = "cpu",
         root: Path | None = None) -> tuple[Any, str]:
    """(model, what it is): the section's checkpoint if set, else the seeded random model."""
    ckpt = section.get("checkpoint")
    if ckpt:
        p = Path(ckpt).expanduser()
        p = p if p.is_absolute() or root is None else root / p
        return load_checkpoint(p, device, section.get("dtype")), f"checkpoint:{p}"
    return build(section, seed, device), f"random:seed={seed}"
