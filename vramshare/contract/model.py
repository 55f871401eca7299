"""The ``<domain>/model`` annotation codec (issue 23): ``<name>[@<revision>]``."""
from __future__ import annotations

import re
from dataclasses import dataclass

from vramshare.contract._json import ContractError

# -- the model annotation codec (issue 23) ------------------------------------------------------------
MAX_MODEL_NAME = 200  # Hugging Face repo ids are at most 96 chars per part; a path-like name fits
MAX_MODEL_REVISION = 128
MAX_MODEL_CHARS = 512  # name, '@', revision and blanks around them: anything longer is refused unread
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
_MODEL_REV_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ModelRefError(ContractError):
    """A ``model`` annotation (or a cache directory name) that does not name a model; says what to write."""


@dataclass(frozen=True, order=True)
class ModelRef:
    """A model's identity: ``name`` (``org/name`` or a plain name) and optional ``revision`` (a commit
    hash, tag or branch). ``""`` revision means "any revision" when matched against what a node holds."""

    name: str
    revision: str = ""

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}" if self.revision else self.name

    def matches(self, held: "ModelRef") -> bool:
        """Does a node's copy ``held`` serve this ask? Same name, and same revision when one is asked."""
        return self.name == held.name and (not self.revision or self.revision == held.revision)


def parse_model_ref(text: object) -> ModelRef:
    """``<name>[@<revision>]`` -> :class:`ModelRef`; raises :class:`ModelRefError` naming what is wrong.

    Names are path-like (``meta-llama/Llama-3.1-8B-Instruct``): letters, digits, ``.``, ``_``, ``-``
    in ``/``-separated parts, no ``..`` part (the name becomes a cache path on the node)."""
    if not isinstance(text, str):
        raise ModelRefError(f"model: expected a string, got {type(text).__name__}")
    if len(text) > MAX_MODEL_CHARS:
        raise ModelRefError(f"model: {len(text)} characters, more than {MAX_MODEL_CHARS}")
    name, sep, rev = text.strip().partition("@")
    if not name:
        raise ModelRefError(f"model {text!r}: empty name (want <name>[@<revision>])")
    if len(name) > MAX_MODEL_NAME or not _MODEL_NAME_RE.fullmatch(name) or ".." in name.split("/"):
        raise ModelRefError(f"model {text!r}: name must be letters, digits, '.', '_', '-' in '/'-separated "
                            f"parts, at most {MAX_MODEL_NAME} characters")
    if sep and (not rev or len(rev) > MAX_MODEL_REVISION or not _MODEL_REV_RE.fullmatch(rev)):
        raise ModelRefError(f"model {text!r}: revision after '@' must be letters, digits, '.', '_', '-', "
                            f"at most {MAX_MODEL_REVISION} characters")
    return ModelRef(name, rev)




def encode_model_ref(ref: ModelRef) -> str:
    """The annotation text of ``ref``; raises :class:`ModelRefError` for what :func:`parse_model_ref` refuses."""
    text = str(ref)
    if parse_model_ref(text) != ref:
        raise ModelRefError(f"model {text!r}: does not read back as itself")
    return text
