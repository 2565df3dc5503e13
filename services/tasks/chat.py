"""A prompt's token ids as the policy sees them: the prompt text as it is, or, with the spec's
`chat_template`, a user message (after an optional system message) rendered by the model's chat
template with the generation prompt after it (transformers' `apply_chat_template`, imported only
then).

The rendered text holds the template's special tokens as text; it is encoded without adding
special tokens again, as `apply_chat_template(tokenize=True)` does.
"""

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.contracts.runspec import shorten_path
from services.tasks.base import TaskError

CONFIG_MAX_BYTES = 16 * 1024 * 1024


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the model folder ships a chat template (chat_template.jinja or .json, or a
    `chat_template` in tokenizer_config.json), without loading its tokenizer."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    try:
        if config.stat().st_size > CONFIG_MAX_BYTES:
            return False
        return bool(json.loads(config.read_bytes()).get("chat_template"))
    except (OSError, ValueError, AttributeError):  # missing, not JSON, not an object
        return False


def no_template_error(model_dir: str | Path) -> TaskError:
    return TaskError(
        f"model {shorten_path(model_dir)} has no chat template (tokenizer_config.json "
        "chat_template or chat_template.jinja): run without chat_template"
    )


class PromptEncoder:
    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Tokenizer,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> None:
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.chat = None
        if chat_template:
            if not has_chat_template(model_dir):
                raise no_template_error(model_dir)
            from transformers import AutoTokenizer

            self.chat = AutoTokenizer.from_pretrained(str(model_dir))
            if not self.chat.chat_template:
                raise no_template_error(model_dir)

    def text(self, prompt: str) -> str:
        """What the model is given as text."""
        if self.chat is None:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        rendered = self.chat.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(rendered)

    def encode(self, prompts: list[str]) -> list[list[int]]:
        """Token ids of each prompt (CPU-bound: the coordinator runs it in a thread)."""
        if self.chat is None:
            return [e.ids for e in self.tokenizer.encode_batch(prompts)]
        texts = [self.text(p) for p in prompts]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
