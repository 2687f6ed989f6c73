"""Models by Hugging Face Hub id: a name that is not a local path, resolved to a folder of the local Hub cache.

    resolve("Qwen/Qwen3-0.6B")                 # .../hub/models--Qwen--Qwen3-0.6B/snapshots/<commit>
    resolve("Qwen/Qwen3-0.6B@v1.0")            # a branch, tag or commit hash after '@'
    resolve("org/name-GGUF/model-Q4_K_M.gguf") # one GGUF file of a repository (optionally @revision too)
    resolve("models/my-model")                 # a local folder that exists wins over an id of that spelling

Every place that takes a model (a recipe's ``model.path``, an adapter, a merge input, ``tokenizer_source``, the
CLI's MODEL and ``--adapter``) resolves through :func:`resolve`, so each accepts the same spellings. Files come
through ``huggingface_hub.snapshot_download`` into the standard cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``), only those entrenar reads (:data:`ALLOW_PATTERNS`); a cached snapshot is used
without a download when the Hub cannot be reached, and ``HF_HUB_OFFLINE=1`` never asks it. An id that is neither
cached nor reachable is a :class:`~entrenar.errors.ModelError` naming the id, the revision and the cache folder,
and how to get it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.utils import (  # where huggingface_hub 0.24 (our floor) to 2.x export them
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    validate_repo_id,
)

from entrenar.errors import ModelError

# What entrenar reads of a model or adapter repository; weights in pickles (pytorch_model.bin) are never loaded.
ALLOW_PATTERNS = (
    "config.json", "generation_config.json",
    "*.safetensors", "*.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt",
    "chat_template.jinja", "chat_template.json",
    "adapter_config.json",
)
SPELLINGS = "ORG/NAME, ORG/NAME@REVISION or ORG/NAME/FILE.gguf"
_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubId:
    """A Hub model repository, the revision asked for (None: its default branch) and optionally one file in it."""

    repo: str
    revision: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return self.repo + (f"/{self.file}" if self.file else "") + (f"@{self.revision}" if self.revision else "")


def _malformed(text: str, why: str) -> ModelError:
    return ModelError(f"{text}: no such local file or folder, and not a Hugging Face Hub id ({why}; an id is "
                      f"{SPELLINGS})")


def parse_hub_id(text: str) -> HubId | None:
    """The Hub id ``text`` spells, or None when it is written as a local path (absolute, ``./``, ``~``, one part,
    or ``folder/file.gguf``). A name that is neither (``a/b/c/d``, ``org/name@``) is a ModelError saying why."""
    if text.startswith(("/", ".", "~")) or "\\" in text or re.match(r"[A-Za-z]:", text):
        return None
    name, at, revision = text.partition("@")
    parts = name.split("/")
    if len(parts) == 1 and not at:
        return None
    if len(parts) == 2 and parts[1].endswith(".gguf") and not at:
        return None  # folder/file.gguf: a missing local file; a GGUF file of a repository is ORG/NAME/FILE.gguf
    if at and not revision.strip():
        raise _malformed(text, "nothing follows '@'")
    if len(parts) < 2 or any(not p for p in parts):
        raise _malformed(text, "an empty part" if any(not p for p in parts) else "no organisation")
    if len(parts) > 2 and not parts[-1].endswith(".gguf"):
        raise _malformed(text, f"{len(parts)} parts")
    repo = "/".join(parts[:2])
    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise _malformed(text, str(e).rstrip(".")) from None
    return HubId(repo, revision or None, "/".join(parts[2:]) or None)


def hub_cache() -> Path:
    """The Hub cache folder huggingface_hub uses (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``, as read when huggingface_hub was imported)."""
    return Path(constants.HF_HUB_CACHE).expanduser()


def is_offline() -> bool:
    """Whether the Hub must not be asked: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) now or when
    huggingface_hub was imported."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or env.strip().lower() in _TRUE


