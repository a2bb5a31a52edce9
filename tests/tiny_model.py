"""Tiny random-weight model folders for fast tests, built fully offline in well under a second of work.

``make_tiny_model`` writes an HF folder (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML ``chat_template``) that both
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` accept.
The tokenizer is a real byte-level BPE trained on the built-in corpus below, so any text round-trips.

``write_tiny_gguf`` turns such a (llama) folder into an F32 ``.gguf`` with llama.cpp's tensor names,
q/k row layout and tokenizer metadata, to exercise GGUF conversion without a download.

Everything is deterministic in ``seed``: same arguments, same bytes of weights and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A few KB of plain English and code, written for this file. Its only job is to give the BPE trainer
# enough repeated substrings to learn a few hundred merges, so tokens look like real subwords.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving engine keeps many requests in flight at once.
Each request has a prompt, a list of token ids, and a budget of new tokens to generate.
When two prompts share a prefix, the engine can reuse the cached keys and values of that prefix.
A radix tree stores those prefixes so that the longest match is found in time linear in its length.
Memory is split into pages; a page holds the keys and values of a fixed number of tokens.
The scheduler decides which requests run in the next step. It prefers requests whose prefix is cached.
Chunked prefill splits a long prompt into pieces so that decoding requests are not starved.
Sampling turns logits into a token: temperature scales them, top-k and top-p cut the tail.
A grammar can constrain the output, for example to valid JSON that matches a schema.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 42 100 1024 2048.
The user asked a question and the assistant answered it. The system prompt sets the tone.
Please write a short poem about the sea. The sea is wide, the sea is deep, the waves roll in.

def add(a: int, b: int) -> int:
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def step(self, n: int = 1) -> int:
        if n < 0:
            raise ValueError("n must be >= 0")
        self.count += n
        return self.count


for i in range(10):
    print(f"step {i}: {add(i, i)}")

{"name": "radix", "tokens": [1, 2, 3], "ok": true, "score": 0.5, "tags": ["fast", "small"]}
import json
data = json.loads('{"key": "value", "list": [1, 2, 3]}')
assert data["key"] == "value"

Numbers and symbols: + - * / = < > ( ) [ ] { } # @ $ % ^ & _ | ~ ` ' " : ; , . ? !
The model reads the prompt, computes attention over all previous tokens, and predicts the next one.
Greedy decoding always picks the most likely token; sampling draws from the distribution instead.
A stop string ends generation early. The end of sequence token ends it too.
Weights are stored in safetensors files; the config describes the architecture and its sizes.
"""


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus changes counts uniformly, not the merge order; a single pass is enough.
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


