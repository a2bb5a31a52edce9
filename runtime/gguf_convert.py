"""One-time conversion of a ``.gguf`` checkpoint into a plain float32 HF safetensors folder.

Quantized GGUF blocks are dequantized by transformers' GGUF loader; the result is saved with
``save_pretrained(safe_serialization=True)`` together with a fast tokenizer rebuilt from the GGUF's
tokenizer metadata. The engine casts to its runtime dtype at load time, so the folder stays float32.

``runtime.model_source`` decides *where* the folder goes and makes the write atomic; this module only
knows *how* to fill a folder and to check that the result is usable (weights dense, tokenizer fast,
chat template present and rendering, eos token set).
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

LOGGER = logging.getLogger("radixserve.model")

_PROBE_MESSAGES = [{"role": "user", "content": "Hello from radixserve"}]


def read_gguf_chat_template(gguf_file: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF's metadata, or None when it has none."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    field = reader.fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    # A string field keeps its bytes in the part that data[0] points to (the layout of every gguf release).
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _load_kwargs(gguf_name: str) -> dict[str, Any]:
    """``from_pretrained`` keywords that force a dense float32 model across transformers versions."""
    import torch
    import transformers
    from packaging.version import Version

    # transformers renamed torch_dtype to dtype in 4.56 and warns on the old name since.
    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {dtype_key: torch.float32}
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF weights on load
        return kwargs
    # Newer transformers may keep GGUF blocks packed (when matmul kernels are installed); we want dense ones.
    if "dequantize" in inspect.signature(GgufConfig.__init__).parameters:
        kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_name, dequantize=True)
    return kwargs


def _detach_quantizer(model: Any) -> None:
    """Make a dequantized GGUF model look like an ordinary one so ``save_pretrained`` accepts it.

    Only safe because every parameter was checked to be a dense float32 tensor first.
    """
    import torch

    for name, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise RuntimeError(
                f"GGUF conversion left parameter {name} as {param.dtype}, not float32; this transformers "
                "version kept GGUF weights packed. Upgrade or downgrade transformers, or convert the model "
                "with llama.cpp's tools and pass the HF folder instead."
            )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _write_chat_template_key(folder: Path, template: str) -> None:
    """Also keep the template in tokenizer_config.json: transformers >= 4.5x writes it only to
    chat_template.jinja, while older releases and other tools read the config key."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def verify_tokenizer(folder: Path, *, chat_marker: str | None = None, eos_token: str | None = None) -> None:
    """Reload the tokenizer in ``folder`` and check it is fast, has an eos token, and renders its template.

    ``chat_marker`` (e.g. ``"<|im_start|>"``) must then appear in the rendered prompt and ``eos_token`` must
    be the eos; both are for known models whose template is not optional. RuntimeError on failure.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if not tok.is_fast:
        raise RuntimeError(f"converted tokenizer in {folder} is not a fast tokenizer")
    if tok.eos_token is None:
        raise RuntimeError(
            f"converted tokenizer in {folder} has no eos token; the GGUF lacks tokenizer.ggml.eos_token_id"
        )
    if eos_token is not None and tok.eos_token != eos_token:
        raise RuntimeError(f"converted tokenizer has eos {tok.eos_token!r}, expected {eos_token!r}")
    if not tok.chat_template:
        if chat_marker is not None:
            raise RuntimeError(f"converted tokenizer in {folder} lost its chat template")
        LOGGER.warning("model in %s has no chat template; chat requests will be refused", folder)
        return
    rendered = tok.apply_chat_template(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    if not isinstance(rendered, str) or _PROBE_MESSAGES[0]["content"] not in rendered:
        raise RuntimeError(f"chat template of {folder} does not render the user message: {rendered!r}")
    if chat_marker is not None and chat_marker not in rendered:
        raise RuntimeError(f"chat template of {folder} renders without {chat_marker!r}: {rendered!r}")


def convert_gguf(
    gguf_file: Path, dest: Path, *, chat_marker: str | None = None, eos_token: str | None = None
) -> Path:
    """Dequantize ``gguf_file`` into the (existing, empty) folder ``dest``; return ``dest``.

    Writes config.json (without any quantization_config), float32 ``*.safetensors``, generation_config.json,
    tokenizer.json, tokenizer_config.json (with ``chat_template`` when the GGUF has one; recovered from the
    GGUF metadata if transformers drops it) and chat_template.jinja on recent transformers. Not atomic:
    callers that publish ``dest`` must build it in a temporary folder and rename.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, dest = Path(gguf_file).resolve(), Path(dest)
    folder, name = str(gguf_file.parent), gguf_file.name

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **_load_kwargs(name))
    _detach_quantizer(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # surface *which* step failed; transformers' message alone is cryptic here
        raise RuntimeError(
            f"could not build a tokenizer from {gguf_file} (does it carry tokenizer metadata?)"
        ) from exc

    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if not template:
        template = read_gguf_chat_template(gguf_file)
        if template:
            LOGGER.info("recovered the chat template from %s's metadata", gguf_file.name)
            tokenizer.chat_template = template
    if model.config.eos_token_id is None and tokenizer.eos_token_id is not None:
        model.config.eos_token_id = tokenizer.eos_token_id
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        tokenizer.model_max_length = max_pos

    with torch.no_grad():
        model.save_pretrained(str(dest), safe_serialization=True)
    del model
    tokenizer.save_pretrained(str(dest))
    if template:
        _write_chat_template_key(dest, template)
    verify_tokenizer(dest, chat_marker=chat_marker, eos_token=eos_token)
    return dest
