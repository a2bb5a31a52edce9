"""One-time preparation of a ``.gguf`` checkpoint as an HF-style model folder whose weights stay in the GGUF.

transformers reads the GGUF's metadata into config.json and a fast tokenizer (rebuilt from the tokenizer
metadata); the GGUF itself becomes the folder's ``model.gguf``, read at load with its blocks kept
(``runtime.gguf_weights``), so nothing is dequantized on disk.

``runtime.model_source`` decides *where* the folder goes and makes the write atomic; this module only knows *how*
to fill a folder and to check that the result is usable (tokenizer fast, chat template present and rendering,
eos token set).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

LOGGER = logging.getLogger("radixserve.model")

_PROBE_MESSAGES = [{"role": "user", "content": "Hello from radixserve"}]


def read_gguf_chat_template(gguf_file: Path) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF's metadata, or None when it has none."""
    from radixserve.runtime.gguf_file import GGUFFile

    with GGUFFile(gguf_file) as f:
        template = f.metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


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


WEIGHTS_FILE = "model.gguf"


def convert_gguf(
    gguf_file: Path, dest: Path, *, chat_marker: str | None = None, eos_token: str | None = None, move: bool = False
) -> Path:
    """Make ``dest`` (an existing, empty folder) a model folder whose weights are the GGUF itself; return ``dest``.

    Writes config.json and generation_config.json (from the GGUF's metadata, read by transformers), tokenizer.json
    and tokenizer_config.json (with ``chat_template`` when the GGUF has one; recovered from the metadata if
    transformers drops it) and chat_template.jinja on recent transformers, and puts the GGUF in as ``model.gguf``:
    a symbolic link to ``gguf_file`` (the user's own file stays where it is), or with ``move`` the file itself. The
    weights are read from it at load, blocks kept (``runtime.gguf_weights``): no float32 copy on disk. Not atomic:
    callers that publish ``dest`` must build it in a temporary folder and rename.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf_file, dest = Path(gguf_file).resolve(), Path(dest)
    # transformers reads the GGUF from a folder of its own: next to a tokenizer_config.json (a GGUF kept beside
    # the HF checkpoint it was made from) it mixes that file's settings into the GGUF's tokenizer and loses EOS.
    with tempfile.TemporaryDirectory(prefix="radixserve-gguf-") as scratch:
        (Path(scratch) / gguf_file.name).symlink_to(gguf_file)
        config = AutoConfig.from_pretrained(scratch, gguf_file=gguf_file.name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=gguf_file.name)
        except Exception as exc:  # surface *which* step failed; transformers' message alone is cryptic here
            raise RuntimeError(
                f"could not build a tokenizer from {gguf_file} (does it carry tokenizer metadata?)"
            ) from exc
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if not template:
        template = read_gguf_chat_template(gguf_file)
        if template:
            LOGGER.info("recovered the chat template from %s's metadata", gguf_file.name)
            tokenizer.chat_template = template
    if getattr(config, "eos_token_id", None) is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0:
        tokenizer.model_max_length = max_pos
    config.architectures = config.architectures or [_ARCHITECTURES.get(config.model_type, "LlamaForCausalLM")]
    config.save_pretrained(str(dest))
    GenerationConfig.from_model_config(config).save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    if template:
        _write_chat_template_key(dest, template)
    verify_tokenizer(dest, chat_marker=chat_marker, eos_token=eos_token)
    target = dest / WEIGHTS_FILE
    if move:
        gguf_file.replace(target)
    else:
        target.symlink_to(gguf_file)
    return dest


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
