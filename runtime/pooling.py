"""Embeddings (``--runner pooling``): a prompt's final hidden states pooled into one vector.

What a model's embeddings are is part of the model: sentence-transformers folders say it in ``modules.json`` and
the pooling module's ``config.json`` (Qwen3-Embedding, e5-mistral, gte-Qwen2: the last token's hidden state,
then L2-normalized). ``read_pooling`` reads that; a folder without it gets the decoders' usual choice, the last
token, normalized (as vLLM does).

An embedding request is a prompt with ``max_new_tokens == 0`` and ``SamplingParams.pooling`` set. Its hidden
states are pooled as its chunks are computed (``model_runner.pool_chunk`` gives each chunk's part), so chunked
prefill and batching with other requests are the ordinary code path:

* ``last``: the row of the prompt's last token, from the chunk that reaches it. A cached prefix is never
  recomputed: only the last token has to be (the radix cache always leaves it to compute).
* ``mean`` and ``cls`` (the first token) need the hidden states of every prompt token (of the first): such a
  request takes no cached prefix (``needs_whole_prompt``) and sums from its first chunk, so a retracted one that
  resumes starts over.

A classifier (a cross-encoder reranker) is served the same way: its output is the head's logits at the last
token instead of the hidden state (``Pooling.classify``). The head is a ``*ForSequenceClassification``
checkpoint's ``score`` (``num_labels`` outputs), or, with vLLM's ``classifier_from_token`` in the config
(``--hf-overrides``), a language model's own head read at those tokens (``runtime.classifier_head`` takes either
from the checkpoint). Qwen3-Reranker answers "yes" or "no", and its score is sigmoid(logit yes - logit no)
(``two_way``), which is the softmax of the pair. The activation (``PoolingModel.activation``) is the front end's
to apply.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the front end reads requests' pooling too, and never imports torch
    import torch

POOLING_KINDS = ("last", "mean", "cls")
# sentence-transformers' pooling modes -> ours; the others (max, weighted mean, mean over sqrt(len)) are refused.
_ST_MODES = {"lasttoken": "last", "mean_tokens": "mean", "mean": "mean", "cls_token": "cls", "cls": "cls"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class Pooling:
    """How one request's embedding is made: ``kind`` of pooling, then the first ``dimensions`` values kept
    (Matryoshka; None: all), then L2 normalization when ``normalize``. A classifier's (``classify``): the head's
    logits at the last token, all of them, or those of ``tokens`` where the head is a language model's; with
    ``two_way``, the second of those minus the first (one output)."""

    kind: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    classify: bool = False
    tokens: tuple[int, ...] = ()
    two_way: bool = False

    @property
    def needs_whole_prompt(self) -> bool:
        """Whether every prompt token's hidden state is read (then no cached prefix may stand in for them)."""
        return self.kind != "last"

    def validate(self, hidden_size: int, matryoshka: tuple[int, ...] | None) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got {self.kind!r}")
        if self.classify and (self.kind != "last" or self.normalize or self.dimensions is not None):
            raise ValueError("a classifier reads its head at the last token, unnormalized, every output")
        if self.dimensions is None:
            return
        if matryoshka is None:
            raise ValueError(
                "dimensions needs a Matryoshka model (config.json's is_matryoshka or matryoshka_dimensions); this "
                "model's embeddings cannot be shortened: leave dimensions out"
            )
        allowed = matryoshka or tuple(range(1, hidden_size + 1))
        if self.dimensions not in allowed:
            which = ", ".join(map(str, matryoshka)) if matryoshka else f"1 to {hidden_size}"
            raise ValueError(f"dimensions must be one of {which} for this model, got {self.dimensions}")

    def finish(self, pooled: torch.Tensor, count: int) -> list[float]:
        """The embedding from what the chunks gave over ``count`` tokens (float32); a classifier's logits as the
        runner computed them."""
        import torch.nn.functional as F  # (engine side only)

        if self.classify:
            return pooled.tolist()
        vec = pooled / count if self.kind == "mean" else pooled
        if self.dimensions is not None:
            vec = vec[: self.dimensions]
        if self.normalize:
            vec = F.normalize(vec, p=2.0, dim=0)
        return vec.tolist()


