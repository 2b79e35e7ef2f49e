"""Resolves a configured model `source` into a local MLX model directory.

A source is one of: a local model directory (MLX or Hugging Face layout), a local `.gguf` file
(converted once into the cache), or a Hugging Face repo id `owner/name[@revision]`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Literal, NamedTuple

from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from appliance.models.gguf import ModelSourceError, convert_gguf, fingerprint
from appliance.models.manifest import verify

__all__ = ["ModelSourceError", "SourceKind", "describe_source", "materialize"]

SourceKind = Literal["mlx-dir", "gguf", "hf-repo"]

HUB_TIMEOUT_S = 10.0
# What mlx_lm itself fetches, less remote code: config, tokenizer, chat template and weights.
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
_LOCAL_PREFIXES = ("./", "../", "/", "~")

log = logging.getLogger(__name__)


class Located(NamedTuple):
    """What a source names: its kind and, for local kinds, the resolved path."""

    kind: SourceKind
    path: Path | None


def describe_source(source: str, base_dir: Path) -> SourceKind:
    """Return the kind of model `source` names: "mlx-dir", "gguf" or "hf-repo".

    Raises ModelSourceError when it names nothing usable (a missing path, a non-model directory).
    """
    return _locate(source, base_dir).kind


def materialize(source: str, *, base_dir: Path, cache_dir: Path, dtype: str) -> Path:
    """Return a local MLX model directory for `source`, converting or downloading it if needed.

    Relative paths resolve against `base_dir` (the config file's directory); GGUF conversions
    are kept under `cache_dir / "models"`, keyed by file content and dtype, and reused.
    """
    located = _locate(source, base_dir)
    if located.path is None:
        return _downloaded(source)
    if located.kind == "gguf":
        return _converted(source, located.path, cache_dir, dtype)
    return located.path


def converted_dir(gguf_path: Path, cache_dir: Path, dtype: str) -> Path:
    """Return where the conversion of `gguf_path` to `dtype` lives in the cache."""
    return cache_dir / "models" / f"{gguf_path.stem}-{fingerprint(gguf_path)[:16]}-{dtype}"


def _locate(source: str, base_dir: Path) -> Located:
    """Return what `source` names; raises ModelSourceError when it names nothing usable."""
    path = Path(source).expanduser()
    path = path if path.is_absolute() else base_dir / path
    looks_local = source.startswith(_LOCAL_PREFIXES) or source.endswith(".gguf")
    if not looks_local and not path.exists():
        if _REPO_ID.fullmatch(source):
            return Located("hf-repo", None)
        raise ModelSourceError(
            f"model source {source!r} is neither a local path nor a Hugging Face repo id (owner/name[@revision])"
        )
    path = path.resolve()
    if not path.exists():
        raise ModelSourceError(f"model source {source!r}: no such file or directory ({path})")
    if path.is_file():
        if path.suffix == ".gguf":
            return Located("gguf", path)
        raise ModelSourceError(f"model source {source!r} is a file but not a .gguf file ({path})")
    if not _is_model_dir(path):
        raise ModelSourceError(
            f"model source {source!r} is not a model directory: it needs config.json and *.safetensors ({path})"
        )
    return Located("mlx-dir", path)


def _is_model_dir(path: Path) -> bool:
    """Return whether `path` holds what mlx_lm loads: config.json and safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _converted(source: str, gguf_path: Path, cache_dir: Path, dtype: str) -> Path:
    """Return the cached MLX conversion of `gguf_path`, converting it first if absent."""
    out_dir = converted_dir(gguf_path, cache_dir, dtype)
    if out_dir.is_dir():
        problem = verify(out_dir)
        if problem is None:
            return out_dir
        log.warning("the conversion at %s does not verify (%s); converting %s again", out_dir, problem, gguf_path)
    else:
        log.info("converting %s to %s (%s); done once, reused later", gguf_path, out_dir, dtype)
    try:
        return convert_gguf(gguf_path, out_dir, dtype=dtype)
    except ModelSourceError as exc:
        if source in str(exc):
            raise
        raise ModelSourceError(f"model source {source!r}: {exc}") from exc
    except OSError as exc:
        raise ModelSourceError(f"model source {source!r}: conversion into {out_dir} failed: {exc}") from exc


def _downloaded(source: str) -> Path:
    """Return the local snapshot of the Hugging Face repo `source`, downloading what is missing."""
    repo_id, _, rev = source.partition("@")
    revision = rev or None
    try:
        # The hub client has no timeout of its own; this bounded probe fails fast when offline.
        HfApi().repo_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
    except RevisionNotFoundError as exc:
        raise ModelSourceError(f"could not download {source}: {repo_id} has no revision {rev!r}") from exc
    except RepositoryNotFoundError as exc:
        raise ModelSourceError(
            f"could not download {source}: the Hugging Face hub has no such repository, or it is private or gated "
            "(log in with `hf auth login`, or set source to a local directory)"
        ) from exc
    except Exception as exc:  # no connection, timeout, offline mode, hub error: try the local cache
        return _cached_snapshot(source, repo_id, revision, reason=_reason(exc))
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, etag_timeout=HUB_TIMEOUT_S)
    except Exception as exc:
        raise ModelSourceError(
            f"could not download {source}: {_reason(exc)}; try again, or set source to a local directory"
        ) from exc
    return _checked_snapshot(source, Path(path))


def _cached_snapshot(source: str, repo_id: str, revision: str | None, *, reason: str) -> Path:
    """Return the repo's snapshot from the local Hugging Face cache; the hub is out of reach."""
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True)
    except OSError as exc:
        raise ModelSourceError(
            f"could not download {source}: hub unreachable ({reason}) and not in the local Hugging Face cache; "
            f"download it on a machine with internet (`hf download {repo_id}`) and set source to the local directory"
        ) from exc
    return _checked_snapshot(source, Path(path))


def _checked_snapshot(source: str, path: Path) -> Path:
    """Return `path` if it is a loadable model directory (repos of .bin or .gguf files are not)."""
    if not _is_model_dir(path):
        raise ModelSourceError(
            f"model source {source!r}: the repository has no config.json with *.safetensors weights "
            "(for a GGUF-only repo, download the .gguf file and set source to its path)"
        )
    return path


def _reason(exc: BaseException) -> str:
    """Return a one-line explanation of why the hub could not be reached."""
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    first_line = str(exc).splitlines()[0] if str(exc) else "no details"
    return f"{type(exc).__name__}: {first_line}"
