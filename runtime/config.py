"""Configuration as frozen dataclasses. Each field is also a CLI flag (``--field-name``) and an environment
variable (``RADIXSERVE_FIELD_NAME``); the field's ``metadata["help"]`` is the flag's help text.

Validation lives in ``__post_init__`` and raises ``ValueError`` with a message that says what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixserve.runtime import envs
from radixserve.runtime.lora_spec import parse_lora_modules

DEFAULT_MODEL = "smollm2-135m-instruct"

T = TypeVar("T")


def _opt(
    default: Any, help: str, choices: tuple[Any, ...] | None = None, aliases: tuple[str, ...] = ()
) -> Any:
    """A config field; ``aliases`` are other spellings of its flag (vLLM's and SGLang's names for the same thing)."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


# Other servers' switches that set a field to a value: flag -> (field, value).
SWITCH_FLAGS = {"--is-embedding": ("runner", "pooling")}  # SGLang's

# Flags that are gone, mapped to the field that replaced them: still accepted, with a warning.
DEPRECATED_FLAGS = {
    "--mem-fraction": (
        "mem_fraction_static",
        "--mem-fraction is deprecated: it was a share of the memory left free after loading, and "
        "--mem-fraction-static (a share of total memory for weights plus KV pool, as in SGLang) replaces it; "
        "its value is now read as --mem-fraction-static",
    ),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the in-process engine needs: model, memory, scheduling."""

    model: str = _opt(
        DEFAULT_MODEL,
        "A local HF folder, a .gguf file, a Hugging Face model id (ORG/NAME: the HF cache, then the hub), or the "
        "built-in name smollm2-135m-instruct.",
        aliases=("--model-path",),
    )
    runner: str = _opt(
        "auto",
        "What the model serves: generate (text), or pooling (embeddings on /v1/embeddings: the prompt's hidden "
        "states pooled as the model's sentence-transformers files say, else its last token's, normalized; a "
        "classifier's scores on /v1/score, /v1/rerank and /v1/classify). auto: pooling for a folder with "
        "sentence-transformers' modules.json, a *ForSequenceClassification architecture or classifier_from_token "
        "in the config, else generate. SGLang's --is-embedding is --runner pooling.",
        ("auto", "generate", "pooling"),
    )
    hf_overrides: str = _opt(
        "",
        "A JSON object merged into the model's config.json at load (vLLM's), e.g. '{\"is_matryoshka\": true}' to "
        "serve an embedding model's shorter dimensions.",
    )
    revision: str = _opt("", "Revision (branch, tag or commit) of a Hugging Face model id; default: main.")
    tokenizer: str = _opt("", "Tokenizer folder or Hugging Face id, when it is not the model's.")
    dtype: str = _opt("auto", "Weights and activations dtype.", ("auto", "float32", "bfloat16", "float16"))
    quantization: str = _opt(
        "auto",
        "Weight format on CPU. auto: a GGUF's blocks are served as they are (Q8_0, Q4_0, Q4_1; Q5_0, Q5_1, Q4_K, "
        "Q5_K and Q6_K where the CPU runs the packed kernel; other types as Q8_0), other checkpoints in --dtype; none: "
        "everything dequantized to --dtype (exact); "
        "int8 / int4: quantize a checkpoint's linear weights at load (Q8_0 / Q4_1 blocks of 32).",
        ("auto", "none", "int8", "int4"),
    )
    keep_plain_weights: bool = _opt(
        False,
        "CPU: keep each plain float weight beside oneDNN's packed copy (twice the linear weights' memory) so that "
        "one-to-three-row bfloat16 steps take the AVX-512 BF16 kernel (one-user decode a fifth faster, measured).",
    )
    deterministic_inference: bool = _opt(
        False,
        "CPU: every token's attention is the same computation whatever chunk, batch or cached prefix it comes with "
        "(prefill queries attend on the decode kernel), so greedy output does not depend on what the radix cache "
        "held or what ran beside it. Slower prefill of long prompts. Not for attention soft-capping (Gemma 2).",
        aliases=("--enable-deterministic-inference",),
    )
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available).")
    attention_backend: str = _opt(
        "auto",
        "Attention kernels: triton (paged Triton kernels, CUDA), torch (the PyTorch reference, with the compiled "
        "CPU kernels on CPU); auto: triton on CUDA where it imports, torch elsewhere.",
        ("auto", "torch", "triton"),
    )
    disable_cuda_graph: bool = _opt(
        False, "CUDA: run decode steps eagerly instead of replaying the CUDA graph captured for their batch size."
    )
    disable_overlap_schedule: bool = _opt(
        False,
        "CUDA: run greedy decode steps one at a time. By default the next step is launched, its input tokens taken "
        "on the GPU, before the current one's results are read and applied (detokenizing, stop checks, outputs), so "
        "the GPU works meanwhile (SGLang's overlap scheduler); a request that stops costs one wasted row.",
    )
    cuda_graph_max_bs: int = _opt(
        0, "CUDA: the largest decode batch captured in a graph (larger ones run eagerly); 0: --max-running-requests."
    )
    load_format: str = _opt(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights (normal, std 0.02) of the config's shapes, created on "
        "the device with no checkpoint read, for measuring speed.",
        ("auto", "dummy"),
    )
    max_total_tokens: int = _opt(0, "KV pool size in tokens; 0 sizes it with --mem-fraction-static.")
    mem_fraction_static: float = _opt(
        0.0,
        "Share of total memory (the GPU's, or RAM on CPU) for the weights plus the KV pool; the pool gets what the "
        "weights and a reserve leave (docs/operations.md). 0: 0.88 on GPU, 0.5 on CPU.",
        aliases=("--gpu-memory-utilization",),
    )
    chunked_prefill_size: int = _opt(2048, "Most prompt tokens computed in one step (the prefill budget).")
    max_running_requests: int = _opt(64, "Most requests in one batch.")
    max_queued_requests: int = _opt(1024, "Most requests waiting for admission; beyond it new ones are refused.")
    schedule_policy: str = _opt(
        "lpm",
        "Order of admission: longest cached prefix first, arrival, or the requests' priority (lower first; running "
        "requests of a worse priority make room for a better one).",
        ("lpm", "fcfs", "priority"),
    )
    disable_radix_cache: bool = _opt(False, "Turn off prefix caching (for A/B comparisons).")
    max_context_len: int = _opt(
        0,
        "Longest prompt + output; 0 takes the model's max_position_embeddings.",
        aliases=("--context-length", "--max-model-len"),
    )
    seed: int = _opt(0, "Seed of the engine's own random state (requests without a seed draw from it).")
    disable_jump_forward: bool = _opt(False, "Sample grammar-forced tokens one by one instead of appending them.")
    speculative_algorithm: str = _opt(
        "",
        "Speculative decoding: ngram drafts tokens by prompt lookup (what followed the latest earlier occurrence "
        "of the sequence's last tokens), draft by a smaller model with the same tokenizer "
        "(--speculative-draft-model); the target verifies the drafts in the batch. Empty: off.",
        ("", "ngram", "draft"),
    )
    speculative_draft_model: str = _opt(
        "",
        "draft: the draft model (a folder, .gguf file or model id, as --model), served beside the target in its dtype "
        "with a KV pool of its own.",
    )
    speculative_draft_quantization: str = _opt(
        "auto",
        "draft: the draft model's weight format, as --quantization (auto: a GGUF's blocks as they are), so that a "
        "quantized copy of the target can draft for it.",
        ("auto", "none", "int8", "int4"),
    )
    speculative_num_draft_tokens: int = _opt(
        3, "Most draft tokens a request proposes per step (3: a verification is 4 rows, one pass of the block kernels)."
    )
    speculative_ngram_min: int = _opt(2, "ngram: the shortest suffix of the sequence that is looked up (tokens).")
    speculative_ngram_max: int = _opt(4, "ngram: the longest suffix looked up; longer matches are tried first.")
    speculative_max_batch: int = _opt(
        8, "Greedy requests stop speculating while more than this many requests decode at once."
    )
    enable_hierarchical_cache: bool = _opt(
        False,
        "KV tier: keep KV that leaves the pool in files under --hicache-dir, load it back when a prompt reaches it, "
        "and save the radix cache there periodically and at shutdown, so a restarted server starts warm.",
    )
    hicache_dir: str = _opt(
        "", "KV tier folder (a subfolder per model, dtype and KV layout); default: kv-tier in the cache dir."
    )
    hicache_size: float = _opt(16.0, "KV tier: GiB of files at most; the least recently used chunks go first.")
    hicache_chunk_tokens: int = _opt(
        64, "KV tier: tokens per stored chunk; a prefix is kept up to its last whole chunk."
    )
    hicache_persist_interval: float = _opt(
        30.0, "KV tier: seconds between saves of the radix cache to the tier (0: only at shutdown)."
    )
    grammar_compile_timeout: float = _opt(10.0, "Seconds a grammar may take to compile before the request fails.")
    grammar_workers: int = _opt(2, "Threads compiling grammars off the engine loop (plus one for expensive ones).")
    grammar_nice: int = _opt(
        19, "Niceness added to a grammar compile still running after 10 ms (Linux): it uses the CPU decoding leaves."
    )
    lora_modules: tuple[str, ...] = _opt(
        (),
        "LoRA adapters to serve, as NAME=PATH (a PEFT adapter folder); a request picks one by its model name.",
    )
    tp: int = _opt(
        1,
        "Tensor-parallel ranks: attention heads, MLP and vocabulary split over N processes/GPUs.",
        aliases=("--tensor-parallel-size", "--tp-size"),
    )
    nnodes: int = _opt(1, "Nodes the tensor-parallel ranks span (each runs --tp / --nnodes ranks).")
    node_rank: int = _opt(0, "This node's index; node 0 serves, the others only run their ranks.")
    dist_init_addr: str = _opt("", "host:port of node 0's process-group rendezvous (required with --nnodes > 1).")

    def __post_init__(self) -> None:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"--runner must be auto, generate or pooling, got {self.runner!r}")
        self.overrides()  # (raises for text that is not a JSON object)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"--quantization must be auto, none, int8 or int4, got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.cuda_graph_max_bs < 0:
            n = self.cuda_graph_max_bs
            raise ValueError(f"--cuda-graph-max-bs must be >= 0 (0: --max-running-requests), got {n}")
        if self.max_total_tokens < 0:
            raise ValueError("--max-total-tokens must be >= 0 (0 sizes the pool from free memory)")
        if not 0.0 <= self.mem_fraction_static <= 0.98:
            raise ValueError(
                f"--mem-fraction-static must be in (0, 0.98] (0 picks the default), got {self.mem_fraction_static}"
            )
        if self.chunked_prefill_size < 16:
            raise ValueError(f"--chunked-prefill-size must be >= 16, got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.schedule_policy not in ("lpm", "fcfs", "priority"):
            raise ValueError(f"--schedule-policy must be lpm, fcfs or priority, got {self.schedule_policy!r}")
        if self.max_context_len < 0:
            raise ValueError("--max-context-len must be >= 0")
        if self.speculative_algorithm not in ("", "ngram", "draft"):
            raise ValueError(
                f"--speculative-algorithm must be ngram or draft (or empty), got {self.speculative_algorithm!r}"
            )
        if self.speculative_draft_quantization not in ("auto", "none", "int8", "int4"):
            q = self.speculative_draft_quantization
            raise ValueError(f"--speculative-draft-quantization must be auto, none, int8 or int4, got {q!r}")
        if (self.speculative_algorithm == "draft") != bool(self.speculative_draft_model):
            raise ValueError(
                "--speculative-algorithm draft needs --speculative-draft-model PATH"
                if self.speculative_draft_model == ""
                else "--speculative-draft-model is used only with --speculative-algorithm draft; add that flag"
            )
        if not 1 <= self.speculative_num_draft_tokens <= 32:
            k = self.speculative_num_draft_tokens
            raise ValueError(f"--speculative-num-draft-tokens must be in [1, 32], got {k}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ValueError("need 1 <= --speculative-ngram-min <= --speculative-ngram-max")
        if self.speculative_max_batch < 1:
            raise ValueError(f"--speculative-max-batch must be >= 1, got {self.speculative_max_batch}")
        if self.enable_hierarchical_cache:
            if self.disable_radix_cache:
                raise ValueError("--enable-hierarchical-cache extends the radix cache: drop --disable-radix-cache")
            if self.tp > 1:
                raise ValueError("--enable-hierarchical-cache is not supported with --tp > 1 yet; serve with --tp 1")
        if self.hicache_size <= 0:
            raise ValueError(f"--hicache-size must be > 0 GiB, got {self.hicache_size}")
        if not 16 <= self.hicache_chunk_tokens <= 4096:
            raise ValueError(f"--hicache-chunk-tokens must be in [16, 4096], got {self.hicache_chunk_tokens}")
        if self.hicache_persist_interval < 0:
            raise ValueError("--hicache-persist-interval must be >= 0 seconds (0: only at shutdown)")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be > 0 seconds")
        if self.grammar_workers < 1:
            raise ValueError("--grammar-workers must be >= 1")
        if not 0 <= self.grammar_nice <= 19:
            raise ValueError("--grammar-nice must be between 0 (off) and 19")
        parse_lora_modules(self.lora_modules)
        if self.lora_modules and self.tp > 1:
            raise ValueError("--lora-modules is not supported with --tp > 1 yet; serve the adapters with --tp 1")
        if self.tp < 1 or self.nnodes < 1:
            raise ValueError("--tp and --nnodes must be >= 1")
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} must be a multiple of --nnodes {self.nnodes} (equal ranks per node)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (an address of node 0 every node reaches)")
        if self.dist_init_addr and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")

    def overrides(self) -> dict[str, Any]:
        """``--hf-overrides`` as a dict (empty without)."""
        if not self.hf_overrides:
            return {}
        try:
            value = json.loads(self.hf_overrides)
        except ValueError as exc:
            raise ValueError(f"--hf-overrides must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--hf-overrides must be a JSON object, got {self.hf_overrides!r}")
        return value


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates every annotation of the class: once per class, not per field


def _field_type(cls: type, f: dataclasses.Field) -> type:
    tp = _type_hints(cls)[f.name]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    return tp


class _Deprecated(argparse.Action):
    """A flag that still works for the field that replaced it, with a warning."""

    def __init__(self, *args: Any, warning: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warning = warning

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        logging.getLogger("radixserve.config").warning("%s", self.warning)
        setattr(namespace, self.dest, values)


class _Extend(argparse.Action):
    """A ``tuple[str, ...]`` flag: its first use replaces the default, a repeated one adds to it (``--lora-modules
    a=/x --lora-modules b=/y`` serves both)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        seen = getattr(namespace, "_extended__", set())
        current = list(getattr(namespace, self.dest)) if self.dest in seen else []
        seen.add(self.dest)
        namespace._extended__ = seen
        setattr(namespace, self.dest, [*current, *values])


ENV_ERROR = "env_error__"  # namespace attributes holding a bad switch variable's error (check_env_errors)


def _typed(tp: Callable[[str], Any], env_name: str, env_value: str | None) -> Callable[[str], Any]:
    """``tp`` as an argparse type whose error names the variable when the text came from it."""

    def convert(text: str) -> Any:
        try:
            return tp(text)
        except ValueError:
            source = f" (from {env_name})" if text == env_value else ""
            raise argparse.ArgumentTypeError(f"expected {getattr(tp, '__name__', tp)}, got {text!r}{source}") from None

    convert.__name__ = getattr(tp, "__name__", "value")
    return convert


def check_env_errors(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``parser.error`` for a ``RADIXSERVE_*`` switch of the parsed command that is not a boolean."""
    for name, message in vars(ns).items():
        if name.startswith(ENV_ERROR) and message:
            parser.error(message)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` (plus its aliases) per field of the dataclass ``cls``; defaults honour ``RADIXSERVE_*``
    variables. A ``tuple[str, ...]`` field takes one or more values (``--flag a b``, or the flag repeated; the variable:
    ``a,b``)."""
    for f in dataclasses.fields(cls):
        tp = _field_type(cls, f)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        env_value = envs.get(f.name.upper())
        help_text = f.metadata.get("help", "")
        if tp is bool:
            try:
                default = envs.get_bool(f.name.upper(), f.default)
            except ValueError as exc:  # reported when this command is parsed (check_env_errors), not by every one
                default = f.default
                parser.set_defaults(**{ENV_ERROR + f.name: str(exc)})
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        if typing.get_origin(tp) is tuple:
            default = tuple(v for v in env_value.split(",") if v) if env_value is not None else f.default
            parser.add_argument(*flags, nargs="+", type=str, default=default, action=_Extend, help=f"{help_text}")
            continue
        # A variable's text is the default as it is, so that argparse converts it only for the command being
        # parsed, and a bad one is a one-line error naming the variable (_typed) rather than a traceback.
        default = env_value if env_value is not None else f.default
        parser.add_argument(
            *flags,
            type=_typed(tp, envs.PREFIX + f.name.upper(), env_value),
            default=default,
            choices=f.metadata.get("choices"),
            # A secret's default may come from the environment: never print it in --help.
            help=help_text if f.metadata.get("secret") else f"{help_text} (default: %(default)s)",
        )
    names = {f.name: _field_type(cls, f) for f in dataclasses.fields(cls)}
    for flag, (dest, value) in SWITCH_FLAGS.items():
        if dest in names:
            parser.add_argument(flag, dest=dest, action="store_const", const=value, help=f"--{dest} {value}")
    for flag, (dest, warning) in DEPRECATED_FLAGS.items():
        if dest in names:
            parser.add_argument(flag, dest=dest, type=names[dest], action=_Deprecated, warning=warning,
                                help=argparse.SUPPRESS)  # fmt: skip


def from_args(cls: type[T], ns: argparse.Namespace) -> T:
    """Build ``cls`` from the parsed flags that ``add_arguments`` declared."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: v for k, v in vars(ns).items() if k in fields}
    for name, value in values.items():
        if typing.get_origin(_field_type(cls, fields[name])) is tuple and isinstance(value, list):
            values[name] = tuple(value)
    return cls(**values)