@dataclass(frozen=True)
class PoolingModel:
    """What the served model's embeddings are (the defaults of every request), and what can be asked of them."""

    default: Pooling
    hidden_size: int
    # Matryoshka: None where the embeddings cannot be shortened; () any length; else the lengths trained.
    matryoshka: tuple[int, ...] | None = None
    # A classifier's outputs, named (None: the model serves embeddings), and how its logits become scores:
    # "classify" (sigmoid of one output, softmax over several), "sigmoid" (each output's), "identity".
    labels: tuple[str, ...] | None = None
    activation: str = "classify"

    def check(self, pooling: Pooling) -> None:
        """``ValueError`` where a request's pooling is not one this model gives."""
        if pooling.classify != (self.labels is not None) or (
            pooling.classify and (pooling.tokens, pooling.two_way) != (self.default.tokens, self.default.two_way)
        ):
            raise ValueError("the request's pooling is not this model's (an embedding model's, or a classifier's)")
        pooling.validate(self.hidden_size, self.matryoshka)

    def activate(self, logits: list[float]) -> list[float]:
        """A classifier's scores from its logits (``activation``)."""
        if self.activation == "identity":
            return list(logits)
        if self.activation == "sigmoid" or len(logits) == 1:
            return [_sigmoid(x) for x in logits]
        top = max(logits)
        exp = [math.exp(x - top) for x in logits]
        total = sum(exp)
        return [e / total for e in exp]

    def describe(self) -> str:
        if self.labels is not None:
            how = "the two tokens' logits' difference" if self.default.two_way else "its head's logits"
            outputs = f"{len(self.labels)} output(s) ({', '.join(self.labels)})"
            return f"a classifier of {outputs} from {how} at the last token, activation {self.activation}"
        kind = {"last": "the last token", "mean": "the mean of the tokens", "cls": "the first token"}[self.default.kind]
        norm = ", L2-normalized" if self.default.normalize else ""
        if self.matryoshka is None:
            short = ""
        else:
            short = f", Matryoshka dimensions {', '.join(map(str, self.matryoshka)) or f'1-{self.hidden_size}'}"
        return f"{self.hidden_size} dimensions from {kind}{norm}{short}"

    def request(self, dimensions: int | None = None, normalize: bool | None = None) -> Pooling:
        """A request's pooling: the model's, with the request's length and normalization; ``ValueError`` when the
        model cannot give that length."""
        if self.labels is not None:
            if dimensions is not None:
                raise ValueError("dimensions: a classifier's outputs cannot be shortened; leave dimensions out")
            return self.default
        pooling = Pooling(
            self.default.kind,
            self.default.normalize if normalize is None else normalize,
            dimensions,
        )
        pooling.validate(self.hidden_size, self.matryoshka)
        return pooling


def gather(req: Any, start: int, reaches_end: bool, part: torch.Tensor | None) -> None:
    """Add what a computed chunk of ``req`` (from prompt position ``start``) gives its embedding; at the prompt's
    end (``reaches_end``), make ``req.embedding``. A request that pools every token takes no cached prefix, so its
    first chunk starts at 0 (also after a retraction: what it gathered before is dropped). Called by the engine
    core, the owner of ``Req``."""
    if start == 0:
        req.pooled = None
    if part is not None:
        req.pooled = part if req.pooled is None else req.pooled + part
    if reaches_end:
        assert req.pooled is not None  # (the chunk that reaches the end always gives a part)
        req.embedding = req.params.pooling.finish(req.pooled, len(req.prompt_ids))
        req.pooled = None


def serves_embeddings(runner: str, folder: Path, hf_config: Any) -> bool:
    """``--runner``: pooling, generate, or auto (pooling for a sentence-transformers folder or a classifier)."""
    if runner == "auto":
        classifier = is_classifier(hf_config) or bool(getattr(hf_config, "classifier_from_token", None))
        return (folder / "modules.json").is_file() or classifier
    return runner == "pooling"


def is_classifier(hf_config: Any) -> bool:
    """Whether the config names a ``*ForSequenceClassification`` architecture (a cross-encoder, a classifier)."""
    archs = getattr(hf_config, "architectures", None) or []
    return bool(archs) and str(archs[0]).endswith(CLASSIFIER_SUFFIX)


def read_pooling(folder: Path, hf_config: Any, tokenizer: Any) -> PoolingModel:
    """The model folder's embedding recipe (sentence-transformers files), else the last token, normalized; for a
    classifier (``read_classifier``), its head. Raises ``ValueError`` for a recipe this server cannot follow (a
    module it does not run, a pooling mode it does not have), naming it."""
    hidden = int(hf_config.hidden_size)
    classifier = read_classifier(hf_config, tokenizer)
    if classifier is not None:
        default, labels, activation = classifier
        return PoolingModel(default, hidden, None, labels, activation)
    default = Pooling("last", True)
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        default = _sentence_transformers(folder, modules_file)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: tuple[int, ...] | None = None
    if dims:
        matryoshka = tuple(sorted(int(d) for d in dims))
    elif getattr(hf_config, "is_matryoshka", False):
        matryoshka = ()
    return PoolingModel(default, hidden, matryoshka)


