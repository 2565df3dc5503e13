"""The files a run spec names, checked where a run is submitted: its model folder and its task
file; and the checks of the text a spec holds (paths, prompt templates).

Not here: the spec's fields (`sections`, `spec`).
"""

import codecs
import json
import re
import stat
import string
from pathlib import Path

MAX_PATH_CHARS = 4096
# a prompt template or system prompt: a longer one, even in JSON's 12-byte escapes, would make a
# body over the API's default limit (64 KiB, a 413) rather than a clear 422
MAX_TEXT_CHARS = 4096
CONFIG_MAX_BYTES = 16 * 1024 * 1024  # a model's config.json
READ_BLOCK_BYTES = 1024 * 1024


MAX_FORMAT_DIGITS = 4  # widths and precisions in a prompt template: at most 9999


class ModelFolderError(ValueError):
    """The model folder named by a spec is missing or is not a Hugging Face model folder."""


class TaskFileError(ValueError):
    """The task file named by a spec is missing, unreadable, too large or not UTF-8 text."""


def shorten_path(path: str | Path) -> str:
    """A path as error messages name it: cut short when long, never with file content."""
    text = str(path)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def check_text_file(path: str, max_bytes: int) -> None:
    """Raise TaskFileError unless `path` is a regular, readable file of at most `max_bytes`
    bytes of UTF-8 text (all of it is read, in blocks)."""
    name = f"task file {shorten_path(path)}"
    try:
        info = Path(path).stat()
    except FileNotFoundError:
        raise TaskFileError(f"{name} does not exist") from None
    except OSError as exc:
        raise TaskFileError(f"{name} cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise TaskFileError(f"{name} is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise TaskFileError(f"{name} is not a regular file")
    if info.st_size > max_bytes:
        raise TaskFileError(
            f"{name} is {info.st_size} bytes, over the limit of {max_bytes} bytes "
            "(SPOTRL_MAX_TASK_FILE_BYTES)"
        )
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    try:
        with open(path, "rb") as fh:
            while block := fh.read(min(READ_BLOCK_BYTES, max_bytes + 1 - offset)):
                decoder.decode(block)
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        where = offset + exc.start
        raise TaskFileError(f"{name} is not UTF-8 text (invalid byte at offset {where})") from None
    except OSError as exc:
        raise TaskFileError(f"{name} cannot be read: {exc.strerror}") from None
    if offset > max_bytes:
        raise TaskFileError(f"{name} grew past the limit of {max_bytes} bytes")


def template_fields(template: str) -> list[str]:
    """The row fields a prompt template names; ValueError unless it is a format string over
    plain field names (`{question}`, `{price:.2f}`): no positional, attribute or index fields,
    no nested or huge widths."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a valid format string: {exc}") from None
    names = []
    for _, name, spec, _ in parts:
        if name is None:
            continue
        if not name or name.isdigit():
            raise ValueError("a positional field ({} or {0}): name a row field, e.g. {question}")
        if "." in name or "[" in name:
            raise ValueError("attribute or index fields ({a.b}, {a[0]}): name a row field")
        if spec and ("{" in spec or re.search(rf"\d{{{MAX_FORMAT_DIGITS + 1},}}", spec)):
            raise ValueError("format specs may not nest fields or exceed a width of 9999")
        names.append(name)
    return names


def no_nul(value: str | None) -> str | None:
    """A path as given; ValueError if it holds a NUL character."""
    if value is not None and "\x00" in value:
        raise ValueError("a path cannot contain a NUL character")
    return value


def check_model_folder(model: str, max_new_tokens: int) -> None:
    """Raise ModelFolderError unless `model` is a readable model folder whose context leaves
    room for a prompt beside `max_new_tokens` (the spec's sampling.max_new_tokens)."""
    try:
        context = _model_context(model)
    except OSError as exc:  # a name too long, a folder that cannot be listed
        raise ModelFolderError(
            f"model folder {shorten_path(model)} cannot be read: {exc.strerror}"
        ) from None
    if context is not None and max_new_tokens >= context:
        raise ModelFolderError(
            f"sampling.max_new_tokens {max_new_tokens} leaves no room for a prompt in the "
            f"model's context of {context} tokens (max_position_embeddings)"
        )


def _model_context(model: str) -> int | None:
    """The context length a model folder's config.json gives, if any; ModelFolderError unless
    it is a Hugging Face model folder."""
    folder, name = Path(model), shorten_path(model)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {name} does not exist")
    for required in ("config.json", "tokenizer.json"):
        if not (folder / required).is_file():
            raise ModelFolderError(f"model folder {name} has no {required}")
    if not any(folder.glob("*.safetensors")):
        raise ModelFolderError(f"model folder {name} has no .safetensors weights")
    config_path = folder / "config.json"
    if config_path.stat().st_size > CONFIG_MAX_BYTES:
        raise ModelFolderError(f"{shorten_path(config_path)} is over {CONFIG_MAX_BYTES} bytes")
    try:
        config = json.loads(config_path.read_bytes().decode())
    except UnicodeDecodeError:
        raise ModelFolderError(f"{shorten_path(config_path)} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise ModelFolderError(f"{shorten_path(config_path)} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFolderError(f"{shorten_path(config_path)} is not a JSON object")
    context = config.get("max_position_embeddings")
    return context if isinstance(context, int) else None
