"""One error hierarchy for everything a user can get wrong.

Every error carries a message that names what was wrong and where (file, line,
key, tensor). The CLI prints ``str(error)`` (or its ``cli`` text, where the fix is
spelt as a flag rather than a keyword) and exits non-zero; a traceback is shown
only with ``--debug``.
"""

from __future__ import annotations


class EntrenarError(Exception):
    """Base of all errors that are the user's input, not a bug."""

    cli: str | None = None  # the message in the command line's words (``--overwrite``), where they differ


class ConfigError(EntrenarError):
    """A recipe or override is missing, malformed, or names an unknown key."""


class OutputExistsError(ConfigError):
    """An output would replace an earlier one: the Python message names the keyword, ``cli`` the flag."""

    def __init__(self, message: str, keyword: str = "overwrite=True", flag: str = "--overwrite") -> None:
        """``message`` holds ``{fix}``, filled with ``keyword`` for Python and ``flag`` for the command line."""
        super().__init__(message.replace("{fix}", keyword))
        self.cli = message.replace("{fix}", flag)


class DataError(EntrenarError):
    """A data file is missing, empty, or has a malformed record."""


class ModelError(EntrenarError):
    """A model folder/file cannot be loaded: unknown family, missing or mismatched tensors."""


class AdapterError(EntrenarError):
    """A LoRA adapter is malformed or does not fit the model."""


class CheckpointError(EntrenarError):
    """A training checkpoint is missing, incomplete, or does not match the run."""


class QuantError(EntrenarError):
    """A quantization setting or quantized file is invalid."""


class DistributedError(EntrenarError):
    """Processes of one distributed run disagree (replicas diverged) or one of them failed."""