def read_classifier(hf_config: Any, tokenizer: Any) -> tuple[Pooling, tuple[str, ...], str] | None:
    """A classifier's pooling, output names and activation; None for a model that is no classifier. vLLM's
    ``classifier_from_token`` (tokens whose logits are the outputs) and ``method: from_2_way_softmax`` or
    ``is_original_qwen3_reranker`` (one output: the second token's logit minus the first's) are honoured."""
    from_tokens = getattr(hf_config, "classifier_from_token", None)
    if not is_classifier(hf_config) and not from_tokens:
        return None
    two_way = bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    two_way = two_way or getattr(hf_config, "method", None) == "from_2_way_softmax"
    activation = _activation(hf_config)
    if not from_tokens:
        if two_way:
            raise ValueError("a two-way reranker (from_2_way_softmax) needs classifier_from_token: [no, yes] tokens")
        from radixserve.runtime.models.families import classifier_head  # (the loader's: the engine side)

        n = classifier_head(hf_config)
        id2label = getattr(hf_config, "id2label", None)
        if not isinstance(id2label, dict) or len(id2label) != n:  # (num_labels set over them: transformers' names)
            id2label = {}
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n))
        return Pooling("last", normalize=False, classify=True), labels, activation
    if not isinstance(from_tokens, list) or not from_tokens or not all(isinstance(t, str) for t in from_tokens):
        raise ValueError(f"classifier_from_token must be a list of tokens, got {from_tokens!r}")
    ids = []
    for token in from_tokens:
        token_id = tokenizer.backend_tokenizer.token_to_id(token)
        if token_id is None or not 0 <= token_id < int(hf_config.vocab_size):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this model's vocabulary")
        ids.append(int(token_id))
    if two_way and len(ids) != 2:
        raise ValueError(f"a two-way reranker reads two tokens (no, yes); classifier_from_token has {len(ids)}")
    labels = (from_tokens[1],) if two_way else tuple(from_tokens)
    return Pooling("last", normalize=False, classify=True, tokens=tuple(ids), two_way=two_way), labels, activation


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


# sentence-transformers' CrossEncoder names its activation as a class of torch.nn.modules (vLLM reads it too).
_ST_ACTIVATIONS = {"Sigmoid": "sigmoid", "Softmax": "classify", "Identity": "identity"}


def _activation(hf_config: Any) -> str:
    """A sentence-transformers CrossEncoder's own activation where the config names one, else by transformers'
    ``problem_type``, else sigmoid for one output and softmax over several."""
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name:
        short = str(name).rsplit(".", 1)[-1]
        if short not in _ST_ACTIVATIONS:
            raise ValueError(f"the classifier's activation {name} is not supported (Sigmoid, Softmax and Identity are)")
        return _ST_ACTIVATIONS[short]
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "classify"


def _sentence_transformers(folder: Path, modules_file: Path) -> Pooling:
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{modules_file} is not readable JSON: {exc}") from None
    kinds = [m.get("type", "") for m in modules if isinstance(m, dict)]
    unknown = [k for k in kinds if k not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    if unknown:
        raise ValueError(
            f"{modules_file} has modules this server does not run ({', '.join(unknown)}); it serves a transformer "
            "followed by pooling and normalization"
        )
    pooling_module = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    kind = "last"
    if pooling_module is not None:
        kind = _pooling_mode(folder / str(pooling_module.get("path", "")) / "config.json")
    return Pooling(kind, normalize=_ST_NORMALIZE in kinds)


def _pooling_mode(config_file: Path) -> str:
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the pooling module's {config_file} is not readable JSON: {exc}") from None
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{config_file}: include_prompt false (pooling without the instruction) is not supported")
    modes = [cfg["pooling_mode"]] if isinstance(cfg.get("pooling_mode"), str) else []
    modes += [key.removeprefix("pooling_mode_") for key, on in cfg.items() if key.startswith("pooling_mode_") and on]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(
            f"{config_file}: pooling {' + '.join(modes) or 'none'} is not supported (supported: last token, mean, "
            "first token)"
        )
    return _ST_MODES[modes[0]]
