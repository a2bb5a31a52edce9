"""The engine process's tokenizer (Rust ``tokenizers`` without transformers) answers as transformers' does, and the
engine process never imports transformers (it is ~2 s of every start)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.constrained.tokenizer import TokenizerInfo
from radixserve.runtime.lean_tokenizer import LeanTokenizer
from radixserve.runtime.model_source import resolve_model
from radixserve.runtime.weights import load_tokenizer

TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂", ""]


@pytest.fixture(params=["tiny", "builtin"])
def folder(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Path:
    return tiny_model_dir if request.param == "tiny" else resolve_model("smollm2-135m-instruct")


def test_the_lean_tokenizer_answers_as_transformers_does(folder: Path) -> None:
    hf, lean = load_tokenizer(folder), load_tokenizer(folder, lean=True)
    assert isinstance(lean, LeanTokenizer) and not isinstance(hf, LeanTokenizer)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(lean, attr) == getattr(hf, attr), attr
    assert len(lean) == len(hf)
    rng = random.Random(0)
    specials = hf.all_special_ids
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 12))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        for skip in (True, False):
            assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids
    assert lean.decode(specials[0]) == hf.decode(specials[0])
    for text in TEXTS:
        for add in (True, False):
            assert lean.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
    assert lean.convert_ids_to_tokens([0, 5, 9]) == hf.convert_ids_to_tokens([0, 5, 9])
    ours, theirs = TokenizerInfo.from_hf(lean), TokenizerInfo.from_hf(hf)
    assert (ours.token_bytes, ours.special_ids, ours.eos_token_ids) == (
        theirs.token_bytes, theirs.special_ids, theirs.eos_token_ids
    )


def test_the_engine_process_does_not_import_transformers(tiny_model_dir: Path) -> None:
    script = (
        "import sys\n"
        "from radixserve.runtime.engine import Engine\n"
        f"e = Engine(model={str(tiny_model_dir)!r}, device='cpu', max_total_tokens=512, lean_tokenizer=True)\n"
        "out = e.generate('hello', {'max_new_tokens': 4, 'temperature': 0})\n"
        "e.shutdown()\n"
        "assert isinstance(out['text'], str)\n"
        "print('transformers' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_a_special_tokens_map_that_says_otherwise_keeps_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, folder)
    assert isinstance(load_tokenizer(folder, lean=True), LeanTokenizer)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    tokenizer = load_tokenizer(folder, lean=True)
    assert not isinstance(tokenizer, LeanTokenizer)
    assert tokenizer.eos_token_id == load_tokenizer(folder).eos_token_id
