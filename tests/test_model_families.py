"""Each served model family against HuggingFace transformers, on tiny random-weight configs built here.

Per family (Llama 3.x with its RoPE scaling, Qwen2.5, and the others below): final logits of a whole prefill, of
a chunked prefill into scattered slots and of a decode step within 1e-4 of HF's (the windowed families with a
16-token window, so the 23-token prompt and its chunks cross it); then through the engine, with the radix cache
on, 16-token prefill chunks and 8 requests batched that share a 70-token prefix (a shared-prefix group), greedy
output identical to HF ``generate`` for 32 tokens, which run past the window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
from tests.test_model import assert_logits_match_hf
from tests.tiny_model import make_tiny_model

WINDOW = 16
FAMILIES = {
    # Llama 3.1's RoPE scaling on a 128K-context config (the original context shortened to 64, so the scaled band
    # covers the test's positions).
    "llama-rope-llama3": {
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },  # fmt: skip
    "qwen2": {},  # Qwen2.5 (q/k/v biases)
    "qwen3": {},
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    # Phi-4-mini's shape of RoPE: only the first 3/4 of each head rotates, the rest passes through.
    "phi3-partial-rotary": {"partial_rotary_factor": 0.75, "sliding_window": WINDOW},
    "gemma2": {"sliding_window": WINDOW},
    # Gemma 3 alternates local and global layers by layer_types, each kind with its own RoPE base.
    "gemma3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # Top-2 of 4 experts on layers 0 and 2, a dense MLP on layer 1.
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
    },
    # Mixtral: top-2 of 4 experts on every layer (block_sparse_moe, w1/w2/w3 in the checkpoint), a window.
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
}
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    folder = tmp_path_factory.mktemp(name + "-")  # (mktemp numbers it: NAME-0)
    overrides = dict(FAMILIES[name])
    positions = overrides.pop("max_position_embeddings", 2048)
    return make_tiny_model(
        folder, arch=name.split("-")[0], num_layers=3, config_overrides=overrides, max_position=positions, seed=1
    )


def test_logits_match_hf(family_dir: Path) -> None:
    ours = assert_logits_match_hf(family_dir)
    if "sliding_window" in FAMILIES[family_dir.name.rpartition("-")[0]]:
        assert any(w == WINDOW for w in ours.args.layer_windows)  # the window is honoured, not ignored


def test_engine_greedy_matches_hf_generate(family_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size
    shared = torch.randint(3, vocab, (70,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, vocab, (10,), generator=gen).tolist() for _ in range(8)]
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            expected.append(out[0, len(p) :].tolist())
    engine = Engine(model=str(family_dir), device="cpu", max_total_tokens=4096, chunked_prefill_size=16)
    try:
        engine.generate(input_ids=prompts[0][:70], sampling_params=SamplingParams(max_new_tokens=1))  # cache it
        params = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)
        results = engine.generate(input_ids=prompts, sampling_params=params)
        got = [r["output_ids"] for r in results]
        assert got == expected
        assert all(r["meta_info"]["cached_tokens"] >= 64 for r in results[1:])
    finally:
        engine.shutdown()


def test_a_legacy_rope_scaling_added_to_a_new_config_applies(tmp_path: Path) -> None:
    """A transformers 5 config (``rope_parameters`` with the default type) plus a hand-added ``rope_scaling`` in
    the legacy spelling (``type``), as model cards tell users to add: transformers applies it, so must we (it was
    dropped: the default type won the merge)."""
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    assert assert_logits_match_hf(folder).args.rope_scaling["rope_type"] == "linear"


def test_unsupported_architecture_is_refused_with_the_list(tmp_path: Path) -> None:
    from radixserve.runtime.models import ModelArgs
    from radixserve.runtime.weights import load_hf_config

    folder = make_tiny_model(tmp_path / "m")
    config = folder / "config.json"
    config.write_text(config.read_text().replace("LlamaForCausalLM", "FalconForCausalLM"))
    with pytest.raises(ValueError, match="FalconForCausalLM.*supported: .*Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        ModelArgs.from_hf_config(load_hf_config(folder))
    fields = json.loads(config.read_text().replace("FalconForCausalLM", "LlamaForCausalLM"))
    del fields["num_attention_heads"]  # (an AttributeError's traceback, before)
    config.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="config.json lacks num_attention_heads"):
        ModelArgs.from_hf_config(load_hf_config(folder))