def split_revision(name: str | None) -> tuple[str | None, str | None]:
    """``(name, None)``, or ``(org/name, revision)`` for a Hub id written ``org/name@revision`` that is no local
    path: how PEFT's adapter_config.json names a base (``base_model_name_or_path``, ``revision``)."""
    if name is None or "@" not in name or Path(name).expanduser().exists():
        return name, None
    try:
        hub_id = parse_hub_id(name)
    except ModelError:
        return name, None
    if hub_id is None or hub_id.file is not None:
        return name, None
    return hub_id.repo, hub_id.revision


_resolved: dict[tuple[HubId, Path, bool], Path] = {}  # one look-up on the Hub per id and process


def resolve(reference: str | os.PathLike[str], revision: str | None = None) -> Path:
    """The local path ``reference`` stands for: itself when it exists or is written as a path, else the cached
    snapshot (folder, or the named .gguf file) of the Hub id it spells, downloaded first when the Hub is reachable.

    ``revision`` (a branch, tag or commit; from an adapter_config.json, say) applies to an id without ``@``."""
    text = os.fspath(reference)
    if not text.strip():
        raise ModelError("a model name is empty: give a local folder or file, or a Hub id "
                         f"({SPELLINGS})")
    path = Path(text).expanduser()
    if path.exists():
        return path
    hub_id = parse_hub_id(text)
    if hub_id is None or Path(hub_id.repo.split("/")[0]).expanduser().is_dir():
        return path  # written as a path, or in a local folder (`runs/my-rn`): a typo there is not a Hub id
    if revision and not hub_id.revision:
        hub_id = HubId(hub_id.repo, revision, hub_id.file)
    return fetch(hub_id)


def fetch(hub_id: HubId) -> Path:
    """The cached snapshot of ``hub_id`` (its folder, or its file), fetched through huggingface_hub."""
    cache, offline = hub_cache(), is_offline()
    key = (hub_id, cache, offline)
    if key in _resolved and _resolved[key].exists():
        return _resolved[key]
    revision = hub_id.revision or "main"
    named = f"{hub_id} (revision {revision})"
    get = f"hf download {hub_id.repo}" + (f" {hub_id.file}" if hub_id.file else "") + (
        f" --revision {hub_id.revision}" if hub_id.revision else "")
    try:
        folder = Path(snapshot_download(hub_id.repo, revision=hub_id.revision, cache_dir=cache,
                                        local_files_only=offline,
                                        allow_patterns=[hub_id.file] if hub_id.file else list(ALLOW_PATTERNS)))
    except LocalEntryNotFoundError as e:
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x: files of the snapshot missing
            raise ModelError(f"{named}: the cached copy in {cache} is incomplete and the Hub cannot be reached to "
                             f"complete it ({e}); run once with network access, or `{get}`") from None
        why = ("HF_HUB_OFFLINE is set, so the Hub is not asked: unset it and run once with network access"
               if offline else "the Hub cannot be reached: run once with network access")
        raise ModelError(f"{named}: no such local file or folder, and the model is not in the Hugging Face cache "
                         f"{cache}; {why}, or fetch it beforehand with `{get}` (HF_HUB_CACHE or HF_HOME choose "
                         "the cache folder)") from None
    except GatedRepoError:
        raise ModelError(f"{named}: a gated model; accept its license on https://huggingface.co/{hub_id.repo} "
                         "and log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{named}: no such local file or folder, and no such model on the Hugging Face Hub "
                         "(a private one needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelError(f"{named}: the Hub model {hub_id.repo} has no revision {revision!r}") from None
    except (HfHubHTTPError, HFValidationError, OSError, ValueError) as e:
        raise ModelError(f"{named}: cannot be fetched from the Hugging Face Hub into {cache}: {e}") from None
    path = folder / hub_id.file if hub_id.file else folder
    if not path.exists():
        raise ModelError(f"{named}: no file {hub_id.file} in the snapshot {folder}" + (
            "; HF_HUB_OFFLINE is set, so only files already cached are seen" if offline else ""))
    _resolved[key] = path
    return path


__all__ = ["ALLOW_PATTERNS", "HubId", "fetch", "hub_cache", "is_offline", "parse_hub_id", "resolve", "split_revision"]