# arch -> (transformers config class, model class) for the families beyond Llama and Qwen2.
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def _write_chat_template(folder: Path, template: str) -> None:
    """Put the template in tokenizer_config.json too: newer transformers keep it only in
    chat_template.jinja, older ones and other tools read the config key."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny_model(
    path: Path,
    *,
    vocab_size_hint: int = 512,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    tie: bool = True,
    qkv_bias: bool | None = None,
    seed: int = 0,
    arch: str = "llama",
    max_position: int = 2048,
    added_tokens: tuple[str, ...] = (),
    chat_template: str = CHATML_TEMPLATE,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random-weight causal LM plus a trained byte-level BPE tokenizer into ``path``; return it.

    ``arch`` is "llama" (LlamaForCausalLM) or "qwen2" (Qwen2ForCausalLM, which always has q/k/v biases).
    ``qkv_bias`` None takes the architecture's default; True on llama sets ``attention_bias`` (which in HF
    Llama biases q, k, v *and* o_proj); False on qwen2 is refused. The vocabulary has at most
    ``vocab_size_hint`` entries (fewer when the corpus runs out of merges) and the model's vocab_size is
    exactly the tokenizer's size. Norm weights and biases are randomized too (HF initializes them to
    ones/zeros), so a loader that drops them produces different logits. ``added_tokens`` become added, not
    special, tokens (as Qwen3's ``<think>`` and ``</think>`` are); ``chat_template`` replaces the ChatML one.
    Other families (``arch`` in ``FAMILIES``: qwen3, mistral, phi3, gemma2, gemma3) take their config class's
    defaults but for the shape, and ``config_overrides`` (a sliding window, say).
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if arch not in ("llama", "qwen2", *FAMILIES):
        raise ValueError(f"arch must be 'llama', 'qwen2' or one of {sorted(FAMILIES)}, got {arch!r}")
    if arch == "qwen2" and qkv_bias is False:
        raise ValueError("Qwen2 always has q/k/v biases; use arch='llama' for a model without them")
    if hidden % heads != 0 or heads % kv_heads != 0:
        raise ValueError(f"need hidden % heads == 0 == heads % kv_heads, got {hidden=} {heads=} {kv_heads=}")
    if vocab_size_hint < 300:
        raise ValueError(f"vocab_size_hint must be >= 300 (256 bytes + specials + merges): {vocab_size_hint}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    backend = _train_tokenizer(vocab_size_hint)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
        pad_token=EOS_TOKEN, model_max_length=2048,
    )
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    _write_chat_template(path, chat_template)
    vocab_size = len(tokenizer)

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "llama":
        config = LlamaConfig(attention_bias=bool(qkv_bias), **common, **(config_overrides or {}))
        model_cls = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(**common, **(config_overrides or {}))
        model_cls = Qwen2ForCausalLM
    else:
        import transformers

        config_name, model_name = FAMILIES[arch]
        extra = {"head_dim": hidden // heads, **(config_overrides or {})}
        config = getattr(transformers, config_name)(**common, **extra)
        model_cls = getattr(transformers, model_name)

    # fork_rng keeps the caller's global RNG untouched, so building a model never perturbs a test.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).float().eval()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
                elif name.endswith(".bias"):
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _llama_cpp_qk_layout(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k rows from HF's rotate-half layout to llama.cpp's interleaved-pair layout.

    Within each head, HF keeps the first and second halves of the rotary dims apart; GGUF stores them as
    adjacent pairs. Readers (transformers included) apply the inverse when loading.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.bias": "attn_q.bias",  # (qwen2)
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


def _gguf_tensor_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<rest>
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in _GGUF_NAMES:
        raise ValueError(f"no GGUF name for tensor {hf_name!r} (only llama and qwen2 are supported)")
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:])]}"


def write_tiny_gguf(folder: Path, gguf_path: Path, *, name: str = "tiny-llama", qtype: str = "F32") -> Path:
    """Write the llama or qwen2 model in HF ``folder`` (from ``make_tiny_model``) as a GGUF at ``gguf_path``, as
    llama.cpp's converter writes it.

    Carries the architecture hyper-parameters, every tensor (llama's q/k rows reordered to llama.cpp's rotary
    layout; qwen2 keeps HF's, with its q/k/v biases) and
    the tokenizer (byte-level "gpt2" vocab, merges, special ids, chat template). With ``qtype`` (``Q8_0``,
    ``Q4_0``, ``Q4_1``, ...) the 2-D weights are quantized by gguf-py; norms stay F32. Returns ``gguf_path``.
    """
    import gguf

    folder, gguf_path = Path(folder), Path(gguf_path)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    arch = cfg.get("model_type")
    if arch not in ("llama", "qwen2") or (arch == "llama" and cfg.get("attention_bias")):
        raise ValueError("write_tiny_gguf supports bias-free llama and qwen2 (make_tiny_model(arch=...))")
    tok = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))

    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError("tokenizer ids are not contiguous from 0; cannot write a GGUF vocabulary")
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    token_types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    writer.add_name(name)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    # transformers >= 5 keeps rope_theta inside rope_parameters.
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 1e4)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType[f"MOSTLY_{qtype}"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_cfg.get("bos_token") or BOS_TOKEN])
    writer.add_eos_token_id(vocab[tok_cfg.get("eos_token") or EOS_TOKEN])
    writer.add_unk_token_id(vocab[UNK_TOKEN])
    writer.add_pad_token_id(vocab[EOS_TOKEN])
    writer.add_add_bos_token(False)
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])

    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                arr = f.get_tensor(hf_name).astype(np.float32)
                if arch == "llama" and hf_name.endswith("q_proj.weight"):
                    arr = _llama_cpp_qk_layout(arr, n_head)
                elif arch == "llama" and hf_name.endswith("k_proj.weight"):
                    arr = _llama_cpp_qk_layout(arr, n_kv)
                arr = np.ascontiguousarray(arr)
                if qtype != "F32" and arr.ndim == 2:
                    kind = gguf.GGMLQuantizationType[qtype]
                    writer.add_tensor(_gguf_tensor_name(hf_name), gguf.quants.quantize(arr, kind), raw_dtype=kind)
                else:
                    writer.add_tensor(_gguf_tensor_name(hf_name), arr)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def make_tiny_lora(model_dir: Path, path: Path, *, seed: int = 0, **options: object) -> Path:
    """A PEFT LoRA adapter of the model in ``model_dir`` (every attention and MLP projection, rank 8, unless
    ``options`` say otherwise), saved into ``path``. ``init_lora_weights=False`` draws B at random too, so the
    adapter changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = {"r": 8, "lora_alpha": 16, "target_modules": targets, "init_lora_weights": False, **options}
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(**config))
    model.save_pretrained(str(path))
    return path


def make_tiny_embedding(
    path: Path,
    *,
    pooling: str = "lasttoken",
    normalize: bool = True,
    bare: bool = True,
    seed: int = 0,
    config_overrides: dict | None = None,
    **model_options: object,
) -> Path:
    """A random-weight Qwen3 embedding model as sentence-transformers saves one (Qwen3-Embedding's layout): the
    decoder with ``pooling`` (a sentence-transformers mode: lasttoken, mean_tokens, cls_token, ...), then
    normalization when ``normalize``. ``bare``: the checkpoint is the bare decoder (``Qwen3Model``, tensors without
    the ``model.`` prefix and no head), as embedding models are published."""
    import json

    from safetensors.torch import load_file, save_file

    make_tiny_model(path, arch="qwen3", seed=seed, config_overrides=config_overrides, **model_options)  # type: ignore[arg-type]
    if bare:
        weights = load_file(str(path / "model.safetensors"))
        bare_weights = {k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")}
        save_file(bare_weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["Qwen3Model"]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pool_config = {"word_embedding_dimension": json.loads((path / "config.json").read_text())["hidden_size"]}
    pool_config.update({f"pooling_mode_{m}": m == pooling for m in modes})
    pool_config["include_prompt"] = True
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool_config))
    return path


def make_tiny_classifier(
    path: Path, *, num_labels: int = 1, seed: int = 0, arch: str = "qwen3", scale: float = 0.5, **model_options: object
) -> Path:
    """A random-weight ``*ForSequenceClassification`` of family ``arch`` (a cross-encoder reranker's layout, as
    tomaarsen/Qwen3-Reranker-0.6B-seq-cls is saved): the decoder, and a ``score`` head of ``num_labels`` outputs
    (weights of standard deviation ``scale``) instead of the vocabulary's; labels named ``LABEL_i``."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    make_tiny_model(path, arch=arch, seed=seed, **model_options)  # type: ignore[arg-type]
    weights = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if not k.startswith("lm_head.")}
    config = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed + 1)
    weights["score.weight"] = torch.randn(num_labels, config["hidden_size"], generator=gen) * scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
