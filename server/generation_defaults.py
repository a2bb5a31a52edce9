"""Sampling defaults from the model's ``generation_config.json``, for the parameters a request leaves out.

vLLM applies them by default too (``--generation-config auto``): a model whose authors recommend ``temperature``
0.6 and ``top_p`` 0.9 gets those unless the client says otherwise. ``do_sample: false`` means greedy, as in
transformers' ``generate``. ``--generation-config vllm`` turns this off; a path reads another file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from radixserve.runtime.json_file import read_json_object

logger = logging.getLogger("radixserve.server")

# generation_config.json key -> the request parameter it is the default of.
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"


def sampling_defaults(setting: str, model_folder: Path | None) -> dict[str, Any]:
    """The defaults ``setting`` (auto, vllm or a path) gives; empty when there is no file or nothing in it."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_folder is None:
            return {}
        path = Path(model_folder) / FILE
    else:
        path = Path(setting).expanduser()
        path = path / FILE if path.is_dir() else path
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no {FILE} at {path}")
        return {}
    raw = read_json_object(path)
    defaults: dict[str, Any] = {}
    for key in KEYS:
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[key] = int(value) if key == "top_k" else float(value)
    if raw.get("do_sample") is False:
        defaults["temperature"] = 0.0  # greedy, whatever temperature the file also gives
    if defaults:
        logger.info("sampling defaults from %s for requests that leave them out: %s", path, defaults)
    return defaults
