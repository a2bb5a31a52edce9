"""The tokenizer the engine process uses: Rust ``tokenizers`` directly, without importing transformers.

The engine process only decodes (incremental detokenization and stop strings), reads the special ids and hands
the Rust tokenizer to the grammar backend; the front end, which renders chat templates and tokenizes, keeps
transformers' tokenizer. Importing transformers costs ~2 s, most of a cached start. ``LeanTokenizer`` is used
only where transformers would build its generic fast tokenizer from the same ``tokenizer.json`` (see
``weights.load_tokenizer``) and where its decoding is the Rust decoder's output unchanged: no
``clean_up_tokenization_spaces``, or a BPE model, for which transformers >= 5 skips that clean-up. Invariant,
tested on the tiny and the built-in tokenizers (tests/test_lean_tokenizer.py): every method here returns what
transformers' tokenizer returns for the same folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixserve.runtime.json_file import read_json_object

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _content(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class LeanTokenizer:
    """The subset of transformers' fast tokenizer that the engine process calls."""

    is_fast = True

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        """``config``: the folder's tokenizer_config.json, as ``load`` read it."""
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.backend_tokenizer = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self._config = config
        ids: dict[str, int | None] = {}
        for attr in _SPECIAL_ATTRS:
            text = _content(config.get(attr))
            ids[attr] = self.backend_tokenizer.token_to_id(text) if text is not None else None
        self.bos_token_id, self.eos_token_id = ids["bos_token"], ids["eos_token"]
        self.pad_token_id, self.unk_token_id = ids["pad_token"], ids["unk_token"]
        named = config.get("extra_special_tokens") or []  # transformers >= 5 may write it as {name: token}
        named = list(named.values()) if isinstance(named, dict) else list(named)
        extra = [*(config.get("additional_special_tokens") or []), *named]
        special = [ids[a] for a in _SPECIAL_ATTRS] + [self.backend_tokenizer.token_to_id(_content(t) or "")
                                                       for t in extra]  # fmt: skip
        self.all_special_ids = list(dict.fromkeys(i for i in special if i is not None))

    @classmethod
    def load(cls, folder: Path) -> LeanTokenizer | None:
        """The folder's lean tokenizer, or None where it would not answer exactly as transformers' does."""
        config = cls._settings_agree(folder)
        if config is None:
            return None
        tokenizer = cls(folder, config)
        bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
        return tokenizer if bpe or not tokenizer._config.get("clean_up_tokenization_spaces", False) else None

    @staticmethod
    def _settings_agree(folder: Path) -> dict[str, Any] | None:
        """The folder's tokenizer_config.json where its special tokens are all there is to read, else None."""
        try:
            config = read_json_object(Path(folder) / "tokenizer_config.json")
        except ValueError:
            return None
        if not (Path(folder) / "tokenizer.json").is_file():
            return None
        # transformers also reads special_tokens_map.json; only where it says what tokenizer_config.json says
        # (or is absent) are the special ids read here the same as transformers'.
        path = Path(folder) / "special_tokens_map.json"
        if path.is_file():
            try:
                extra = read_json_object(path)
            except ValueError:
                return None
            for attr in _SPECIAL_ATTRS:
                if attr in extra and _content(extra[attr]) != _content(config.get(attr)):
                    return None
            if extra.get("additional_special_tokens") and "additional_special_tokens" not in config:
                return None
        return config

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def to_transformers(self) -> Any:
        """transformers' tokenizer of the same folder, for the rare paths that need it (imports transformers)."""
        from radixserve.runtime.weights import load_tokenizer

        return load_tokenizer(self.folder)
